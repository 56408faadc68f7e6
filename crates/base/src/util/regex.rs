//! A small regular-expression matcher that always runs in linear time.
//!
//! Used by `remove_by_regex` to select KV-cache object keys. Patterns are
//! compiled to a Thompson NFA and simulated with state sets (a Pike VM
//! without captures), so matching costs `O(text length × program size)`
//! whatever the pattern: there is no backtracking to blow up.
//!
//! # Semantics
//!
//! [`Regex::is_match`] behaves like `regex::Regex::is_match`: it reports
//! whether the pattern matches *anywhere* in the text unless anchored with
//! `^` / `$`. Matching works on `char`s (Unicode scalar values).
//!
//! # Supported syntax
//!
//! | Syntax | Meaning |
//! |---|---|
//! | `a`, `é`, … | a literal character (anything not listed below) |
//! | `.` | any character except `\n` |
//! | `^`, `$` | start / end of the text (no multi-line mode) |
//! | `[abc]`, `[a-z0-9_]` | a character class, with ranges |
//! | `[^...]` | a negated class |
//! | `\d` `\w` `\s` | ASCII digit `[0-9]`, word `[0-9A-Za-z_]`, space `[\t\n\v\f\r ]` |
//! | `\D` `\W` `\S` | their complements (also usable inside classes) |
//! | `\.`, `\\`, `\*`, … | any escaped ASCII punctuation is that literal character |
//! | `\n` `\t` `\r` `\f` `\v` | newline, tab, carriage return, form feed, vertical tab |
//! | `x*` `x+` `x?` | zero or more, one or more, zero or one |
//! | `x{n}` `x{n,}` `x{n,m}` | counted repetition, `n ≤ m ≤ 1000` |
//! | `x*?` etc. | lazy quantifiers are accepted; they match the same texts |
//! | `(...)`, `(?:...)` | grouping (nothing is captured) |
//! | `a\|b` | alternation, at top level or in groups; empty branches allowed |
//!
//! Inside a class, `]` is literal when it comes first (after an optional
//! `^`) and `-` is literal first or last. Everything else is rejected with a
//! [`RegexError`]: other escapes (`\b`, `\p{..}`, `\1`, `\x41`, …), flags and
//! other `(?...)` groups, nested classes / POSIX classes (`[[:alpha:]]`),
//! class set operations (`&&`, `--`, `~~`), stacked quantifiers (`a**`,
//! possessive `a*+`), a quantifier with nothing to repeat, unbalanced
//! parentheses and brackets.
//!
//! # Limits
//!
//! Patterns are at most [`MAX_PATTERN_LEN`] bytes, nest at most
//! [`MAX_NESTING`] groups deep, and compile to at most [`MAX_PROGRAM`]
//! instructions (counted repetition copies its operand, so `(a{1000}){1000}`
//! is rejected).

use std::fmt;

/// Longest accepted pattern, in bytes.
pub const MAX_PATTERN_LEN: usize = 4096;
/// Largest accepted compiled program, in instructions.
pub const MAX_PROGRAM: usize = 100_000;
/// Largest count accepted in `{n}`, `{n,}` and `{n,m}`.
pub const MAX_REPEAT: u32 = 1000;
/// Deepest accepted group nesting.
pub const MAX_NESTING: usize = 250;

/// Why a pattern was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegexError {
    /// Byte offset in the pattern where the problem was found.
    pub position: usize,
    /// What is wrong.
    pub reason: &'static str,
}

impl fmt::Display for RegexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid regex at byte {}: {}",
            self.position, self.reason
        )
    }
}

impl std::error::Error for RegexError {}

fn err<T>(position: usize, reason: &'static str) -> Result<T, RegexError> {
    Err(RegexError { position, reason })
}

// ---------------------------------------------------------------------------
// Character sets
// ---------------------------------------------------------------------------

const MAX_CHAR: u32 = char::MAX as u32;

/// Sorted, non-overlapping, non-adjacent inclusive ranges of code points.
type Ranges = Vec<(u32, u32)>;

