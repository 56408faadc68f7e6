//! HTTP/1.1 messages on the wire: the request and response types, reading heads and
//! bodies (`Content-Length`, chunked, to end of stream), request targets and percent
//! encoding, status lines, and formatting a response.

use std::io::{self, Read, Write};

use super::MAX_REQUEST_HEAD;

const MAX_HEADERS: usize = 128;
const MAX_CHUNK_LINE: usize = 4096;
const READ_CHUNK: usize = 16 * 1024;

// ---------------------------------------------------------------------------
// Requests and responses
// ---------------------------------------------------------------------------

/// A parsed request as handed to a [`Handler`](super::Handler).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// The method as sent (methods are case-sensitive), e.g. `GET`.
    pub method: String,
    /// The percent-decoded path, e.g. `/metadata`.
    pub path: String,
    /// Query parameters in order, names and values percent-decoded (`+` is a space).
    pub query: Vec<(String, String)>,
    /// Header fields in order, names as sent, values trimmed.
    pub headers: Vec<(String, String)>,
    /// The request body (empty when none was sent).
    pub body: Vec<u8>,
    /// The address the request came from (the server fills it in).
    pub peer: Option<std::net::IpAddr>,
}

impl Request {
    /// The first query parameter called `name` (decoded).
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }
}

/// A response produced by a [`Handler`](super::Handler). The server adds
/// `Content-Length` and `Connection`; for `HEAD` requests it sends the head only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// `Content-Type` header value.
    pub content_type: &'static str,
    /// The body bytes.
    pub body: Vec<u8>,
    /// Further header fields (names and values must be valid header text).
    pub headers: Vec<(&'static str, String)>,
}

impl Response {
    /// A response with this status, content type and body.
    pub fn new(status: u16, content_type: &'static str, body: Vec<u8>) -> Response {
        Response {
            status,
            content_type,
            body,
            headers: Vec::new(),
        }
    }

    /// This response with the header field `name: value` added.
    pub fn with_header(mut self, name: &'static str, value: String) -> Response {
        self.headers.push((name, value));
        self
    }

    /// A `text/plain` response.
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response::new(
            status,
            "text/plain; charset=utf-8",
            body.into().into_bytes(),
        )
    }

    /// An `application/json` response (the body is not checked).
    pub fn json(status: u16, body: impl Into<String>) -> Response {
        Response::new(status, "application/json", body.into().into_bytes())
    }
}

/// Standard reason phrase for `status` (empty when unknown, which HTTP allows).
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        414 => "URI Too Long",
        417 => "Expectation Failed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

// ---------------------------------------------------------------------------
// Percent encoding
// ---------------------------------------------------------------------------

/// Percent-encodes every byte of `s` except the unreserved characters
/// (`A-Z a-z 0-9 - . _ ~`).
pub fn percent_encode(s: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 15) as usize] as char);
        }
    }
    out
}

/// Decodes `%XY` escapes. `None` when an escape is malformed or the result is not
/// UTF-8. `+` is left alone (query decoding turns it into a space first).
pub fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    if !bytes.contains(&b'%') {
        return Some(s.to_owned());
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = hex_value(*bytes.get(i + 1)?)?;
            let lo = hex_value(*bytes.get(i + 2)?)?;
            out.push((hi << 4) | lo);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decodes a query component: `+` means space, then percent escapes.
fn query_decode(s: &str) -> Option<String> {
    if s.contains('+') {
        percent_decode(&s.replace('+', " "))
    } else {
        percent_decode(s)
    }
}

fn parse_query(raw: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    for part in raw.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = part.split_once('=').unwrap_or((part, ""));
        out.push((query_decode(name)?, query_decode(value)?));
    }
    Some(out)
}

// ---------------------------------------------------------------------------
// Shared wire reading
// ---------------------------------------------------------------------------

