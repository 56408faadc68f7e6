//! Byte sizes as people write them, one grammar for every flag, config key and
//! benchmark: a number, decimals allowed, with an optional binary unit (`K`, `M`, `G`,
//! `T`, `P`, also `KB`/`KiB`, any case, a space allowed before it); a bare number is
//! bytes. `4096`, `4K`, `512 MB`, `1.5GiB`. And one way to print them back.

/// The bytes `text` names (rounded down), or why it names none.
pub fn parse(text: &str) -> Result<u64, String> {
    let t = text.trim();
    // Plain integers exactly (no trip through f64 for large counts).
    if let Ok(n) = t.parse::<u64>() {
        return Ok(n);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4096, 512M, 1.5GiB)"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (K, M, G, T, P)")),
    };
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{text:?} is too large"));
    }
    Ok(bytes.floor() as u64)
}

/// `n` bytes for people: `512 B`, `1.50 KiB`, `64.00 MiB`, ...
pub fn format(n: u64) -> String {
    human(n as f64)
}

/// As `format`, for a byte count that need not be whole (a size per token, say).
pub fn human(bytes: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_one_way_everywhere() {
        for (text, bytes) in [
            ("4096", 4096),
            ("4K", 4 << 10),
            ("4k", 4 << 10),
            ("1M", 1 << 20),
            ("2GiB", 2 << 30),
            ("64GB", 64 << 30),
            ("512 MB", 512 << 20),
            ("1.5G", 3 << 29),
            ("1T", 1 << 40),
            (" 7 ", 7),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(parse(text), Ok(bytes), "{text}");
        }
        for bad in ["", "lots", "12Q", "-1", "1e3", "K", "99999999P"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(format(512), "512 B");
        assert_eq!(format(1536), "1.50 KiB");
        assert_eq!(format(64 << 20), "64.00 MiB");
        assert_eq!(format(3 << 30), "3.00 GiB");
        assert_eq!(human(12.5), "12.5 B");
    }
}