fn normalize(mut ranges: Ranges) -> Ranges {
    ranges.sort_unstable();
    let mut out: Ranges = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match out.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// Complement of normalized `ranges` within `0..=char::MAX`.
fn complement(ranges: &[(u32, u32)]) -> Ranges {
    let mut out = Vec::with_capacity(ranges.len() + 1);
    let mut next = 0u32;
    for &(lo, hi) in ranges {
        if lo > next {
            out.push((next, lo - 1));
        }
        next = hi.saturating_add(1);
    }
    if next <= MAX_CHAR {
        out.push((next, MAX_CHAR));
    }
    out
}

/// The set for `\d`, `\w`, `\s` (lower case) or their complements.
fn perl_class(letter: char) -> Option<Ranges> {
    let base: &[(u32, u32)] = match letter.to_ascii_lowercase() {
        'd' => &[(0x30, 0x39)],
        'w' => &[(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
        's' => &[(0x09, 0x0D), (0x20, 0x20)],
        _ => return None,
    };
    Some(if letter.is_ascii_uppercase() {
        complement(base)
    } else {
        base.to_vec()
    })
}

fn ranges_contain(ranges: &[(u32, u32)], c: char) -> bool {
    let c = c as u32;
    // First range whose upper end is >= c.
    let idx = ranges.partition_point(|&(_, hi)| hi < c);
    idx < ranges.len() && ranges[idx].0 <= c
}

// ---------------------------------------------------------------------------
// Syntax tree and parser
// ---------------------------------------------------------------------------

#[derive(Debug)]
enum Node {
    /// Matches the empty string.
    Empty,
    Char(char),
    /// `.`: any character but `\n`.
    Any,
    Class(Ranges),
    Start,
    End,
    Concat(Vec<Node>),
    Alt(Vec<Node>),
    Repeat {
        node: Box<Node>,
        min: u32,
        max: Option<u32>,
    },
}

fn concat(mut seq: Vec<Node>) -> Node {
    // `Empty` items (from `()`, `x{0}`) only ever match "": drop them.
    seq.retain(|node| !matches!(node, Node::Empty));
    match seq.len() {
        0 => Node::Empty,
        1 => seq.pop().unwrap_or(Node::Empty),
        _ => Node::Concat(seq),
    }
}

fn alternation(mut alts: Vec<Node>) -> Node {
    if alts.len() == 1 {
        alts.pop().unwrap_or(Node::Empty)
    } else {
        Node::Alt(alts)
    }
}

/// One open group (or the top level) while parsing.
struct Frame {
    /// Finished alternatives before the latest `|`.
    alts: Vec<Node>,
    /// Items of the alternative being parsed.
    seq: Vec<Node>,
    /// Whether the last item of `seq` was produced by a quantifier.
    quantified: bool,
    /// Byte offset of the `(` that opened the group.
    open: usize,
}

impl Frame {
    fn new(open: usize) -> Frame {
        Frame {
            alts: Vec::new(),
            seq: Vec::new(),
            quantified: false,
            open,
        }
    }

    fn push(&mut self, node: Node) {
        self.seq.push(node);
        self.quantified = false;
    }

    fn finish(mut self) -> Node {
        self.alts.push(concat(self.seq));
        alternation(self.alts)
    }
}

struct Parser<'a> {
    chars: Vec<(usize, char)>,
    pos: usize,
    pattern: &'a str,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).map(|&(_, c)| c)
    }

    fn peek_at(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.pos + ahead).map(|&(_, c)| c)
    }

    /// Byte offset of the current character (pattern length at the end).
    fn offset(&self) -> usize {
        self.offset_of(self.pos)
    }

    fn offset_of(&self, index: usize) -> usize {
        self.chars
            .get(index)
            .map_or(self.pattern.len(), |&(offset, _)| offset)
    }

    fn parse(&mut self) -> Result<Node, RegexError> {
        let mut stack: Vec<Frame> = Vec::new();
        let mut cur = Frame::new(0);
        while let Some(c) = self.peek() {
            let here = self.offset();
            match c {
                '(' => {
                    self.pos += 1;
                    if self.peek() == Some('?') {
                        if self.peek_at(1) == Some(':') {
                            self.pos += 2;
                        } else {
                            return err(
                                here,
                                "flags and (?...) groups other than (?:...) are not supported",
                            );
                        }
                    }
                    if stack.len() >= MAX_NESTING {
                        return err(here, "groups nested too deeply");
                    }
                    stack.push(std::mem::replace(&mut cur, Frame::new(here)));
                }
                ')' => {
                    self.pos += 1;
                    let Some(parent) = stack.pop() else {
                        return err(here, "unmatched ')'");
                    };
                    let group = std::mem::replace(&mut cur, parent).finish();
                    cur.push(group);
                }
                '|' => {
                    self.pos += 1;
                    let seq = std::mem::take(&mut cur.seq);
                    cur.alts.push(concat(seq));
                    cur.quantified = false;
                }
                '*' | '+' | '?' | '{' => {
                    let (min, max) = self.parse_quantifier()?;
                    if cur.quantified {
                        return err(here, "quantifier follows another quantifier");
                    }
                    let Some(node) = cur.seq.pop() else {
                        return err(here, "quantifier has nothing to repeat");
                    };
                    // Lazy suffix: same set of matches for `is_match`.
                    if self.peek() == Some('?') {
                        self.pos += 1;
                    }
                    // Repeating "" (or repeating zero times) matches only
                    // "". Folding these keeps every non-`Empty` node at one
                    // or more instructions, which bounds compile work.
                    let repeated = if matches!(node, Node::Empty) || max == Some(0) {
                        Node::Empty
                    } else {
                        Node::Repeat {
                            node: Box::new(node),
                            min,
                            max,
                        }
                    };
                    cur.seq.push(repeated);
                    cur.quantified = true;
                }
                '^' => {
                    self.pos += 1;
                    cur.push(Node::Start);
                }
                '$' => {
                    self.pos += 1;
                    cur.push(Node::End);
                }
                '.' => {
                    self.pos += 1;
                    cur.push(Node::Any);
                }
                '[' => {
                    let node = self.parse_class()?;
                    cur.push(node);
                }
                '\\' => {
                    let node = match self.parse_escape()? {
                        Escaped::Char(c) => Node::Char(c),
                        Escaped::Set(set) => Node::Class(set),
                    };
                    cur.push(node);
                }
                _ => {
                    self.pos += 1;
                    cur.push(Node::Char(c));
                }
            }
        }
        if !stack.is_empty() {
            return err(cur.open, "unclosed group");
        }
        Ok(cur.finish())
    }

    /// Parses `*`, `+`, `?` or `{...}` at the current position.
    fn parse_quantifier(&mut self) -> Result<(u32, Option<u32>), RegexError> {
        let here = self.offset();
        let c = self.peek();
        self.pos += 1;
        match c {
            Some('*') => return Ok((0, None)),
            Some('+') => return Ok((1, None)),
            Some('?') => return Ok((0, Some(1))),
            _ => {}
        }
        let min = self.parse_count(here)?;
        let max = match self.peek() {
            Some('}') => Some(min),
            Some(',') => {
                self.pos += 1;
                if self.peek() == Some('}') {
                    None
                } else {
                    Some(self.parse_count(here)?)
                }
            }
            Some(_) => {
                return err(
                    self.offset(),
                    "invalid counted repetition: expected ',' or '}'",
                )
            }
            None => return err(here, "unclosed counted repetition"),
        };
        match self.peek() {
            Some('}') => self.pos += 1,
            Some(_) => return err(self.offset(), "invalid counted repetition: expected '}'"),
            None => return err(here, "unclosed counted repetition"),
        }
        if let Some(max) = max {
            if min > max {
                return err(here, "counted repetition has min greater than max");
            }
        }
        Ok((min, max))
    }

    fn parse_count(&mut self, open: usize) -> Result<u32, RegexError> {
        let start = self.offset();
        let mut value: u32 = 0;
        let mut digits = 0;
        while let Some(d) = self.peek().and_then(|c| c.to_digit(10)) {
            value = value.saturating_mul(10).saturating_add(d);
            digits += 1;
            self.pos += 1;
        }
        if digits == 0 {
            return if self.peek().is_none() {
                err(open, "unclosed counted repetition")
            } else {
                err(start, "invalid counted repetition: expected a number")
            };
        }
        if value > MAX_REPEAT {
            return err(start, "repetition count exceeds 1000");
        }
        Ok(value)
    }

    /// Parses a backslash escape (outside or inside a class).
    fn parse_escape(&mut self) -> Result<Escaped, RegexError> {
        let here = self.offset();
        self.pos += 1;
        let Some(c) = self.peek() else {
            return err(here, "pattern ends with a lone backslash");
        };
        self.pos += 1;
        if let Some(set) = perl_class(c) {
            return Ok(Escaped::Set(set));
        }
        let literal = match c {
            'n' => '\n',
            't' => '\t',
            'r' => '\r',
            'f' => '\u{c}',
            'v' => '\u{b}',
            c if c.is_ascii_punctuation() => c,
            _ => return err(here, "unsupported escape sequence"),
        };
        Ok(Escaped::Char(literal))
    }

    /// Parses a `[...]` class starting at the current `[`.
    fn parse_class(&mut self) -> Result<Node, RegexError> {
        let open = self.offset();
        self.pos += 1;
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges: Ranges = Vec::new();
        let mut first = true;
        loop {
            let here = self.offset();
            let Some(c) = self.peek() else {
                return err(open, "unclosed character class");
            };
            if c == ']' && !first {
                self.pos += 1;
                break;
            }
            first = false;
            if matches!(c, '&' | '-' | '~') && self.peek_at(1) == Some(c) {
                return err(here, "class set operations (&&, --, ~~) are not supported");
            }
            if c == '[' {
                return err(
                    here,
                    "nested classes and [:name:] classes are not supported; escape '[' as \\[",
                );
            }
            let lo = match self.class_atom()? {
                Escaped::Set(set) => {
                    if self.peek() == Some('-') && !matches!(self.peek_at(1), Some(']') | None) {
                        return err(self.offset(), "a class escape cannot start a range");
                    }
                    ranges.extend(set);
                    continue;
                }
                Escaped::Char(lo) => lo,
            };
            if self.peek() == Some('-') && !matches!(self.peek_at(1), Some(']') | None) {
                let dash = self.offset();
                self.pos += 1;
                let end = self.offset();
                if self.peek() == Some('-') {
                    return err(dash, "class set operations (&&, --, ~~) are not supported");
                }
                if self.peek() == Some('[') {
                    return err(
                        end,
                        "nested classes and [:name:] classes are not supported; escape '[' as \\[",
                    );
                }
                let hi = match self.class_atom()? {
                    Escaped::Char(hi) => hi,
                    Escaped::Set(_) => return err(end, "a class escape cannot end a range"),
                };
                if hi < lo {
                    return err(here, "class range is out of order");
                }
                ranges.push((lo as u32, hi as u32));
            } else {
                ranges.push((lo as u32, lo as u32));
            }
        }
        let ranges = normalize(ranges);
        Ok(Node::Class(if negated {
            complement(&ranges)
        } else {
            ranges
        }))
    }

    fn class_atom(&mut self) -> Result<Escaped, RegexError> {
        match self.peek() {
            Some('\\') => self.parse_escape(),
            Some(c) => {
                self.pos += 1;
                Ok(Escaped::Char(c))
            }
            None => err(self.pattern.len(), "unclosed character class"),
        }
    }
}

