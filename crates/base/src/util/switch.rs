//! The one spelling of an on/off setting shared by the C ABI, the CLI and the
//! environment: `1`/`true`/`on` or `0`/`false`/`off`, any case.

/// The switch `value` names, or `None` for anything else.
pub fn parse(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" => Some(true),
        "0" | "false" | "off" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn both_spellings_in_any_case_and_nothing_else() {
        for v in ["1", "true", "TRUE", "on", " On "] {
            assert_eq!(super::parse(v), Some(true), "{v:?}");
        }
        for v in ["0", "false", "False", "off"] {
            assert_eq!(super::parse(v), Some(false), "{v:?}");
        }
        for v in ["", "yes", "2", "maybe", "of"] {
            assert_eq!(super::parse(v), None, "{v:?}");
        }
    }
}