pub(super) fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Whether the comma-separated header list `name` contains `token`.
fn header_has_token(headers: &[(String, String)], name: &str, token: &str) -> bool {
    headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
        .flat_map(|(_, v)| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Whether a message leaves its connection open: `Connection: close` ends it, and
/// HTTP/1.0 keeps it only when asked with `Connection: keep-alive`.
pub(super) fn keep_alive(headers: &[(String, String)], http11: bool) -> bool {
    !header_has_token(headers, "connection", "close")
        && (http11 || header_has_token(headers, "connection", "keep-alive"))
}

pub(super) fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        })
}

#[derive(Debug)]
pub(super) enum ReadErr {
    /// The peer closed the connection (cleanly) in the middle of a message.
    Eof,
    Io(io::Error),
    /// A size limit was exceeded.
    TooLarge,
    Malformed(&'static str),
}

impl From<io::Error> for ReadErr {
    fn from(e: io::Error) -> ReadErr {
        ReadErr::Io(e)
    }
}

/// How a message body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Framing {
    Length(u64),
    Chunked,
    ToEof,
}

/// A buffered reader over a byte stream that can hand out heads, lines and bodies.
pub(super) struct Wire<S> {
    pub(super) stream: S,
    buf: Vec<u8>,
    pos: usize,
    /// Total bytes ever read from the stream.
    pub(super) received: u64,
}

impl<S: Read> Wire<S> {
    pub(super) fn new(stream: S) -> Wire<S> {
        Wire {
            stream,
            buf: Vec::new(),
            pos: 0,
            received: 0,
        }
    }

    pub(super) fn avail(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    fn consume(&mut self, n: usize) {
        self.pos += n;
        if self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        }
    }