enum Escaped {
    Char(char),
    Set(Ranges),
}

// ---------------------------------------------------------------------------
// Compiler
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Inst {
    Char(char),
    /// Any character except `\n`.
    Any,
    Class(Box<[(u32, u32)]>),
    AssertStart,
    AssertEnd,
    Split(usize, usize),
    Jmp(usize),
    Match,
}

/// Exact number of instructions `compile` emits for `node` (saturating).
fn program_size(node: &Node) -> u64 {
    match node {
        Node::Empty => 0,
        Node::Char(_) | Node::Any | Node::Class(_) | Node::Start | Node::End => 1,
        Node::Concat(items) => items
            .iter()
            .fold(0u64, |acc, n| acc.saturating_add(program_size(n))),
        Node::Alt(alts) => {
            let body = alts
                .iter()
                .fold(0u64, |acc, n| acc.saturating_add(program_size(n)));
            body.saturating_add(2 * (alts.len() as u64 - 1))
        }
        Node::Repeat { node, min, max } => {
            let s = program_size(node);
            let min = u64::from(*min);
            match max {
                None if min == 0 => s.saturating_add(2),
                None => s.saturating_mul(min).saturating_add(1),
                Some(max) => {
                    let optional = u64::from(*max) - min;
                    s.saturating_mul(min)
                        .saturating_add(s.saturating_add(1).saturating_mul(optional))
                }
            }
        }
    }
}

