//! The regex engine behind remove-by-regex: the first line is the pattern, the rest the
//! text. Compiling is bounded, matching within a budget never spends more than it was
//! given, and an answer found within a budget is the answer with any larger one.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::util::regex::Regex;

const BUDGET: u64 = 200_000;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (pattern, subject) = text.split_once('\n').unwrap_or((text, ""));
    let Ok(re) = Regex::new(pattern) else {
        return;
    };
    assert_eq!(re.as_str(), pattern);
    let mut small = BUDGET / 10;
    let first = re.is_match_within(subject, &mut small);
    assert!(small <= BUDGET / 10);
    let mut large = BUDGET;
    let second = re.is_match_within(subject, &mut large);
    if let Some(answer) = first {
        assert_eq!(second, Some(answer), "pattern {pattern:?}");
    }
});
