//! Bounded randomized tests for `mooncake::json`.
//!
//! Deterministic (fixed seed); set `MC_FUZZ_ITERS` to run more cases.

use mooncake::json::{parse, parse_bytes, Number, Value, MAX_DEPTH};

const DEFAULT_ITERS: usize = 20_000;

fn iters() -> usize {
    std::env::var("MC_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_ITERS)
}

/// xorshift64* PRNG.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }
}

const CHAR_POOL: &[char] = &[
    'a',
    'z',
    'A',
    '0',
    '9',
    ' ',
    '"',
    '\\',
    '/',
    '\n',
    '\r',
    '\t',
    '\u{0}',
    '\u{1}',
    '\u{8}',
    '\u{c}',
    '\u{1f}',
    '\u{7f}',
    'é',
    'ß',
    '中',
    '\u{2028}',
    '\u{fffd}',
    '\u{ffff}',
    '😀',
    '\u{10ffff}',
    '{',
    '}',
    '[',
    ']',
    ':',
    ',',
];

fn gen_string(rng: &mut Rng) -> String {
    let len = rng.below(12);
    (0..len)
        .map(|_| {
            if rng.chance(1, 4) {
                // Any scalar value (skip surrogate range via from_u32).
                char::from_u32(rng.below(0x11_0000) as u32).unwrap_or('?')
            } else {
                CHAR_POOL[rng.below(CHAR_POOL.len())]
            }
        })
        .collect()
}

fn gen_f64(rng: &mut Rng) -> f64 {
    match rng.below(4) {
        0 => {
            // Arbitrary bit pattern, finite only.
            let f = f64::from_bits(rng.next());
            if f.is_finite() {
                f
            } else {
                0.5
            }
        }
        1 => (rng.next() as i64 as f64) / 1000.0,
        2 => [
            0.0,
            -0.0,
            1.0,
            -1.0,
            0.1,
            1e16,
            1e19,
            1e300,
            5e-324,
            2.5e-8,
            1.8446744073709552e19,
        ][rng.below(11)],
        _ => rng.below(1_000_000) as f64 * 0.25,
    }
}

fn gen_number(rng: &mut Rng) -> Number {
    match rng.below(6) {
        0 => Number::U64(rng.next()),
        1 => Number::U64([0, 1, 9, 10, u64::MAX, u64::MAX - 1, 140_737_488_355_328][rng.below(7)]),
        2 => Number::U64(rng.below(1000) as u64),
        // Negative only: non-negative integers canonically parse as U64.
        3 => Number::I64(-((rng.next() >> 1) as i64) - 1),
        4 => Number::I64([i64::MIN, -1, -10][rng.below(3)]),
        _ => Number::F64(gen_f64(rng)),
    }
}

fn gen_value(rng: &mut Rng, depth: usize) -> Value {
    let leaf_only = depth >= 5;
    let kind = if leaf_only {
        rng.below(4)
    } else {
        rng.below(6)
    };
    match kind {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(1, 2)),
        2 => Value::Number(gen_number(rng)),
        3 => Value::String(gen_string(rng)),
        4 => {
            let n = rng.below(6);
            Value::Array((0..n).map(|_| gen_value(rng, depth + 1)).collect())
        }
        _ => {
            let n = rng.below(6);
            Value::Object(
                (0..n)
                    .map(|_| {
                        // Occasionally duplicate keys.
                        let k = if rng.chance(1, 5) {
                            "dup".to_owned()
                        } else {
                            gen_string(rng)
                        };
                        (k, gen_value(rng, depth + 1))
                    })
                    .collect(),
            )
        }
    }
}

/// Inserts random JSON whitespace after structural characters outside
/// strings, so the parser sees non-compact input too.
fn sprinkle_ws(rng: &mut Rng, compact: &str) -> String {
    const WS: [char; 4] = [' ', '\t', '\n', '\r'];
    let mut out = String::with_capacity(compact.len() * 2);
    let mut in_str = false;
    let mut escaped = false;
    for c in compact.chars() {
        out.push(c);
        if in_str {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_str = false;
            }
            continue;
        }
        if c == '"' {
            in_str = true;
        } else if matches!(c, '[' | ']' | '{' | '}' | ',' | ':') && rng.chance(1, 3) {
            out.push(WS[rng.below(4)]);
        }
    }
    out
}

