//! Minimal, strict JSON (RFC 8259) parsing and compact serialization.
//!
//! The parser is meant for untrusted input (metadata descriptors, RPC
//! bodies): it never panics, nesting is capped at [`MAX_DEPTH`], and every
//! error carries the byte offset where it was detected.
//!
//! Numbers keep integer precision: integers that fit `u64` parse as
//! [`Number::U64`], negative integers that fit `i64` as [`Number::I64`], and
//! everything else (fractions, exponents, out-of-range integers, `-0`) as
//! [`Number::F64`].  Serialization ([`Value`]'s `Display`) is compact and
//! round-trips: `parse(&v.to_string()) == Ok(v)` for any value without
//! non-finite floats (given `I64` holds only negative numbers, as produced by
//! the parser and the `From` impls).

#![forbid(unsafe_code)]

use std::fmt::{self, Write as _};

/// Maximum nesting depth of arrays/objects accepted by [`parse`].
pub const MAX_DEPTH: usize = 64;

/// A JSON number, keeping integers exact.
#[derive(Clone, Debug, PartialEq)]
pub enum Number {
    /// Non-negative integer written without fraction or exponent.
    U64(u64),
    /// Negative integer written without fraction or exponent.
    I64(i64),
    /// Any other finite number.
    F64(f64),
}

/// A parsed JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// A number.
    Number(Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<Value>),
    /// An object; keeps insertion order and duplicate keys ([`Value::get`]
    /// returns the last one).
    Object(Vec<(String, Value)>),
}

/// A syntax error: byte offset into the input and a short reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonError {
    /// Byte offset in the input where the error was detected.
    pub offset: usize,
    /// Static description of the problem.
    pub reason: &'static str,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid JSON at byte {}: {}", self.offset, self.reason)
    }
}

impl std::error::Error for JsonError {}

/// A required object field is missing or has the wrong type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Name of the field.
    pub field: String,
    /// What was expected (e.g. `"string"`).
    pub expected: &'static str,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "field `{}`: expected {}", self.field, self.expected)
    }
}

impl std::error::Error for FieldError {}

/// Parses one JSON value (surrounding whitespace allowed) from `text`.
pub fn parse(text: &str) -> Result<Value, JsonError> {
    let mut p = Parser {
        src: text,
        bytes: text.as_bytes(),
        pos: 0,
    };
    p.skip_ws();
    let v = p.parse_value(0)?;
    p.skip_ws();
    if p.pos != p.bytes.len() {
        return Err(p.err("trailing characters after value"));
    }
    Ok(v)
}

/// Validates UTF-8, then [`parse`]s. Invalid UTF-8 is reported as a
/// [`JsonError`] at the first invalid byte.
pub fn parse_bytes(bytes: &[u8]) -> Result<Value, JsonError> {
    match std::str::from_utf8(bytes) {
        Ok(s) => parse(s),
        Err(e) => Err(JsonError {
            offset: e.valid_up_to(),
            reason: "invalid UTF-8",
        }),
    }
}

