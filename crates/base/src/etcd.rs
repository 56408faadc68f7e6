//! An etcd v3 client over etcd's JSON gateway (`POST /v3/kv/range` and friends) on our
//! own HTTP client: keys and values travel base64-encoded, 64-bit integers as decimal
//! strings (proto3's JSON mapping). Covers what Mooncake needs from etcd: get, put,
//! delete, prefix listing, leases, compare-and-set transactions, and a watch for the
//! next change of one key (`/v3/watch`, read as a chunked stream of JSON messages).
//!
//! Several endpoints (`h1:p1,h2:p2` or `;`-separated, as Mooncake accepts) are tried
//! in turn: a transport failure moves to the next one; an answer from etcd, even an
//! error, is final.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Code, Error, Result};
use crate::http::{BodyStream, HttpClient};
use crate::json::{self, Value};
use crate::util::base64;

/// One key's entry as etcd reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key's bytes.
    pub key: Vec<u8>,
    /// The value's bytes.
    pub value: Vec<u8>,
    /// Revision of the key's creation.
    pub create_revision: i64,
    /// Revision of its last change.
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none).
    pub lease: i64,
}

/// A client for one etcd cluster.
#[derive(Debug)]
pub struct EtcdClient {
    endpoints: Vec<HttpClient>,
    /// The endpoint that answered last; tried first.
    current: AtomicUsize,
}

/// An int64 field of a gateway answer: a decimal string, a number, or absent (0).
fn int_field(v: &Value, key: &str) -> Result<i64> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::String(s)) => s
            .parse()
            .map_err(|_| bad_answer(format!("field {key:?} is not an integer: {s:?}"))),
        Some(n) => n
            .as_i64()
            .ok_or_else(|| bad_answer(format!("field {key:?} is not an integer"))),
    }
}

fn bytes_field(v: &Value, key: &str) -> Result<Vec<u8>> {
    match v.get(key).and_then(Value::as_str) {
        None => Ok(Vec::new()),
        Some(s) => {
            base64::decode(s).ok_or_else(|| bad_answer(format!("field {key:?} is not base64")))
        }
    }
}

fn bad_answer(why: String) -> Error {
    Error::new(Code::Metadata, format!("etcd: unexpected answer: {why}"))
}

fn b64(bytes: &[u8]) -> Value {
    Value::from(base64::encode(bytes))
}

/// The end of the key range holding every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from `prefix` on ("\0" means no end).
    vec![0]
}

fn put_request(key: &[u8], value: &[u8], lease: i64) -> Value {
    let mut fields = vec![("key", b64(key)), ("value", b64(value))];
    if lease != 0 {
        fields.push(("lease", Value::from(lease.to_string())));
    }
    Value::object(fields)
}

impl EtcdClient {
    /// `endpoints`: `host:port` entries separated by `,` or `;`, each optionally
    /// prefixed with `http://`. Nothing is contacted until the first call.
    pub fn new(endpoints: &str) -> Result<EtcdClient> {
        let mut clients = Vec::new();
        for ep in endpoints.split([',', ';']).map(str::trim) {
            if ep.is_empty() {
                continue;
            }
            let url = if ep.contains("://") {
                ep.to_owned()
            } else {
                format!("http://{ep}")
            };
            let client = HttpClient::new(&url)
                .map_err(|e| Error::invalid(format!("etcd endpoint {ep:?}: {}", e.context())))?;
            if !client.base_path().is_empty() {
                return Err(Error::invalid(format!(
                    "etcd endpoint {ep:?}: expected host:port, without a path"
                )));
            }
            clients.push(client);
        }
        if clients.is_empty() {
            return Err(Error::invalid(format!(
                "no etcd endpoint in {endpoints:?} (expected host:port[,host:port...])"
            )));
        }
        Ok(EtcdClient {
            endpoints: clients,
            current: AtomicUsize::new(0),
        })
    }

    /// The endpoints as given, for messages.
    pub fn describe(&self) -> String {
        let urls: Vec<&str> = self.endpoints.iter().map(HttpClient::url).collect();
        urls.join(",")
    }

