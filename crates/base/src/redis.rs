//! A small Redis client (RESP2 over one persistent TCP connection): what Mooncake's
//! redis metadata backend uses — `GET`, `SET`, `DEL`, with `AUTH` and `SELECT` from
//! `MC_REDIS_USERNAME`, `MC_REDIS_PASSWORD` and `MC_REDIS_DB_INDEX` as upstream reads
//! them.

#![forbid(unsafe_code)]

use crate::util::sync::Unpoisoned;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{Code, Error, Result};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest bulk reply accepted: metadata values are descriptors of a few KiB.
const MAX_BULK: usize = 64 << 20;
/// Longest status or error line accepted.
const MAX_LINE: usize = 64 << 10;

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK` and other simple strings.
    Status(String),
    /// `-ERR ...`: the server refused the command.
    Error(String),
    /// `:n`
    Integer(i64),
    /// `$n` bulk string; `None` is the nil reply.
    Bulk(Option<Vec<u8>>),
    /// `*n`; `None` is the nil array.
    Array(Option<Vec<Reply>>),
}

/// Credentials and database chosen after connecting.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// ACL user name (Redis 6+); empty for the default user.
    pub username: String,
    /// Password; empty for none (then no `AUTH` is sent).
    pub password: String,
    /// Database index for `SELECT` (0 needs none).
    pub db: u8,
}

impl RedisOptions {
    /// Reads `MC_REDIS_USERNAME`, `MC_REDIS_PASSWORD` and `MC_REDIS_DB_INDEX`; an
    /// index that is not 0..=255 is an error (upstream silently falls back to 0,
    /// which writes into the wrong database).
    pub fn from_env() -> Result<RedisOptions> {
        let var = |k: &str| std::env::var(k).unwrap_or_default();
        let db = match var("MC_REDIS_DB_INDEX").trim() {
            "" => 0,
            s => s.parse::<u8>().map_err(|_| {
                Error::invalid(format!("MC_REDIS_DB_INDEX={s:?}: expected 0..=255"))
            })?,
        };
        Ok(RedisOptions {
            username: var("MC_REDIS_USERNAME"),
            password: var("MC_REDIS_PASSWORD"),
            db,
        })
    }
}

/// A client for one Redis server; requests from several threads serialize.
#[derive(Debug)]
pub struct RedisClient {
    addr: String,
    options: RedisOptions,
    conn: Mutex<Option<BufReader<TcpStream>>>,
}

fn protocol_error(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = Vec::new();
    r.take(MAX_LINE as u64 + 2).read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    if !line.ends_with(b"\r\n") {
        return Err(protocol_error(
            "reply line not terminated by CRLF (or too long)",
        ));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| protocol_error("reply line is not UTF-8"))
}

fn parse_len(s: &str) -> io::Result<i64> {
    s.parse()
        .map_err(|_| protocol_error(format!("bad length {s:?} in reply")))
}

/// Reads one reply; arrays nest at most `depth` levels.
fn read_reply(r: &mut impl BufRead, depth: u32) -> io::Result<Reply> {
    let line = read_line(r)?;
    let (kind, rest) = line.split_at_checked(1).unwrap_or(("", ""));
    match kind {
        "+" => Ok(Reply::Status(rest.to_owned())),
        "-" => Ok(Reply::Error(rest.to_owned())),
        ":" => Ok(Reply::Integer(parse_len(rest)?)),
        "$" => {
            let n = parse_len(rest)?;
            if n < 0 {
                return Ok(Reply::Bulk(None));
            }
            let n = usize::try_from(n)
                .ok()
                .filter(|n| *n <= MAX_BULK)
                .ok_or_else(|| protocol_error(format!("bulk reply of {n} bytes is too large")))?;
            let mut buf = vec![0; n + 2];
            r.read_exact(&mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(protocol_error("bulk reply not terminated by CRLF"));
            }
            buf.truncate(n);
            Ok(Reply::Bulk(Some(buf)))
        }
        "*" => {
            let n = parse_len(rest)?;
            if n < 0 {
                return Ok(Reply::Array(None));
            }
            if depth == 0 || n > 1 << 20 {
                return Err(protocol_error("array reply too deep or too long"));
            }
            let items = (0..n)
                .map(|_| read_reply(r, depth - 1))
                .collect::<io::Result<Vec<_>>>()?;
            Ok(Reply::Array(Some(items)))
        }
        _ => Err(protocol_error(format!("unknown reply type in {line:?}"))),
    }
}

fn encode_command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

impl RedisClient {
    /// `addr` is `host:port`. Nothing is contacted until the first command.
    pub fn new(addr: &str, options: RedisOptions) -> Result<RedisClient> {
        let addr = addr.trim().trim_end_matches('/');
        match addr.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0) => {
            }
            _ => {
                return Err(Error::invalid(format!(
                    "redis address {addr:?}: expected host:port"
                )))
            }
        }
        Ok(RedisClient {
            addr: addr.to_owned(),
            options,
            conn: Mutex::new(None),
        })
    }

    /// The server's `host:port`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn connect(&self) -> Result<BufReader<TcpStream>> {
        let what = format!("connect to redis {}", self.addr);
        let addrs = self
            .addr
            .to_socket_addrs()
            .map_err(|e| Error::io(&what, e))?;
        let mut last = io::Error::new(io::ErrorKind::NotFound, "host resolved to no addresses");
        for a in addrs {
            match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
                Ok(s) => {
                    s.set_nodelay(true)
                        .and_then(|_| s.set_read_timeout(Some(IO_TIMEOUT)))
                        .and_then(|_| s.set_write_timeout(Some(IO_TIMEOUT)))
                        .map_err(|e| Error::io(&what, e))?;
                    let mut conn = BufReader::new(s);
                    self.prepare(&mut conn)?;
                    return Ok(conn);
                }
                Err(e) => last = e,
            }
        }
        Err(Error::io(&what, last))
    }

    /// AUTH and SELECT on a fresh connection.
    fn prepare(&self, conn: &mut BufReader<TcpStream>) -> Result<()> {
        let o = &self.options;
        if !o.password.is_empty() {
            let mut args: Vec<&[u8]> = vec![b"AUTH"];
            if !o.username.is_empty() {
                args.push(o.username.as_bytes());
            }
            args.push(o.password.as_bytes());
            self.expect_ok(conn, &args, "AUTH")?;
        }
        if o.db != 0 {
            let db = o.db.to_string();
            self.expect_ok(conn, &[b"SELECT", db.as_bytes()], "SELECT")?;
        }
        Ok(())
    }

    fn expect_ok(&self, conn: &mut BufReader<TcpStream>, args: &[&[u8]], what: &str) -> Result<()> {
        match Self::exchange(conn, args)
            .map_err(|e| Error::io(format!("redis {} {what}", self.addr), e))?
        {
            Reply::Status(_) => Ok(()),
            other => Err(self.refused(what, &other)),
        }
    }

    fn exchange(conn: &mut BufReader<TcpStream>, args: &[&[u8]]) -> io::Result<Reply> {
        conn.get_mut().write_all(&encode_command(args))?;
        read_reply(conn, 4)
    }

    fn refused(&self, what: &str, reply: &Reply) -> Error {
        let why = match reply {
            Reply::Error(e) => e.clone(),
            other => format!("unexpected reply {other:?}"),
        };
        Error::new(
            Code::Metadata,
            format!("redis {}: {what} failed: {why}", self.addr),
        )
    }

    /// Sends one command and returns its reply. A pooled connection found broken is
    /// replaced once (commands used here are idempotent).
    pub fn command(&self, args: &[&[u8]]) -> Result<Reply> {
        let mut conn = self.conn.locked();
        let mut retried = false;
        loop {
            let reused = conn.is_some();
            let c = match conn.as_mut() {
                Some(c) => c,
                None => conn.insert(self.connect()?),
            };
            match Self::exchange(c, args) {
                Ok(reply) => return Ok(reply),
                Err(e) => {
                    *conn = None;
                    if reused && !retried && e.kind() != io::ErrorKind::InvalidData {
                        retried = true;
                        continue;
                    }
                    return Err(Error::io(format!("redis {}", self.addr), e));
                }
            }
        }
    }

    /// `GET key`.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.command(&[b"GET", key])? {
            Reply::Bulk(v) => Ok(v),
            other => Err(self.refused("GET", &other)),
        }
    }

    /// `SET key value`.
    pub fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        match self.command(&[b"SET", key, value])? {
            Reply::Status(_) => Ok(()),
            other => Err(self.refused("SET", &other)),
        }
    }

    /// `DEL key`; returns how many keys were removed.
    pub fn del(&self, key: &[u8]) -> Result<i64> {
        match self.command(&[b"DEL", key])? {
            Reply::Integer(n) => Ok(n),
            other => Err(self.refused("DEL", &other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> io::Result<Reply> {
        read_reply(&mut BufReader::new(bytes), 4)
    }

    #[test]
    fn replies_parse() {
        assert_eq!(parse(b"+OK\r\n").unwrap(), Reply::Status("OK".into()));
        assert_eq!(
            parse(b"-ERR no\r\n").unwrap(),
            Reply::Error("ERR no".into())
        );
        assert_eq!(parse(b":-3\r\n").unwrap(), Reply::Integer(-3));
        assert_eq!(parse(b"$-1\r\n").unwrap(), Reply::Bulk(None));
        assert_eq!(
            parse(b"$3\r\na\r\n\r\n").unwrap(),
            Reply::Bulk(Some(b"a\r\n".to_vec()))
        );
        assert_eq!(
            parse(b"*2\r\n:1\r\n$0\r\n\r\n").unwrap(),
            Reply::Array(Some(vec![Reply::Integer(1), Reply::Bulk(Some(Vec::new()))]))
        );
    }

    #[test]
    fn malformed_replies_are_errors() {
        for bad in [
            &b"?x\r\n"[..],
            b"+OK\n",
            b"$5\r\nab\r\n",
            b"$99999999999\r\n",
            b":x\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
            b"",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn commands_encode_as_bulk_arrays() {
        assert_eq!(
            encode_command(&[b"GET", b"k y"]),
            b"*2\r\n$3\r\nGET\r\n$3\r\nk y\r\n".to_vec()
        );
    }

    #[test]
    fn addresses_are_checked() {
        assert!(RedisClient::new("127.0.0.1:6379", RedisOptions::default()).is_ok());
        for bad in ["127.0.0.1", ":6379", "h:0", "h:x"] {
            assert!(
                RedisClient::new(bad, RedisOptions::default()).is_err(),
                "{bad}"
            );
        }
    }
}