    /// Reads more bytes into the buffer; `Ok(0)` at end of stream.
    fn fill(&mut self) -> io::Result<usize> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let old = self.buf.len();
        self.buf.resize(old + READ_CHUNK, 0);
        loop {
            match self.stream.read(&mut self.buf[old..]) {
                Ok(n) => {
                    self.buf.truncate(old + n);
                    self.received += n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.buf.truncate(old);
                    return Err(e);
                }
            }
        }
    }

    /// Reads a message head (start line plus header lines, up to and including the
    /// empty line). Leading empty lines are skipped. `Ok(None)` when the stream
    /// ends before any byte of a message.
    pub(super) fn read_head(
        &mut self,
        max: usize,
    ) -> std::result::Result<Option<Vec<u8>>, ReadErr> {
        let mut skipped = 0usize;
        loop {
            while let Some(&b) = self.avail().first() {
                if b != b'\r' && b != b'\n' {
                    break;
                }
                self.consume(1);
                skipped += 1;
            }
            if skipped > max {
                return Err(ReadErr::TooLarge);
            }
            if let Some(end) = find_head_end(self.avail()) {
                if end > max {
                    return Err(ReadErr::TooLarge);
                }
                let head = self.avail()[..end].to_vec();
                self.consume(end);
                return Ok(Some(head));
            }
            if self.avail().len() > max {
                return Err(ReadErr::TooLarge);
            }
            if self.fill()? == 0 {
                return if self.avail().is_empty() {
                    Ok(None)
                } else {
                    Err(ReadErr::Eof)
                };
            }
        }
    }

    /// Reads one line (without its `\n` / `\r\n`), at most `max` bytes long.
    fn read_line(&mut self, max: usize) -> std::result::Result<Vec<u8>, ReadErr> {
        loop {
            if let Some(i) = self.avail().iter().position(|&b| b == b'\n') {
                let mut line = self.avail()[..i].to_vec();
                self.consume(i + 1);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            if self.avail().len() > max {
                return Err(ReadErr::TooLarge);
            }
            if self.fill()? == 0 {
                return Err(ReadErr::Eof);
            }
        }
    }

    /// Appends exactly `n` bytes to `out`.
    fn read_exact_into(&mut self, n: usize, out: &mut Vec<u8>) -> std::result::Result<(), ReadErr> {
        let take = n.min(self.avail().len());
        out.extend_from_slice(&self.avail()[..take]);
        self.consume(take);
        let mut left = n - take;
        if left == 0 {
            return Ok(());
        }
        let start = out.len();
        out.resize(start + left, 0);
        let mut at = start;
        while left > 0 {
            match self.stream.read(&mut out[at..]) {
                Ok(0) => {
                    out.truncate(at);
                    return Err(ReadErr::Eof);
                }
                Ok(k) => {
                    at += k;
                    left -= k;
                    self.received += k as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    out.truncate(at);
                    return Err(ReadErr::Io(e));
                }
            }
        }
        Ok(())
    }

    pub(super) fn read_body(
        &mut self,
        framing: Framing,
        limit: usize,
    ) -> std::result::Result<Vec<u8>, ReadErr> {
        match framing {
            Framing::Length(n) => {
                if n > limit as u64 {
                    return Err(ReadErr::TooLarge);
                }
                let mut out = Vec::with_capacity((n as usize).min(1 << 20));
                self.read_exact_into(n as usize, &mut out)?;
                Ok(out)
            }
            Framing::Chunked => self.read_chunked(limit),
            Framing::ToEof => {
                let mut out = Vec::new();
                loop {
                    let n = self.avail().len();
                    if out.len() + n > limit {
                        return Err(ReadErr::TooLarge);
                    }
                    out.extend_from_slice(self.avail());
                    self.consume(n);
                    if self.fill()? == 0 {
                        return Ok(out);
                    }
                }
            }
        }
    }

    fn read_chunked(&mut self, limit: usize) -> std::result::Result<Vec<u8>, ReadErr> {
        let mut out = Vec::new();
        while let Some(chunk) = self.read_chunk(limit - out.len())? {
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// Reads the next chunk of a chunked body, at most `limit` bytes: `None` after the
    /// last one (and its trailer, discarded). Streams (etcd's watch) read chunk by
    /// chunk as they arrive; whole bodies are their chunks joined.
    pub(super) fn read_chunk(
        &mut self,
        limit: usize,
    ) -> std::result::Result<Option<Vec<u8>>, ReadErr> {
        let line = self.read_line(MAX_CHUNK_LINE)?;
        let size_field = line.split(|&b| b == b';').next().unwrap_or(&[]);
        let size_field = trim_ascii(size_field);
        if size_field.is_empty()
            || size_field.len() > 15
            || !size_field.iter().all(u8::is_ascii_hexdigit)
        {
            return Err(ReadErr::Malformed("bad chunk size"));
        }
        let size = size_field.iter().fold(0u64, |acc, &b| {
            (acc << 4) | u64::from(hex_value(b).unwrap_or(0))
        });
        if size == 0 {
            // Trailer section, discarded.
            let mut trailer_bytes = 0;
            loop {
                let t = self.read_line(MAX_CHUNK_LINE)?;
                if t.is_empty() {
                    return Ok(None);
                }
                trailer_bytes += t.len();
                if trailer_bytes > MAX_REQUEST_HEAD {
                    return Err(ReadErr::TooLarge);
                }
            }
        }
        if size > limit as u64 {
            return Err(ReadErr::TooLarge);
        }
        let mut out = Vec::with_capacity(size as usize);
        self.read_exact_into(size as usize, &mut out)?;
        if !self.read_line(MAX_CHUNK_LINE)?.is_empty() {
            return Err(ReadErr::Malformed("missing CRLF after chunk data"));
        }
        Ok(Some(out))
    }
}

fn trim_ascii(mut b: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = b {
        if first.is_ascii_whitespace() {
            b = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = b {
        if last.is_ascii_whitespace() {
            b = rest;
        } else {
            break;
        }
    }
    b
}

/// Index just past the empty line ending a message head (`\n\n` or `\n\r\n`).
fn find_head_end(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\n' {
            match b.get(i + 1) {
                Some(b'\n') => return Some(i + 2),
                Some(b'\r') if b.get(i + 2) == Some(&b'\n') => return Some(i + 3),
                _ => {}
            }
        }
        i += 1;
    }
    None
}

/// Splits a head into its start line and header fields.
pub(super) fn parse_head(
    head: &[u8],
) -> std::result::Result<(String, Vec<(String, String)>), ReadErr> {
    let text = std::str::from_utf8(head).map_err(|_| ReadErr::Malformed("head is not UTF-8"))?;
    let mut lines = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .take_while(|l| !l.is_empty());
    let start = lines.next().ok_or(ReadErr::Malformed("empty head"))?;
    if start.contains('\r') {
        return Err(ReadErr::Malformed("stray CR in start line"));
    }
    let mut headers = Vec::new();
    for line in lines {
        if line.starts_with(' ') || line.starts_with('\t') {
            return Err(ReadErr::Malformed("obsolete header line folding"));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or(ReadErr::Malformed("header line without a colon"))?;
        if !is_token(name) {
            return Err(ReadErr::Malformed("invalid header name"));
        }
        let value = value.trim_matches(|c| c == ' ' || c == '\t');
        if value.bytes().any(|b| b == b'\r' || b == 0) {
            return Err(ReadErr::Malformed("invalid header value"));
        }
        if headers.len() >= MAX_HEADERS {
            return Err(ReadErr::TooLarge);
        }
        headers.push((name.to_owned(), value.to_owned()));
    }
    Ok((start.to_owned(), headers))
}

/// Body framing from the headers. `Ok(None)`: neither header was sent.
pub(super) fn body_framing(
    headers: &[(String, String)],
) -> std::result::Result<Option<Framing>, ReadErr> {
    if find_header(headers, "transfer-encoding").is_some() {
        let last = headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("transfer-encoding"))
            .flat_map(|(_, v)| v.split(','))
            .map(str::trim)
            .rfind(|t| !t.is_empty());
        return match last {
            Some(t) if t.eq_ignore_ascii_case("chunked") => Ok(Some(Framing::Chunked)),
            _ => Err(ReadErr::Malformed("unsupported transfer-encoding")),
        };
    }
    let mut length: Option<u64> = None;
    for v in headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .flat_map(|(_, v)| v.split(','))
    {
        let v = v.trim();
        if v.is_empty() || v.len() > 19 || !v.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ReadErr::Malformed("invalid content-length"));
        }
        let n: u64 = v
            .parse()
            .map_err(|_| ReadErr::Malformed("invalid content-length"))?;
        if length.is_some_and(|l| l != n) {
            return Err(ReadErr::Malformed("conflicting content-length values"));
        }
        length = Some(n);
    }
    Ok(length.map(Framing::Length))
}