    /// Posts `body` to `path` on the first endpoint that answers.
    fn call(&self, path: &str, body: &Value) -> Result<Value> {
        let body = body.to_string();
        let n = self.endpoints.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        let mut last_err = None;
        for i in 0..n {
            let idx = (first + i) % n;
            let ep = &self.endpoints[idx];
            match ep.request("POST", path, body.as_bytes()) {
                Ok((status, resp)) => {
                    self.current.store(idx, Ordering::Relaxed);
                    let text = String::from_utf8_lossy(&resp);
                    let parsed = json::parse(&text).map_err(|e| {
                        bad_answer(format!("{path} answered {status} with invalid JSON: {e}"))
                    })?;
                    if status != 200 {
                        let msg = parsed
                            .get("message")
                            .or_else(|| parsed.get("error"))
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        return Err(Error::new(
                            Code::Metadata,
                            format!("etcd {}{path}: status {status}: {msg}", ep.url()),
                        ));
                    }
                    return Ok(parsed);
                }
                Err(e) => last_err = Some(e),
            }
        }
        let e = last_err.map(|e| e.context().to_owned()).unwrap_or_default();
        Err(Error::new(
            Code::Metadata,
            format!("etcd {}: no endpoint reachable: {e}", self.describe()),
        ))
    }

    /// Waits up to `wait` for a change (put or delete) of `key` at or after revision
    /// `from` (changes since then that etcd still remembers count too). True when one
    /// came, false when the time ran out or etcd ended the watch.
    pub fn watch_change(&self, key: &[u8], from: i64, wait: Duration) -> Result<bool> {
        let ep = &self.endpoints[self.current.load(Ordering::Relaxed) % self.endpoints.len()];
        let body = Value::object([(
            "create_request",
            Value::object([
                ("key", b64(key)),
                ("start_revision", Value::from(from.to_string())),
            ]),
        )])
        .to_string();
        let watch = || -> Result<bool> {
            let mut stream =
                ep.open_stream("POST", "/v3/watch", body.as_bytes(), Instant::now() + wait)?;
            if stream.status() != 200 {
                return Err(Error::new(
                    Code::Metadata,
                    format!("status {}", stream.status()),
                ));
            }
            watch_messages(&mut stream)
        };
        match watch() {
            Ok(changed) => Ok(changed),
            Err(e) if e.code() == Code::Timeout => Ok(false),
            Err(e) => Err(Error::new(
                Code::Metadata,
                format!("etcd watch on {}: {}", ep.url(), e.context()),
            )),
        }
    }

    fn key_values(answer: &Value) -> Result<Vec<KeyValue>> {
        let Some(kvs) = answer.get("kvs") else {
            return Ok(Vec::new());
        };
        let kvs = kvs
            .as_array()
            .ok_or_else(|| bad_answer("\"kvs\" is not an array".into()))?;
        kvs.iter()
            .map(|kv| {
                Ok(KeyValue {
                    key: bytes_field(kv, "key")?,
                    value: bytes_field(kv, "value")?,
                    create_revision: int_field(kv, "create_revision")?,
                    mod_revision: int_field(kv, "mod_revision")?,
                    lease: int_field(kv, "lease")?,
                })
            })
            .collect()
    }

    /// The entry under `key`, if any.
    pub fn get(&self, key: &[u8]) -> Result<Option<KeyValue>> {
        let answer = self.call("/v3/kv/range", &Value::object([("key", b64(key))]))?;
        Ok(Self::key_values(&answer)?.into_iter().next())
    }

    /// Every entry whose key starts with `prefix`, in key order.
    pub fn get_prefix(&self, prefix: &[u8]) -> Result<Vec<KeyValue>> {
        let req = Value::object([
            ("key", b64(prefix)),
            ("range_end", b64(&prefix_end(prefix))),
        ]);
        Self::key_values(&self.call("/v3/kv/range", &req)?)
    }

    /// Stores `value` under `key` (attached to `lease` unless 0); returns the
    /// revision of the change.
    pub fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64> {
        let answer = self.call("/v3/kv/put", &put_request(key, value, lease))?;
        int_field(answer.get("header").unwrap_or(&Value::Null), "revision")
    }

    /// Removes `key`; returns how many keys were removed (0 or 1).
    pub fn delete(&self, key: &[u8]) -> Result<u64> {
        let answer = self.call("/v3/kv/deleterange", &Value::object([("key", b64(key))]))?;
        Ok(int_field(&answer, "deleted")?.max(0) as u64)
    }