struct Parser<'a> {
    src: &'a str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, reason: &'static str) -> JsonError {
        self.err_at(self.pos, reason)
    }

    fn err_at(&self, offset: usize, reason: &'static str) -> JsonError {
        JsonError { offset, reason }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn expect_literal(&mut self, lit: &'static [u8], v: Value) -> Result<Value, JsonError> {
        let end = self.pos + lit.len();
        if self.bytes.get(self.pos..end) == Some(lit) {
            self.pos = end;
            Ok(v)
        } else {
            Err(self.err("invalid literal"))
        }
    }

    /// Parses a value starting at `self.pos` (whitespace already skipped).
    /// `depth` is the number of enclosing containers.
    fn parse_value(&mut self, depth: usize) -> Result<Value, JsonError> {
        match self.peek() {
            None => Err(self.err("unexpected end of input")),
            Some(b'n') => self.expect_literal(b"null", Value::Null),
            Some(b't') => self.expect_literal(b"true", Value::Bool(true)),
            Some(b'f') => self.expect_literal(b"false", Value::Bool(false)),
            Some(b'"') => Ok(Value::String(self.parse_string()?)),
            Some(b'-' | b'0'..=b'9') => Ok(Value::Number(self.parse_number()?)),
            Some(b'[') => {
                if depth >= MAX_DEPTH {
                    return Err(self.err("nesting too deep"));
                }
                self.parse_array(depth + 1)
            }
            Some(b'{') => {
                if depth >= MAX_DEPTH {
                    return Err(self.err("nesting too deep"));
                }
                self.parse_object(depth + 1)
            }
            Some(_) => Err(self.err("expected value")),
        }
    }

    fn parse_array(&mut self, depth: usize) -> Result<Value, JsonError> {
        self.pos += 1; // '['
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.parse_value(depth)?);
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.skip_ws();
                }
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                None => return Err(self.err("unexpected end of input in array")),
                Some(_) => return Err(self.err("expected ',' or ']'")),
            }
        }
    }

    fn parse_object(&mut self, depth: usize) -> Result<Value, JsonError> {
        self.pos += 1; // '{'
        let mut fields = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(fields));
        }
        loop {
            match self.peek() {
                Some(b'"') => {}
                None => return Err(self.err("unexpected end of input in object")),
                Some(_) => return Err(self.err("expected string key")),
            }
            let key = self.parse_string()?;
            self.skip_ws();
            match self.peek() {
                Some(b':') => self.pos += 1,
                None => return Err(self.err("unexpected end of input in object")),
                Some(_) => return Err(self.err("expected ':'")),
            }
            self.skip_ws();
            let v = self.parse_value(depth)?;
            fields.push((key, v));
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.skip_ws();
                }
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Value::Object(fields));
                }
                None => return Err(self.err("unexpected end of input in object")),
                Some(_) => return Err(self.err("expected ',' or '}'")),
            }
        }
    }

    /// Parses a string starting at the opening quote.
    fn parse_string(&mut self) -> Result<String, JsonError> {
        self.pos += 1; // opening '"'
        let mut run_start = self.pos;
        let mut out: Option<String> = None;
        loop {
            // Fast scan over bytes needing no processing. All stop bytes are
            // ASCII, so slice boundaries are always char boundaries.
            while let Some(&b) = self.bytes.get(self.pos) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            match self.peek() {
                None => return Err(self.err("unterminated string")),
                Some(b'"') => {
                    let run = &self.src[run_start..self.pos];
                    self.pos += 1;
                    return Ok(match out {
                        None => run.to_owned(),
                        Some(mut s) => {
                            s.push_str(run);
                            s
                        }
                    });
                }
                Some(b'\\') => {
                    let buf = out.get_or_insert_with(String::new);
                    buf.push_str(&self.src[run_start..self.pos]);
                    let esc_at = self.pos;
                    self.pos += 1;
                    let c = match self.peek() {
                        None => return Err(self.err("unterminated string")),
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.pos += 1;
                            // Leaves pos just past the last hex digit.
                            let c = self.parse_unicode_escape(esc_at)?;
                            self.pos -= 1;
                            c
                        }
                        Some(_) => return Err(self.err("invalid escape")),
                    };
                    self.pos += 1;
                    buf.push(c);
                    run_start = self.pos;
                }
                Some(_) => return Err(self.err("control character in string")),
            }
        }
    }

    /// Reads 4 hex digits at `self.pos`, advancing past them.
    fn hex4(&mut self) -> Result<u32, JsonError> {
        let mut v = 0u32;
        for _ in 0..4 {
            let d = match self.peek() {
                Some(b @ b'0'..=b'9') => b - b'0',
                Some(b @ b'a'..=b'f') => b - b'a' + 10,
                Some(b @ b'A'..=b'F') => b - b'A' + 10,
                None => return Err(self.err("unterminated string")),
                Some(_) => return Err(self.err("invalid \\u escape")),
            };
            v = (v << 4) | u32::from(d);
            self.pos += 1;
        }
        Ok(v)
    }

    /// Handles `XXXX` after `\u` (and a following `\uXXXX` low surrogate
    /// when needed). `esc_at` is the offset of the backslash.
    fn parse_unicode_escape(&mut self, esc_at: usize) -> Result<char, JsonError> {
        let hi = self.hex4()?;
        let code = match hi {
            0xD800..=0xDBFF => {
                if self.bytes.get(self.pos..self.pos + 2) != Some(b"\\u") {
                    return Err(self.err_at(esc_at, "lone surrogate in \\u escape"));
                }
                let lo_at = self.pos;
                self.pos += 2;
                let lo = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&lo) {
                    return Err(self.err_at(lo_at, "invalid low surrogate in \\u escape"));
                }
                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(self.err_at(esc_at, "lone surrogate in \\u escape")),
            c => c,
        };
        char::from_u32(code).ok_or_else(|| self.err_at(esc_at, "invalid \\u escape"))
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    fn parse_number(&mut self) -> Result<Number, JsonError> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int_start = self.pos;
        match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(self.err("leading zero in number"));
                }
            }
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.err("expected digit")),
        }
        let int_end = self.pos;
        let mut integral = true;
        if self.peek() == Some(b'.') {
            integral = false;
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.err("expected digit after '.'"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            integral = false;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.err("expected digit in exponent"));
            }
        }
        if integral {
            let mut mag: Option<u64> = Some(0);
            for &b in &self.bytes[int_start..int_end] {
                mag = mag
                    .and_then(|m| m.checked_mul(10))
                    .and_then(|m| m.checked_add(u64::from(b - b'0')));
            }
            match (negative, mag) {
                (false, Some(m)) => return Ok(Number::U64(m)),
                (true, Some(0)) => return Ok(Number::F64(-0.0)),
                (true, Some(m)) if m <= 1u64 << 63 => {
                    // m in 1..=2^63, so 0 - m fits i64 via wrapping at the edge.
                    return Ok(Number::I64((m as i64).wrapping_neg()));
                }
                _ => {}
            }
        }
        match self.src[start..self.pos].parse::<f64>() {
            Ok(f) if f.is_finite() => Ok(Number::F64(f)),
            _ => Err(self.err_at(start, "number out of range")),
        }
    }
}