/// Splits a request target into decoded path and query. Accepts origin form
/// (`/p?q`), absolute form (`http://host/p?q`) and `*`.
pub(super) fn parse_target(target: &str) -> Option<(String, Vec<(String, String)>)> {
    let target = target.split('#').next().unwrap_or("");
    let rel = if target.starts_with('/') || target == "*" {
        target
    } else {
        let lower = target.get(..7)?.to_ascii_lowercase();
        if lower != "http://" {
            return None;
        }
        let rest = &target[7..];
        match rest.find(['/', '?']) {
            Some(i) => &rest[i..],
            None => "/",
        }
    };
    let (raw_path, raw_query) = rel.split_once('?').unwrap_or((rel, ""));
    let path = if raw_path.is_empty() {
        "/".to_owned()
    } else {
        percent_decode(raw_path)?
    };
    Some((path, parse_query(raw_query)?))
}

pub(super) fn write_response(
    mut stream: impl Write,
    resp: &Response,
    head_only: bool,
    keep_alive: bool,
) -> io::Result<()> {
    let no_body = resp.status < 200 || resp.status == 204 || resp.status == 304;
    let mut out = format!(
        "HTTP/1.1 {} {}\r\n",
        resp.status,
        reason_phrase(resp.status)
    );
    if !no_body {
        out.push_str(&format!(
            "Content-Type: {}\r\nContent-Length: {}\r\n",
            resp.content_type,
            resp.body.len()
        ));
    }
    for (name, value) in &resp.headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str(if keep_alive {
        "Connection: keep-alive\r\n\r\n"
    } else {
        "Connection: close\r\n\r\n"
    });
    let mut out = out.into_bytes();
    if !head_only && !no_body {
        out.extend_from_slice(&resp.body);
    }
    stream.write_all(&out)?;
    stream.flush()
}