fn emit(prog: &mut Vec<Inst>, inst: Inst) -> usize {
    prog.push(inst);
    prog.len() - 1
}

fn compile(node: &Node, prog: &mut Vec<Inst>) {
    match node {
        Node::Empty => {}
        Node::Char(c) => {
            emit(prog, Inst::Char(*c));
        }
        Node::Any => {
            emit(prog, Inst::Any);
        }
        Node::Class(ranges) => {
            emit(prog, Inst::Class(ranges.clone().into_boxed_slice()));
        }
        Node::Start => {
            emit(prog, Inst::AssertStart);
        }
        Node::End => {
            emit(prog, Inst::AssertEnd);
        }
        Node::Concat(items) => {
            for item in items {
                compile(item, prog);
            }
        }
        Node::Alt(alts) => {
            let mut jumps = Vec::with_capacity(alts.len());
            for (i, alt) in alts.iter().enumerate() {
                if i + 1 == alts.len() {
                    compile(alt, prog);
                } else {
                    let split = emit(prog, Inst::Split(0, 0));
                    compile(alt, prog);
                    jumps.push(emit(prog, Inst::Jmp(0)));
                    prog[split] = Inst::Split(split + 1, prog.len());
                }
            }
            let end = prog.len();
            for jump in jumps {
                prog[jump] = Inst::Jmp(end);
            }
        }
        Node::Repeat { node, min, max } => match max {
            None if *min == 0 => {
                // L: split(body, out); body; jmp L; out:
                let split = emit(prog, Inst::Split(0, 0));
                compile(node, prog);
                emit(prog, Inst::Jmp(split));
                prog[split] = Inst::Split(split + 1, prog.len());
            }
            None => {
                for _ in 1..*min {
                    compile(node, prog);
                }
                // L: body; split(L, out); out:
                let body = prog.len();
                compile(node, prog);
                let split = emit(prog, Inst::Split(body, 0));
                prog[split] = Inst::Split(body, split + 1);
            }
            Some(max) => {
                for _ in 0..*min {
                    compile(node, prog);
                }
                // Nested optionals (x(x(x)?)?)?: each split may skip to the end.
                let mut splits = Vec::with_capacity((max - min) as usize);
                for _ in *min..*max {
                    splits.push(emit(prog, Inst::Split(0, 0)));
                    compile(node, prog);
                }
                let end = prog.len();
                for split in splits {
                    prog[split] = Inst::Split(split + 1, end);
                }
            }
        },
    }
}