    /// Puts `value` under `key` only while the key's last change is `mod_revision`
    /// (0: only while the key does not exist). Returns whether it was written.
    pub fn put_if(&self, key: &[u8], mod_revision: i64, value: &[u8], lease: i64) -> Result<bool> {
        let compare = if mod_revision == 0 {
            Value::object([
                ("key", b64(key)),
                ("result", "EQUAL".into()),
                ("target", "CREATE".into()),
                ("create_revision", "0".into()),
            ])
        } else {
            Value::object([
                ("key", b64(key)),
                ("result", "EQUAL".into()),
                ("target", "MOD".into()),
                ("mod_revision", Value::from(mod_revision.to_string())),
            ])
        };
        let txn = Value::object([
            ("compare", Value::from(vec![compare])),
            (
                "success",
                Value::from(vec![Value::object([(
                    "request_put",
                    put_request(key, value, lease),
                )])]),
            ),
        ]);
        let answer = self.call("/v3/kv/txn", &txn)?;
        // proto3 JSON leaves out false booleans.
        Ok(answer
            .get("succeeded")
            .and_then(Value::as_bool)
            .unwrap_or(false))
    }

    /// Grants a lease of `ttl_s` seconds; returns its id.
    pub fn lease_grant(&self, ttl_s: i64) -> Result<i64> {
        let answer = self.call(
            "/v3/lease/grant",
            &Value::object([("TTL", Value::from(ttl_s.to_string()))]),
        )?;
        let id = int_field(&answer, "ID")?;
        if id == 0 {
            return Err(bad_answer("lease grant returned no ID".into()));
        }
        Ok(id)
    }

    /// Renews `lease`; returns the remaining TTL in seconds, 0 when the lease has
    /// already expired (its keys are gone).
    pub fn lease_keepalive(&self, lease: i64) -> Result<i64> {
        let answer = self.call(
            "/v3/lease/keepalive",
            &Value::object([("ID", Value::from(lease.to_string()))]),
        )?;
        // The gateway streams keep-alive answers: one `{"result": {...}}` here.
        let result = answer.get("result").unwrap_or(&answer);
        int_field(result, "TTL")
    }

    /// Revokes `lease`, removing every key attached to it.
    pub fn lease_revoke(&self, lease: i64) -> Result<()> {
        self.call(
            "/v3/lease/revoke",
            &Value::object([("ID", Value::from(lease.to_string()))]),
        )
        .map(drop)
    }
}

/// Largest watch message (or run of chunks without a line end) accepted.
const MAX_WATCH_CHUNK: usize = 1 << 20;

/// Reads a watch's messages (one JSON object per line, split across chunks as etcd
/// likes) until one reports events (true), or etcd cancels or ends the watch (false).
fn watch_messages(stream: &mut BodyStream) -> Result<bool> {
    let mut pending: Vec<u8> = Vec::new();
    while let Some(chunk) = stream.next_piece(MAX_WATCH_CHUNK - pending.len())? {
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let message: Vec<u8> = pending.drain(..=end).collect();
            let text = String::from_utf8_lossy(&message);
            let Ok(v) = json::parse(text.trim()) else {
                continue;
            };
            let Some(result) = v.get("result") else {
                continue;
            };
            if result.get("canceled").and_then(Value::as_bool) == Some(true) {
                return Ok(false);
            }
            if result
                .get("events")
                .and_then(Value::as_array)
                .is_some_and(|e| !e.is_empty())
            {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_below_ff() {
        assert_eq!(prefix_end(b"mooncake/"), b"mooncake0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn endpoints_parse_both_separators() {
        let c = EtcdClient::new("127.0.0.1:1;127.0.0.1:2, http://127.0.0.1:3").unwrap();
        assert_eq!(c.endpoints.len(), 3);
        assert!(EtcdClient::new(" ; ").is_err());
        assert!(EtcdClient::new("127.0.0.1:2379/v3").is_err());
    }

    #[test]
    fn int_fields_accept_strings_numbers_and_absence() {
        let v = json::parse(r#"{"a":"42","b":7,"c":"x"}"#).unwrap();
        assert_eq!(int_field(&v, "a").unwrap(), 42);
        assert_eq!(int_field(&v, "b").unwrap(), 7);
        assert_eq!(int_field(&v, "missing").unwrap(), 0);
        assert!(int_field(&v, "c").is_err());
    }
}