/// `HTTP/1.x NNN reason` → (is HTTP/1.1 or later, status).
pub(super) fn parse_status_line(line: &str) -> Option<(bool, u16)> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    let code = parts.next()?;
    let minor = version.strip_prefix("HTTP/1.")?;
    if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let status: u16 = code.parse().ok()?;
    if !(100..=599).contains(&status) {
        return None;
    }
    Some((minor != "0", status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_round_trip() {
        for s in [
            "",
            "abc",
            "a b&c=d/e:f",
            "mooncake/ram/127.0.0.1:1234",
            "héllo ✓ 日本",
        ] {
            assert_eq!(percent_decode(&percent_encode(s)).as_deref(), Some(s));
        }
        assert_eq!(percent_encode("a-b.c_d~e f"), "a-b.c_d~e%20f");
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(query_decode("a+b%2B").as_deref(), Some("a b+"));
    }

    #[test]
    fn targets() {
        let (p, q) = parse_target("/metadata?key=a%20b&x&y=1+2").unwrap();
        assert_eq!(p, "/metadata");
        assert_eq!(
            q,
            vec![
                ("key".into(), "a b".into()),
                ("x".into(), String::new()),
                ("y".into(), "1 2".into())
            ]
        );
        assert_eq!(parse_target("http://h:1/a?b=c").unwrap().0, "/a");
        assert_eq!(parse_target("http://h:1").unwrap().0, "/");
        assert!(parse_target("ftp://x/").is_none());
        assert!(parse_target("/a?k=%zz").is_none());
    }

    #[test]
    fn chunked_decoding() {
        let data = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nX-T: 1\r\n\r\nrest";
        let mut w = Wire::new(&data[..]);
        assert_eq!(w.read_body(Framing::Chunked, 100).unwrap(), b"Wikipedia");
        assert_eq!(w.avail(), b"rest");
        let mut w = Wire::new(&data[..]);
        assert_eq!(w.read_chunk(100).unwrap().unwrap(), b"Wiki");
        assert_eq!(w.read_chunk(100).unwrap().unwrap(), b"pedia");
        assert!(w.read_chunk(100).unwrap().is_none());
        let mut w = Wire::new(&b"ff\r\n"[..]);
        assert!(matches!(
            w.read_body(Framing::Chunked, 10),
            Err(ReadErr::TooLarge)
        ));
        let mut w = Wire::new(&b"zz\r\n"[..]);
        assert!(matches!(
            w.read_body(Framing::Chunked, 10),
            Err(ReadErr::Malformed(_))
        ));
    }

    #[test]
    fn heads() {
        let mut w = Wire::new(&b"\r\nGET / HTTP/1.1\nA: b\n\nx"[..]);
        let h = w.read_head(100).unwrap().unwrap();
        let (start, headers) = parse_head(&h).unwrap();
        assert_eq!(start, "GET / HTTP/1.1");
        assert_eq!(headers, vec![("A".into(), "b".into())]);
        assert!(parse_head(b"GET / HTTP/1.1\r\n folded\r\n\r\n").is_err());
        assert!(parse_head(b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n").is_err());
        let cl = |v: &str| body_framing(&[("Content-Length".into(), v.into())]);
        assert_eq!(cl("12").unwrap(), Some(Framing::Length(12)));
        assert_eq!(cl("3, 3").unwrap(), Some(Framing::Length(3)));
        assert!(cl("3, 4").is_err());
        assert!(cl("-1").is_err());
        assert!(cl("+1").is_err());
        assert_eq!(
            parse_status_line("HTTP/1.0 404 Not Found"),
            Some((false, 404))
        );
        assert_eq!(parse_status_line("HTTP/1.1 200"), Some((true, 200)));
        assert_eq!(parse_status_line("HTTP/2 200 OK"), None);
    }
}