/// Whether every match must begin at the start of the text.
fn anchored_at_start(node: &Node) -> bool {
    match node {
        Node::Start => true,
        Node::Concat(items) => items.first().is_some_and(anchored_at_start),
        Node::Alt(alts) => alts.iter().all(anchored_at_start),
        Node::Repeat { node, min, .. } => *min > 0 && anchored_at_start(node),
        _ => false,
    }
}

// ---------------------------------------------------------------------------
// Matcher
// ---------------------------------------------------------------------------

/// A compiled regular expression; see the [module docs](self) for syntax.
#[derive(Clone, Debug)]
pub struct Regex {
    pattern: String,
    prog: Vec<Inst>,
    anchored: bool,
}

impl Regex {
    /// Compiles `pattern`, or explains why it is not accepted.
    pub fn new(pattern: &str) -> Result<Regex, RegexError> {
        if pattern.len() > MAX_PATTERN_LEN {
            return err(MAX_PATTERN_LEN, "pattern longer than 4096 bytes");
        }
        let mut parser = Parser {
            chars: pattern.char_indices().collect(),
            pos: 0,
            pattern,
        };
        let ast = parser.parse()?;
        // +1 for the final `Match`.
        let size = program_size(&ast).saturating_add(1);
        if size > MAX_PROGRAM as u64 {
            return err(0, "compiled program exceeds 100000 instructions");
        }
        let mut prog = Vec::with_capacity(size as usize);
        compile(&ast, &mut prog);
        emit(&mut prog, Inst::Match);
        debug_assert_eq!(prog.len() as u64, size);
        Ok(Regex {
            pattern: pattern.to_owned(),
            anchored: anchored_at_start(&ast),
            prog,
        })
    }

