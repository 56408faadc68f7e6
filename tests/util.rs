//! Integration tests for `mooncake::util` (CRC-32C and the linear-time regex).

use mooncake::util::crc32c::{
    crc32c, crc32c_append, crc32c_software, crc32c_software_append, hardware_accelerated,
};
use mooncake::util::regex::{Regex, RegexError};

/// Deterministic xorshift64 byte generator.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

// ---------------------------------------------------------------------------
// CRC-32C
// ---------------------------------------------------------------------------

#[test]
fn crc32c_known_answers() {
    for f in [crc32c, crc32c_software] {
        assert_eq!(f(b""), 0);
        assert_eq!(f(b"123456789"), 0xE306_9283);
        assert_eq!(f(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(f(&[0xFFu8; 32]), 0x62A8_AB43);
        // RFC 3720 (iSCSI) B.4: 32 bytes counting up, then down.
        let up: Vec<u8> = (0u8..32).collect();
        let down: Vec<u8> = (0u8..32).rev().collect();
        assert_eq!(f(&up), 0x46DD_794E);
        assert_eq!(f(&down), 0x113F_DB5C);
    }
}

#[test]
fn crc32c_hardware_and_software_agree() {
    eprintln!("crc32c hardware acceleration: {}", hardware_accelerated());
    let data = random_bytes(200_000, 42);
    // Every length up to a few interleaved short blocks, at every alignment.
    for offset in 0..8 {
        for len in 0..1600 {
            let slice = &data[offset..offset + len];
            assert_eq!(
                crc32c(slice),
                crc32c_software(slice),
                "len {len} offset {offset}"
            );
        }
    }
    // Lengths around the long-block boundary (3 × 8192) and beyond.
    for &len in &[
        24_575, 24_576, 24_577, 25_343, 25_344, 25_345, 49_152, 60_000, 131_071, 199_990,
    ] {
        for offset in [0, 1, 3, 5, 7] {
            let slice = &data[offset..offset + len];
            assert_eq!(
                crc32c(slice),
                crc32c_software(slice),
                "len {len} offset {offset}"
            );
        }
    }
}

#[test]
fn crc32c_append_is_streaming() {
    let data = random_bytes(100_000, 7);
    let whole = crc32c(&data);
    assert_eq!(crc32c_software(&data), whole);
    assert_eq!(crc32c_append(0, &data), whole);

    // Feed the data in uneven pieces.
    let mut hw = 0;
    let mut sw = 0;
    let mut pos = 0;
    let mut step = 1;
    while pos < data.len() {
        let end = (pos + step).min(data.len());
        hw = crc32c_append(hw, &data[pos..end]);
        sw = crc32c_software_append(sw, &data[pos..end]);
        pos = end;
        step = step * 3 % 30_011 + 1;
    }
    assert_eq!(hw, whole);
    assert_eq!(sw, whole);

    for split in [0, 1, 7, 8, 9, 4095, 50_000, 99_999, 100_000] {
        let (a, b) = data.split_at(split);
        assert_eq!(crc32c_append(crc32c(a), b), whole, "split {split}");
        assert_eq!(
            crc32c_append(crc32c(a), b),
            crc32c_software_append(crc32c_software(a), b)
        );
    }
    assert_eq!(crc32c_append(crc32c(b"1234"), b"56789"), 0xE306_9283);
}

/// Throughput on a 64 MiB buffer. Run with
/// `cargo test --release --test util -- --ignored --nocapture crc32c_throughput`.
#[test]
#[ignore = "benchmark; run explicitly in release mode"]
fn crc32c_throughput() {
    use std::time::Instant;
    let data = random_bytes(64 << 20, 1);
    let measure = |name: &str, f: fn(&[u8]) -> u32| {
        let mut best = f64::MAX;
        let mut result = 0;
        for _ in 0..5 {
            let start = Instant::now();
            result = std::hint::black_box(f(std::hint::black_box(&data)));
            best = best.min(start.elapsed().as_secs_f64());
        }
        eprintln!(
            "{name}: {:.2} GB/s ({:.2} ms per 64 MiB, crc {result:08x})",
            data.len() as f64 / best / 1e9,
            best * 1e3
        );
        result
    };
    let hw = measure("crc32c (dispatch)", crc32c);
    let sw = measure("crc32c_software  ", crc32c_software);
    assert_eq!(hw, sw);
    eprintln!("hardware_accelerated = {}", hardware_accelerated());
}

// ---------------------------------------------------------------------------
// Regex
// ---------------------------------------------------------------------------

#[rustfmt::skip]
const CASES: &[(&str, &str, bool)] = &[
    // Literals and search semantics.
    ("abc", "abc", true),
    ("abc", "xabcx", true),
    ("abc", "ab", false),
    ("abc", "acb", false),
    ("", "", true),
    ("", "anything", true),
    ("日本", "こんにちは日本語", true),
    ("a]b}", "a]b}", true),
    // Anchors.
    ("^abc", "abcdef", true),
    ("^abc", "xabc", false),
    ("abc$", "xxabc", true),
    ("abc$", "abcx", false),
    ("abc$", "abc\n", false),
    ("^abc$", "abc", true),
    ("^abc$", "abcabc", false),
    ("^$", "", true),
    ("^$", "a", false),
    ("$a", "a", false),
    ("a^", "a", false),
    ("^cat|dog$", "catfish", true),
    ("^cat|dog$", "hotdogs", false),
    ("^cat|dog$", "hotdog", true),
    // Dot.
    ("a.c", "abc", true),
    ("a.c", "a\nc", false),
    ("a.c", "a€c", true),
    ("^.$", "€", true),
    ("^...$", "日本語", true),
    ("^..$", "日本語", false),
    // Classes.
    ("[abc]", "xxbxx", true),
    ("[abc]", "xyz", false),
    ("^[a-z0-9_]+$", "key_01", true),
    ("^[a-z0-9_]+$", "Key_01", false),
    ("[^abc]", "abc", false),
    ("[^abc]", "abcd", true),
    ("^[^/]+$", "a/b", false),
    ("^[^a]$", "€", true),
    ("[]a]", "]", true),
    ("[^]a]", "]", false),
    ("[a-]", "-", true),
    ("[-a]", "-", true),
    ("[\\]]", "]", true),
    ("[\\d.]+x", "3.14x", true),
    ("^[\\w-]+$", "my-key_1", true),
    ("^[\\w-]+$", "my key", false),
    ("^[\\S]+$", "a\tb", false),
    ("^[α-ω]+$", "αβγ", true),
    ("^[α-ω]+$", "αβγA", false),
    ("[.]", "a", false),
    // Escapes.
    ("\\d+", "abc123", true),
    ("\\d", "abc", false),
    ("^\\w+$", "hello_World9", true),
    ("^\\w+$", "hello world", false),
    ("\\s", "a b", true),
    ("\\s", "ab", false),
    ("^\\D+$", "abc", true),
    ("^\\D+$", "ab1", false),
    ("^\\W$", "-", true),
    ("^\\W$", "_", false),
    ("^\\S+$", "a\tb", false),
    ("a\\.b", "a.b", true),
    ("a\\.b", "axb", false),
    ("\\\\", "a\\b", true),
    ("\\(\\)\\[\\]\\{\\}\\*\\+\\?\\|\\^\\$", "()[]{}*+?|^$", true),
    ("a\\tb\\n", "a\tb\n", true),
    // Quantifiers.
    ("a*", "", true),
    ("^a*$", "aaaa", true),
    ("^a*$", "aaba", false),
    ("^a+$", "", false),
    ("^a+$", "aaa", true),
    ("^ab?c$", "ac", true),
    ("^ab?c$", "abc", true),
    ("^ab?c$", "abbc", false),
    ("a*?b", "aab", true),
    ("^a+?$", "aaa", true),
    ("^a??b$", "ab", true),
    // Counted repetition.
    ("^a{3}$", "aaa", true),
    ("^a{3}$", "aa", false),
    ("^a{3}$", "aaaa", false),
    ("^a{2,}$", "aa", true),
    ("^a{2,}$", "a", false),
    ("^a{2,}$", "aaaaaaa", true),
    ("^a{2,4}$", "aaaa", true),
    ("^a{2,4}$", "aaaaa", false),
    ("^a{2,4}$", "a", false),
    ("^a{0,1}b$", "b", true),
    ("^a{0}b$", "b", true),
    ("^a{0}b$", "ab", false),
    ("^(ab){2}$", "abab", true),
    ("^(ab){2}$", "aba", false),
    ("^[0-9a-f]{8}-[0-9a-f]{4}$", "deadbeef-cafe", true),
    ("^[0-9a-f]{8}-[0-9a-f]{4}$", "deadbeef-caf", false),
    // Alternation and groups.
    ("cat|dog", "hotdog", true),
    ("cat|dog", "cow", false),
    ("^(cat|dog)$", "cat", true),
    ("^(cat|dog)$", "cats", false),
    ("a|", "zzz", true),
    ("|a", "zzz", true),
    ("^(a|)$", "", true),
    ("^(a|)$", "a", true),
    ("^(a|)$", "aa", false),
    ("^(|a)b$", "b", true),
    ("^(a|b|)+$", "abba", true),
    ("^((a|b)c)+$", "acbc", true),
    ("^((a|b)c)+$", "acbd", false),
    ("^(a(b(c|d))*)+$", "abcabd", true),
    ("^(a(b(c|d))*)+$", "abcbe", false),
    ("^(?:ab|cd)+$", "abcdab", true),
    ("^x(a|bc){2,3}y$", "xabcy", true),
    ("^x(a|bc){2,3}y$", "xay", false),
    ("^x(a|bc){2,3}y$", "xbcbcay", true),
    ("^x(a|bc){2,3}y$", "xabcbcay", false),
    ("^(a*)*$", "aaa", true),
    ("^(a*)+b$", "aab", true),
    ("^(a*|b)*c$", "abbac", true),
    ("()", "", true),
    ("^()$", "", true),
    ("^(){3}x$", "x", true),
    ("^(^a|b)+$", "abb", true),
    ("^(^a|b)+$", "aba", false),
    // Realistic object keys.
    ("^mooncake:[0-9]+:layer[0-9]{1,2}$", "mooncake:42:layer7", true),
    ("^mooncake:[0-9]+:layer[0-9]{1,2}$", "mooncake:42:layer123", false),
    ("prefix/.*/suffix$", "prefix/a/b/suffix", true),
    ("^model-(7b|13b)/.+\\.kv$", "model-13b/block_3.kv", true),
    ("^model-(7b|13b)/.+\\.kv$", "model-70b/block_3.kv", false),
];

#[test]
fn regex_case_table() {
    assert!(CASES.len() >= 60);
    let mut failures = Vec::new();
    for &(pattern, text, expected) in CASES {
        let re = Regex::new(pattern).unwrap_or_else(|e| panic!("{pattern:?}: {e}"));
        if re.is_match(text) != expected {
            failures.push(format!("{pattern:?} on {text:?}: expected {expected}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn regex_counted_repetition_limits() {
    let re = Regex::new("^x{1000}$").unwrap();
    assert!(re.is_match(&"x".repeat(1000)));
    assert!(!re.is_match(&"x".repeat(999)));
    assert!(!re.is_match(&"x".repeat(1001)));
    let re = Regex::new("^(ab){0,1000}$").unwrap();
    assert!(re.is_match(&"ab".repeat(1000)));
    assert!(!re.is_match(&"ab".repeat(1001)));
    // 99 × 1000 + 1 instructions: just under the program limit.
    assert!(Regex::new("(a{1000}){99}").is_ok());
}

#[test]
fn regex_errors_report_positions() {
    #[rustfmt::skip]
    let cases: &[(&str, usize)] = &[
        ("(", 0),
        ("ab(cd", 2),
        ("é(", 2),
        (")", 0),
        ("ab)", 2),
        ("(a))", 3),
        ("[abc", 0),
        ("x[", 1),
        ("[]", 0),
        ("[z-a]", 1),
        ("[\\d-z]", 3),
        ("[a-\\d]", 3),
        ("[[:alpha:]]", 1),
        ("[a&&b]", 2),
        ("[a--b]", 2),
        ("*a", 0),
        ("a|*", 2),
        ("(+)", 1),
        ("a**", 2),
        ("a*+", 2),
        ("a{2}{3}", 4),
        ("a{1001}", 2),
        ("a{3,2}", 1),
        ("a{2,1001}", 4),
        ("a{", 1),
        ("a{x}", 2),
        ("a{,3}", 2),
        ("a{2", 1),
        ("a{2,3", 1),
        ("a{2x}", 3),
        ("\\", 0),
        ("ab\\", 2),
        ("\\b", 0),
        ("a\\p{L}", 1),
        ("\\1", 0),
        ("(?i)abc", 0),
        ("(?P<n>a)", 0),
        ("(a{1000}){100}", 0),
    ];
    for &(pattern, position) in cases {
        match Regex::new(pattern) {
            Ok(_) => panic!("{pattern:?} should be rejected"),
            Err(e) => assert_eq!(e.position, position, "{pattern:?}: {e}"),
        }
    }

    let err = Regex::new("ab)").unwrap_err();
    assert_eq!(err.reason, "unmatched ')'");
    assert_eq!(err.to_string(), "invalid regex at byte 2: unmatched ')'");
    let boxed: Box<dyn std::error::Error> = Box::new(err.clone());
    assert_eq!(boxed.to_string(), err.to_string());

    let long = "a".repeat(4097);
    assert_eq!(Regex::new(&long).unwrap_err().position, 4096);
    assert!(Regex::new(&"a".repeat(4096)).is_ok());

    let deep = format!("{}a{}", "(".repeat(300), ")".repeat(300));
    assert_eq!(Regex::new(&deep).unwrap_err().position, 250);
    let ok = format!("{}a{}", "(".repeat(250), ")".repeat(250));
    assert!(Regex::new(&ok).unwrap().is_match("a"));

    let e: RegexError = "a{".parse::<Regex>().unwrap_err();
    assert_eq!(e.reason, "unclosed counted repetition");
}

#[test]
fn regex_pathological_patterns_are_linear() {
    let many_a = "a".repeat(10_000);
    let with_b = format!("{many_a}b");
    for pattern in [
        "(a*)*b",
        "(a|a)*b",
        "(a+)+b",
        "^(a|aa)+$c",
        "(x+x+)+y",
        "(a*)*(a*)*b",
    ] {
        let re = Regex::new(pattern).unwrap();
        assert!(!re.is_match(&many_a), "{pattern}");
    }
    for pattern in ["(a*)*b", "(a|a)*b", "(a+)+b", "^(a|aa)+b$"] {
        assert!(Regex::new(pattern).unwrap().is_match(&with_b), "{pattern}");
    }
    // The classic exponential case for backtrackers: (a?){n}a{n} on a^n.
    let re = Regex::new("^(a?){500}a{500}$").unwrap();
    assert!(re.is_match(&"a".repeat(500)));
    assert!(re.is_match(&"a".repeat(1000)));
    assert!(!re.is_match(&"a".repeat(1001)));
}

#[test]
fn regex_misc_api() {
    let re: Regex = "^k[0-9]+$".parse().unwrap();
    assert_eq!(re.as_str(), "^k[0-9]+$");
    assert_eq!(re.to_string(), "^k[0-9]+$");
    let copy = re.clone();
    assert!(copy.is_match("k12") && !copy.is_match("k"));
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Regex>();
}