impl Value {
    /// Looks up `key` in an object (last duplicate wins); `None` otherwise.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(fields) => fields.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string contents, if this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The number as `u64` if it is exactly representable.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Number(Number::U64(n)) => Some(*n),
            Value::Number(Number::I64(n)) => u64::try_from(*n).ok(),
            Value::Number(Number::F64(f)) => {
                // 2^64 is exactly representable; the range check rejects NaN.
                if *f >= 0.0 && *f < 18_446_744_073_709_551_616.0 && f.fract() == 0.0 {
                    Some(*f as u64)
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    /// The number as `i64` if it is exactly representable.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Number(Number::U64(n)) => i64::try_from(*n).ok(),
            Value::Number(Number::I64(n)) => Some(*n),
            Value::Number(Number::F64(f)) => {
                if *f >= -9_223_372_036_854_775_808.0
                    && *f < 9_223_372_036_854_775_808.0
                    && f.fract() == 0.0
                {
                    Some(*f as i64)
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    /// The number as `f64` (integers may round).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Number(Number::U64(n)) => Some(*n as f64),
            Value::Number(Number::I64(n)) => Some(*n as f64),
            Value::Number(Number::F64(f)) => Some(*f),
            _ => None,
        }
    }

    /// The boolean, if this is `true`/`false`.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The fields in order, if this is an object.
    pub fn as_object(&self) -> Option<&[(String, Value)]> {
        match self {
            Value::Object(o) => Some(o),
            _ => None,
        }
    }

    /// Whether this is `null`.
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    /// Builds an object from `(key, value)` pairs, keeping their order.
    pub fn object<K: Into<String>>(fields: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Object(fields.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// Required string field of an object. Missing field, wrong type, or
    /// `self` not an object all give `expected: "string"`.
    pub fn str_field(&self, key: &str) -> Result<&str, FieldError> {
        self.get(key)
            .and_then(Value::as_str)
            .ok_or_else(|| FieldError {
                field: key.to_owned(),
                expected: "string",
            })
    }

    /// Required unsigned integer field of an object (see [`Value::as_u64`]).
    /// Missing field, wrong type, or `self` not an object all give
    /// `expected: "unsigned 64-bit integer"`.
    pub fn u64_field(&self, key: &str) -> Result<u64, FieldError> {
        self.get(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| FieldError {
                field: key.to_owned(),
                expected: "unsigned 64-bit integer",
            })
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::String(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::String(s)
    }
}

impl From<u64> for Value {
    fn from(n: u64) -> Self {
        Value::Number(Number::U64(n))
    }
}

impl From<u32> for Value {
    fn from(n: u32) -> Self {
        Value::Number(Number::U64(n.into()))
    }
}

impl From<u16> for Value {
    fn from(n: u16) -> Self {
        Value::Number(Number::U64(n.into()))
    }
}

impl From<usize> for Value {
    fn from(n: usize) -> Self {
        Value::Number(Number::U64(n as u64))
    }
}

/// Non-negative values become [`Number::U64`] so they round-trip.
impl From<i64> for Value {
    fn from(n: i64) -> Self {
        match u64::try_from(n) {
            Ok(u) => Value::Number(Number::U64(u)),
            Err(_) => Value::Number(Number::I64(n)),
        }
    }
}

/// Non-negative values become [`Number::U64`] so they round-trip.
impl From<i32> for Value {
    fn from(n: i32) -> Self {
        Value::from(i64::from(n))
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

impl From<f64> for Value {
    fn from(f: f64) -> Self {
        Value::Number(Number::F64(f))
    }
}

impl From<Vec<Value>> for Value {
    fn from(a: Vec<Value>) -> Self {
        Value::Array(a)
    }
}

fn write_escaped<W: fmt::Write + ?Sized>(w: &mut W, s: &str) -> fmt::Result {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    w.write_char('"')?;
    let bytes = s.as_bytes();
    let mut run_start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0x00..=0x1f => "",
            _ => continue,
        };
        // `b` is ASCII, so `i` is a char boundary.
        w.write_str(&s[run_start..i])?;
        if esc.is_empty() {
            w.write_str("\\u00")?;
            w.write_char(char::from(HEX[usize::from(b >> 4)]))?;
            w.write_char(char::from(HEX[usize::from(b & 0xf)]))?;
        } else {
            w.write_str(esc)?;
        }
        run_start = i + 1;
    }
    w.write_str(&s[run_start..])?;
    w.write_char('"')
}

/// Forwards to a writer while noting whether a float rendering contains a
/// fraction or exponent (so it does not re-parse as an integer).
struct FloatSniffer<'w, W: ?Sized> {
    inner: &'w mut W,
    has_frac_or_exp: bool,
}

impl<W: fmt::Write + ?Sized> fmt::Write for FloatSniffer<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if s.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
            self.has_frac_or_exp = true;
        }
        self.inner.write_str(s)
    }
}

fn write_number<W: fmt::Write + ?Sized>(w: &mut W, n: &Number) -> fmt::Result {
    match n {
        Number::U64(n) => write!(w, "{n}"),
        Number::I64(n) => write!(w, "{n}"),
        Number::F64(f) if !f.is_finite() => w.write_str("null"),
        Number::F64(f) => {
            // `{:?}` is the shortest round-tripping form, using an exponent
            // for very large/small magnitudes (e.g. `1e300`, `1.5e-7`).
            let mut s = FloatSniffer {
                inner: &mut *w,
                has_frac_or_exp: false,
            };
            write!(s, "{f:?}")?;
            if !s.has_frac_or_exp {
                w.write_str(".0")?;
            }
            Ok(())
        }
    }
}

enum Frame<'a> {
    Array(std::slice::Iter<'a, Value>),
    Object(std::slice::Iter<'a, (String, Value)>),
}

/// Serializes without recursion, so even programmatically built values
/// deeper than [`MAX_DEPTH`] cannot overflow the stack here.
fn write_value<W: fmt::Write + ?Sized>(w: &mut W, root: &Value) -> fmt::Result {
    let mut stack: Vec<Frame<'_>> = Vec::new();
    let mut next: Option<&Value> = Some(root);
    loop {
        if let Some(v) = next.take() {
            match v {
                Value::Null => w.write_str("null")?,
                Value::Bool(b) => w.write_str(if *b { "true" } else { "false" })?,
                Value::Number(n) => write_number(w, n)?,
                Value::String(s) => write_escaped(w, s)?,
                Value::Array(a) => {
                    w.write_char('[')?;
                    let mut it = a.iter();
                    match it.next() {
                        Some(v) => {
                            next = Some(v);
                            stack.push(Frame::Array(it));
                        }
                        None => w.write_char(']')?,
                    }
                    continue;
                }
                Value::Object(o) => {
                    w.write_char('{')?;
                    let mut it = o.iter();
                    match it.next() {
                        Some((k, v)) => {
                            write_escaped(w, k)?;
                            w.write_char(':')?;
                            next = Some(v);
                            stack.push(Frame::Object(it));
                        }
                        None => w.write_char('}')?,
                    }
                    continue;
                }
            }
        }
        // A value just finished: continue or close the innermost container.
        let Some(top) = stack.last_mut() else {
            return Ok(());
        };
        match top {
            Frame::Array(it) => match it.next() {
                Some(v) => {
                    w.write_char(',')?;
                    next = Some(v);
                }
                None => {
                    stack.pop();
                    w.write_char(']')?;
                }
            },
            Frame::Object(it) => match it.next() {
                Some((k, v)) => {
                    w.write_char(',')?;
                    write_escaped(w, k)?;
                    w.write_char(':')?;
                    next = Some(v);
                }
                None => {
                    stack.pop();
                    w.write_char('}')?;
                }
            },
        }
    }
}

/// Compact JSON (no whitespace). Non-finite floats are written as `null`.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_value(f, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_of(text: &str) -> JsonError {
        parse(text).expect_err(text)
    }