    /// The pattern this regex was compiled from.
    pub fn as_str(&self) -> &str {
        &self.pattern
    }

    /// Whether the pattern matches anywhere in `text`.
    ///
    /// Runs in `O(text.chars().count() × program size)` time and
    /// `O(program size)` space.
    pub fn is_match(&self, text: &str) -> bool {
        let mut unlimited = u64::MAX;
        self.is_match_within(text, &mut unlimited).unwrap_or(false)
    }

    /// As [`Regex::is_match`], spending at most `*budget` units of work (one unit per
    /// live state per character, about a nanosecond each) and deducting what it spent;
    /// `None` when the budget ran out before an answer. Lets a caller bound the cost of
    /// matching many texts with an expensive pattern.
    pub fn is_match_within(&self, text: &str, budget: &mut u64) -> Option<bool> {
        let n = self.prog.len();
        let mut clist = StateSet::new(n);
        let mut nlist = StateSet::new(n);
        let mut stack = Vec::new();

        let mut chars = text.chars();
        let mut next = chars.next();
        if self.add(&mut clist, &mut stack, 0, true, next.is_none()) {
            return Some(true);
        }
        while let Some(c) = next {
            *budget = budget.checked_sub(clist.len() as u64 + 1)?;
            next = chars.next();
            let at_end = next.is_none();
            nlist.clear();
            for &pc in clist.iter() {
                let step = match &self.prog[pc] {
                    Inst::Char(want) => *want == c,
                    Inst::Any => c != '\n',
                    Inst::Class(ranges) => ranges_contain(ranges, c),
                    _ => false,
                };
                if step && self.add(&mut nlist, &mut stack, pc + 1, false, at_end) {
                    return Some(true);
                }
            }
            // Unanchored search: a new attempt may start at every position.
            if !self.anchored && self.add(&mut nlist, &mut stack, 0, false, at_end) {
                return Some(true);
            }
            if nlist.is_empty() {
                // Only reachable when anchored: no thread can ever revive.
                return Some(false);
            }
            std::mem::swap(&mut clist, &mut nlist);
        }
        Some(false)
    }

    /// Adds `pc` and its epsilon closure (at a position described by
    /// `at_start` / `at_end`) to `set`. Returns true if `Match` is reached.
    fn add(
        &self,
        set: &mut StateSet,
        stack: &mut Vec<usize>,
        pc: usize,
        at_start: bool,
        at_end: bool,
    ) -> bool {
        stack.clear();
        stack.push(pc);
        while let Some(pc) = stack.pop() {
            if !set.insert(pc) {
                continue;
            }
            match &self.prog[pc] {
                Inst::Match => return true,
                Inst::Jmp(to) => stack.push(*to),
                Inst::Split(a, b) => {
                    stack.push(*b);
                    stack.push(*a);
                }
                Inst::AssertStart => {
                    if at_start {
                        stack.push(pc + 1);
                    }
                }
                Inst::AssertEnd => {
                    if at_end {
                        stack.push(pc + 1);
                    }
                }
                Inst::Char(_) | Inst::Any | Inst::Class(_) => {}
            }
        }
        false
    }
}

impl fmt::Display for Regex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.pattern)
    }
}

impl std::str::FromStr for Regex {
    type Err = RegexError;

