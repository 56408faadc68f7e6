//! Lower-case hex strings for binary values carried in JSON descriptors (endpoint
//! addresses, IPC handles).

/// Lower-case hex of `bytes`.
pub fn encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `None` for an empty or odd-length string or a non-hex digit.
pub fn decode(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || s.is_empty() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        assert_eq!(super::encode(&[0, 10, 255]), "000aff");
        assert_eq!(super::decode("0a0B"), Some(vec![10, 11]));
        assert_eq!(
            super::decode(&super::encode(&[1, 2, 3])),
            Some(vec![1, 2, 3])
        );
        assert_eq!(super::decode("0"), None);
        assert_eq!(super::decode(""), None);
        assert_eq!(super::decode("zz"), None);
    }
}