    fn roundtrip(v: &Value) {
        let s = v.to_string();
        assert_eq!(parse(&s).as_ref(), Ok(v), "text: {s}");
    }

    #[test]
    fn scalars() {
        assert_eq!(parse("null"), Ok(Value::Null));
        assert_eq!(parse(" true "), Ok(Value::Bool(true)));
        assert_eq!(parse("\t\r\nfalse\n"), Ok(Value::Bool(false)));
        assert_eq!(parse("\"hi\""), Ok(Value::from("hi")));
    }

    #[test]
    fn u64_exact() {
        let v = parse("18446744073709551615").unwrap();
        assert_eq!(v, Value::Number(Number::U64(u64::MAX)));
        assert_eq!(v.as_u64(), Some(u64::MAX));
        assert_eq!(v.to_string(), "18446744073709551615");
        let addr = parse("140737488355328").unwrap();
        assert_eq!(addr.as_u64(), Some(140_737_488_355_328));
        assert_eq!(addr.to_string(), "140737488355328");
        // One past u64::MAX becomes a float.
        let big = parse("18446744073709551616").unwrap();
        assert_eq!(big, Value::Number(Number::F64(18446744073709551616.0)));
        assert_eq!(big.as_u64(), None);
        roundtrip(&big);
        roundtrip(&Value::from(u64::MAX));
        roundtrip(&Value::from(0u64));
    }