    fn from_str(pattern: &str) -> Result<Regex, RegexError> {
        Regex::new(pattern)
    }
}

/// A set of program counters with O(1) insert, membership and clear.
/// Every visited state is recorded (to cut epsilon cycles); iteration
/// yields them in insertion order.
struct StateSet {
    dense: Vec<usize>,
    sparse: Vec<usize>,
}

impl StateSet {
    fn new(capacity: usize) -> StateSet {
        StateSet {
            dense: Vec::with_capacity(capacity),
            sparse: vec![0; capacity],
        }
    }

    fn insert(&mut self, pc: usize) -> bool {
        let slot = self.sparse[pc];
        if slot < self.dense.len() && self.dense[slot] == pc {
            return false;
        }
        self.sparse[pc] = self.dense.len();
        self.dense.push(pc);
        true
    }

    fn iter(&self) -> std::slice::Iter<'_, usize> {
        self.dense.iter()
    }

    fn is_empty(&self) -> bool {
        self.dense.is_empty()
    }

    fn len(&self) -> usize {
        self.dense.len()
    }

    fn clear(&mut self) {
        self.dense.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_helpers() {
        assert_eq!(
            normalize(vec![(5, 9), (0, 2), (3, 4), (20, 30), (25, 26)]),
            vec![(0, 9), (20, 30)]
        );
        assert_eq!(complement(&[(0, 9), (20, MAX_CHAR)]), vec![(10, 19)]);
        assert_eq!(complement(&[]), vec![(0, MAX_CHAR)]);
        let w = perl_class('w').unwrap();
        assert!(ranges_contain(&w, '_') && ranges_contain(&w, 'z') && !ranges_contain(&w, '-'));
        let not_w = perl_class('W').unwrap();
        assert!(ranges_contain(&not_w, '-') && !ranges_contain(&not_w, 'A'));
        assert!(ranges_contain(&not_w, char::MAX));
    }

    #[test]
    fn program_size_is_exact() {
        for pattern in [
            "",
            "a",
            "a|b|",
            "(a|b)*c",
            "a+",
            "a{3}",
            "a{2,5}",
            "a{2,}",
            "(ab){0,3}x?",
            "^a$",
            "((a|)|b)*",
            "[a-z]{1,2}",
        ] {
            // `new` debug-asserts that the estimate equals what was emitted.
            Regex::new(pattern).unwrap();
        }
        assert_eq!(Regex::new("a{3}").unwrap().prog.len(), 4);
    }

    #[test]
    fn anchoring_detection() {
        assert!(Regex::new("^abc").unwrap().anchored);
        assert!(Regex::new("^a|^b").unwrap().anchored);
        assert!(Regex::new("(^a)+").unwrap().anchored);
        assert!(!Regex::new("^a|b").unwrap().anchored);
        assert!(!Regex::new("(^a)*").unwrap().anchored);
    }

    #[test]
    fn empty_groups_and_repeats_are_cheap() {
        let re = Regex::new("((((){1000}){1000}){1000}){1000}x").unwrap();
        assert!(re.is_match("x"));
        assert!(!re.is_match(""));
        assert_eq!(re.prog.len(), 2);
        let re = Regex::new("((((a{0}){1000}){1000}){1000}){1000}x").unwrap();
        assert_eq!(re.prog.len(), 2);
        assert!(re.is_match("x"));
    }

    #[test]
    fn a_budget_bounds_the_work() {
        let re = Regex::new("(a|aa)*b(x|y|z){50}").unwrap();
        let text = "a".repeat(5000);
        let mut budget = 1_000;
        assert_eq!(re.is_match_within(&text, &mut budget), None);
        let mut budget = u64::MAX;
        assert_eq!(re.is_match_within(&text, &mut budget), Some(false));
        let spent = u64::MAX - budget;
        assert!(
            spent >= 5000,
            "at least a unit per character, spent {spent}"
        );
        let mut small = 10_000;
        assert_eq!(
            Regex::new("^k1$")
                .unwrap()
                .is_match_within("k1", &mut small),
            Some(true)
        );
        assert!(small < 10_000);
    }
}