const INTERESTING: &[u8] =
    b"[]{}\",:\\/-+.eE0123456789ntfu \t\n\r\x00\x1f\x7f\xc3\xa9\xed\xa0\x80\xff";

fn mutate(rng: &mut Rng, doc: &mut Vec<u8>) {
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = doc.len();
        match rng.below(5) {
            0 if len > 0 => {
                let i = rng.below(len);
                doc[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                doc[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let i = rng.below(len + 1);
                let b = if rng.chance(1, 2) {
                    INTERESTING[rng.below(INTERESTING.len())]
                } else {
                    rng.next() as u8
                };
                doc.insert(i, b);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(8));
                doc.drain(i..i + n);
            }
            _ => doc.truncate(rng.below(len + 1)),
        }
    }
}

fn check_reparse(v: &Value, context: &[u8]) {
    let text = v.to_string();
    match parse(&text) {
        Ok(again) => assert_eq!(
            &again,
            v,
            "re-parse mismatch\ninput: {:?}\nserialized: {text}",
            String::from_utf8_lossy(context)
        ),
        Err(e) => panic!(
            "re-serialized value failed to parse: {e}\ninput: {:?}\nserialized: {text}",
            String::from_utf8_lossy(context)
        ),
    }
}

#[test]
fn roundtrip_random_values() {
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    for case in 0..iters() {
        let v = gen_value(&mut rng, 0);
        let text = v.to_string();
        match parse(&text) {
            Ok(back) => assert_eq!(back, v, "case {case}: {text}"),
            Err(e) => panic!("case {case}: {e}\n{text}"),
        }
        let spaced = sprinkle_ws(&mut rng, &text);
        assert_eq!(parse(&spaced).as_ref(), Ok(&v), "case {case}: {spaced}");
        assert_eq!(parse_bytes(spaced.as_bytes()).as_ref(), Ok(&v));
    }
}

#[test]
fn mutated_documents_never_panic() {
    let mut rng = Rng::new(0xD1B5_4A32_D192_ED03);
    let mut ok = 0usize;
    let mut err = 0usize;
    for _ in 0..iters() {
        let v = gen_value(&mut rng, 1);
        let mut doc = v.to_string().into_bytes();
        mutate(&mut rng, &mut doc);
        match parse_bytes(&doc) {
            Ok(parsed) => {
                ok += 1;
                check_reparse(&parsed, &doc);
            }
            Err(e) => {
                err += 1;
                assert!(e.offset <= doc.len(), "offset past end: {e}");
                assert!(!e.reason.is_empty());
            }
        }
    }
    // Sanity: the mutator exercises both outcomes.
    if iters() >= 1000 {
        assert!(ok > 0 && err > 0, "ok={ok} err={err}");
    }
}

#[test]
fn random_token_soup_never_panics() {
    let mut rng = Rng::new(0x0123_4567_89AB_CDEF);
    for _ in 0..iters() / 4 {
        let len = rng.below(24);
        let doc: Vec<u8> = (0..len)
            .map(|_| INTERESTING[rng.below(INTERESTING.len())])
            .collect();
        if let Ok(v) = parse_bytes(&doc) {
            check_reparse(&v, &doc);
        }
    }
}

#[test]
fn deep_nesting_is_rejected_without_overflow() {
    // Run on a small stack to show recursion really is bounded.
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(|| {
            const N: usize = 100_000;
            let inputs = [
                "[".repeat(N),
                format!("{}{}", "[".repeat(N), "]".repeat(N)),
                "{\"a\":".repeat(N),
                "[{\"k\":".repeat(N / 2),
                format!("{}1{}", "[".repeat(N), "]".repeat(N)),
            ];
            for input in &inputs {
                let e = parse(input).expect_err("deep input must fail");
                assert_eq!(e.reason, "nesting too deep");
                assert!(e.offset < 6 * MAX_DEPTH + 6, "offset {}", e.offset);
                assert!(parse_bytes(input.as_bytes()).is_err());
            }
            // Exactly MAX_DEPTH levels is fine, one more is not.
            let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
            assert!(parse(&ok).is_ok());
            let bad = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
            assert!(parse(&bad).is_err());
        })
        .expect("spawn")
        .join()
        .expect("deep nesting test thread panicked");
}