    #[test]
    fn negatives() {
        assert_eq!(parse("-1"), Ok(Value::Number(Number::I64(-1))));
        let min = parse("-9223372036854775808").unwrap();
        assert_eq!(min, Value::Number(Number::I64(i64::MIN)));
        assert_eq!(min.to_string(), "-9223372036854775808");
        assert!(matches!(
            parse("-9223372036854775809"),
            Ok(Value::Number(Number::F64(_)))
        ));
        assert_eq!(min.as_u64(), None);
        assert_eq!(min.as_i64(), Some(i64::MIN));
        // -0 has no integer sign: it is a float so it round-trips.
        let nz = parse("-0").unwrap();
        assert!(matches!(nz, Value::Number(Number::F64(f)) if f == 0.0 && f.is_sign_negative()));
        assert_eq!(nz.to_string(), "-0.0");
        assert_eq!(Value::from(-5i32), Value::Number(Number::I64(-5)));
        assert_eq!(Value::from(5i64), Value::Number(Number::U64(5)));
        roundtrip(&Value::from(i64::MIN));
        roundtrip(&Value::from(-1i64));
    }

    #[test]
    fn floats() {
        assert_eq!(parse("1.5"), Ok(Value::from(1.5)));
        assert_eq!(parse("-2.5e3"), Ok(Value::from(-2500.0)));
        assert_eq!(parse("1E2"), Ok(Value::from(100.0)));
        assert_eq!(parse("1e-2"), Ok(Value::from(0.01)));
        assert_eq!(parse("0.0"), Ok(Value::from(0.0)));
        assert_eq!(Value::from(1.0).to_string(), "1.0");
        assert_eq!(Value::from(f64::NAN).to_string(), "null");
        assert_eq!(Value::from(f64::INFINITY).to_string(), "null");
        for f in [
            0.1,
            -0.0,
            1e16,
            1e19,
            1e300,
            -1.7976931348623157e308,
            5e-324,
            1.5e-7,
            123456.789,
        ] {
            let v = Value::from(f);
            let s = v.to_string();
            assert!(s.contains(['.', 'e']), "{s}");
            roundtrip(&v);
        }
        assert_eq!(parse("3.0").unwrap().as_u64(), Some(3));
        assert_eq!(parse("3.5").unwrap().as_u64(), None);
        assert_eq!(parse("-3.0").unwrap().as_i64(), Some(-3));
        assert_eq!(parse("-3.0").unwrap().as_u64(), None);
        assert_eq!(parse("1e20").unwrap().as_u64(), None);
        assert_eq!(parse("7").unwrap().as_f64(), Some(7.0));
        assert_eq!(err_of("1e400").reason, "number out of range");
    }

    #[test]
    fn strings_and_escapes() {
        let v = parse(r#""a\"b\\c\/d\b\f\n\r\t\u0041\u00e9\u4e2d""#).unwrap();
        assert_eq!(v.as_str(), Some("a\"b\\c/d\u{8}\u{c}\n\r\tAé中"));
        roundtrip(&v);
        // Raw non-ASCII passes through.
        assert_eq!(
            parse("\"héllo 中 😀\"").unwrap().as_str(),
            Some("héllo 中 😀")
        );
        let out = Value::from("q\"\\\n\u{1}\u{1f}\u{7f}é").to_string();
        assert_eq!(out, "\"q\\\"\\\\\\n\\u0001\\u001f\u{7f}é\"");
        let all_ctrl: String = (0u8..0x20).map(char::from).collect();
        roundtrip(&Value::from(all_ctrl));
    }

    #[test]
    fn surrogate_pairs() {
        let v = parse(r#""\ud83d\ude00x""#).unwrap();
        assert_eq!(v.as_str(), Some("😀x"));
        assert_eq!(parse(r#""\uD834\uDD1E""#).unwrap().as_str(), Some("𝄞"));
        assert_eq!(v.to_string(), "\"😀x\"");
        // Lone high, lone low, high followed by non-low.
        let e = err_of(r#""ab\ud83d""#);
        assert_eq!((e.offset, e.reason), (3, "lone surrogate in \\u escape"));
        let e = err_of(r#""\ude00""#);
        assert_eq!((e.offset, e.reason), (1, "lone surrogate in \\u escape"));
        let e = err_of(r#""\ud83d\u0041""#);
        assert_eq!(
            (e.offset, e.reason),
            (7, "invalid low surrogate in \\u escape")
        );
        assert_eq!(err_of(r#""\ud83dx""#).offset, 1);
        assert_eq!(err_of(r#""\u12g4""#).reason, "invalid \\u escape");
        assert_eq!(err_of(r#""\u12"#).reason, "unterminated string");
    }

    #[test]
    fn containers_and_order() {
        let v = parse(r#" { "b" : [1, -2, 3.5, [], {}], "a": null, "b": "last" } "#).unwrap();
        let keys: Vec<&str> = v
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys, ["b", "a", "b"]);
        assert_eq!(v.get("b").and_then(Value::as_str), Some("last"));
        assert!(v.get("a").unwrap().is_null());
        assert_eq!(v.get("zz"), None);
        assert_eq!(Value::Null.get("a"), None);
        assert_eq!(
            v.to_string(),
            r#"{"b":[1,-2,3.5,[],{}],"a":null,"b":"last"}"#
        );
        roundtrip(&v);
        let arr = parse("[true,false]").unwrap();
        assert_eq!(arr.as_array().map(<[Value]>::len), Some(2));
        assert_eq!(arr.as_array().unwrap()[1].as_bool(), Some(false));
    }

    #[test]
    fn error_offsets() {
        let cases: &[(&str, usize, &str)] = &[
            ("", 0, "unexpected end of input"),
            ("   ", 3, "unexpected end of input"),
            ("1 2", 2, "trailing characters after value"),
            ("{} x", 3, "trailing characters after value"),
            ("\"abc", 4, "unterminated string"),
            ("[\"a\\", 4, "unterminated string"),
            ("\"a\nb\"", 2, "control character in string"),
            ("\"\\x\"", 2, "invalid escape"),
            ("01", 1, "leading zero in number"),
            ("-01", 2, "leading zero in number"),
            ("-", 1, "expected digit"),
            ("1.", 2, "expected digit after '.'"),
            (".5", 0, "expected value"),
            ("1e", 2, "expected digit in exponent"),
            ("1e+", 3, "expected digit in exponent"),
            ("+1", 0, "expected value"),
            ("[1,]", 3, "expected value"),
            ("[1 2]", 3, "expected ',' or ']'"),
            ("[1", 2, "unexpected end of input in array"),
            ("{\"a\":1,}", 7, "expected string key"),
            ("{\"a\" 1}", 5, "expected ':'"),
            ("{a:1}", 1, "expected string key"),
            ("{\"a\":1", 6, "unexpected end of input in object"),
            ("NaN", 0, "expected value"),
            ("Infinity", 0, "expected value"),
            ("-Infinity", 1, "expected digit"),
            ("nul", 0, "invalid literal"),
            ("tru e", 0, "invalid literal"),
            ("\u{feff}1", 0, "expected value"),
            ("'a'", 0, "expected value"),
        ];
        for &(text, offset, reason) in cases {
            let e = err_of(text);
            assert_eq!((e.offset, e.reason), (offset, reason), "input {text:?}");
        }
        let e = err_of("[1,}");
        assert_eq!(e.to_string(), "invalid JSON at byte 3: expected value");
    }

    #[test]
    fn depth_limit() {
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse(&ok).is_ok());
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        let e = err_of(&deep);
        assert_eq!((e.offset, e.reason), (MAX_DEPTH, "nesting too deep"));
        let objs = "{\"a\":".repeat(MAX_DEPTH + 1);
        assert_eq!(err_of(&objs).reason, "nesting too deep");
        assert_eq!(err_of(&"[".repeat(1_000_000)).offset, MAX_DEPTH);
    }

    #[test]
    fn invalid_utf8() {
        let e = parse_bytes(b"\"ab\xffc\"").unwrap_err();
        assert_eq!((e.offset, e.reason), (3, "invalid UTF-8"));
        let e = parse_bytes(b"[\"\xe4\xb8\"]").unwrap_err();
        assert_eq!(e.offset, 2);
        assert_eq!(
            parse_bytes(b"{\"k\":[1]}").unwrap().get("k"),
            Some(&Value::from(vec![Value::from(1u32)]))
        );
    }

    #[test]
    fn field_helpers() {
        let v = Value::object([
            ("name", Value::from("seg0")),
            ("addr", Value::from(140_737_488_355_328u64)),
            ("neg", Value::from(-1i64)),
            ("len", Value::from(4096usize)),
            ("port", Value::from(8080u16)),
        ]);
        assert_eq!(v.str_field("name"), Ok("seg0"));
        assert_eq!(v.u64_field("addr"), Ok(140_737_488_355_328));
        assert_eq!(v.u64_field("len"), Ok(4096));
        assert_eq!(v.u64_field("port"), Ok(8080));
        let e = v.u64_field("neg").unwrap_err();
        assert_eq!(
            e.to_string(),
            "field `neg`: expected unsigned 64-bit integer"
        );
        let e = v.str_field("addr").unwrap_err();
        assert_eq!(
            e,
            FieldError {
                field: "addr".into(),
                expected: "string"
            }
        );
        assert_eq!(
            v.str_field("missing").unwrap_err().to_string(),
            "field `missing`: expected string"
        );
        assert!(Value::Null.u64_field("x").is_err());
        let text = v.to_string();
        assert_eq!(
            text,
            r#"{"name":"seg0","addr":140737488355328,"neg":-1,"len":4096,"port":8080}"#
        );
        roundtrip(&v);
    }

    #[test]
    fn deep_built_value_serializes() {
        let mut v = Value::Null;
        for _ in 0..10_000 {
            v = Value::Array(vec![v]);
        }
        let s = v.to_string();
        assert_eq!(s.len(), 20_004);
        // Dismantle iteratively to avoid recursive drop on the way out.
        while let Value::Array(mut a) = v {
            v = a.pop().unwrap_or(Value::Null);
        }
    }
}
