//! HTTP metadata server and client: REST semantics, encoding, robustness against
//! malformed input, keep-alive, concurrency and shutdown.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use mooncake::http::{HttpClient, HttpServer, Request, Response};
use mooncake::metadata::http_client::HttpMetadataStore;
use mooncake::metadata::http_server::MetadataServer;
use mooncake::metadata::MetadataStore;
use mooncake::Code;

/// Safety net so a broken server fails a test instead of hanging it; never a
/// timing assertion.
const SAFETY_TIMEOUT: Duration = Duration::from_secs(20);

fn start() -> MetadataServer {
    MetadataServer::start("127.0.0.1:0".parse().unwrap()).expect("start metadata server")
}

fn store(server: &MetadataServer) -> HttpMetadataStore {
    HttpMetadataStore::new(&server.url()).expect("store")
}

fn raw_connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(SAFETY_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(SAFETY_TIMEOUT)).unwrap();
    s
}

/// Sends `bytes` on a fresh connection and reads until the server closes it.
/// Returns the status of the first response (None if nothing came back) and all
/// bytes received. Write/read errors (e.g. a reset) count as "closed".
fn raw_exchange(addr: SocketAddr, bytes: &[u8], half_close: bool) -> (Option<u16>, Vec<u8>) {
    let mut s = raw_connect(addr);
    let _ = s.write_all(bytes);
    if half_close {
        let _ = s.shutdown(Shutdown::Write);
    }
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    (status_of(&got), got)
}

fn status_of(resp: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(resp.get(..12)?).ok()?;
    text.strip_prefix("HTTP/1.1 ")?.parse().ok()
}

/// Reads exactly one Content-Length-delimited response from `s`.
fn read_one_response(s: &mut TcpStream) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).unwrap(), 1, "connection closed mid-head");
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap();
    let mut lines = head.split("\r\n");
    let status = status_of(lines.next().unwrap().as_bytes()).unwrap();
    let headers: Vec<(String, String)> = lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.to_ascii_lowercase(), v.trim().to_owned())
        })
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.parse().unwrap())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    (status, headers, body)
}

fn assert_still_serving(server: &MetadataServer) {
    let st = store(server);
    st.put("probe", "{\"alive\":true}").unwrap();
    assert_eq!(
        st.get("probe").unwrap().as_deref(),
        Some("{\"alive\":true}")
    );
}

#[test]
fn put_get_delete_round_trip() {
    let mut server = start();
    assert!(server.url().starts_with("http://127.0.0.1:"));
    assert!(server.url().ends_with("/metadata"));
    let st = store(&server);
    let seg = r#"{"name":"n1","protocol":"tcp","tcp_data_port":12345,"buffers":[]}"#;
    st.put("mooncake/ram/n1", seg).unwrap();
    assert_eq!(st.get("mooncake/ram/n1").unwrap().as_deref(), Some(seg));
    assert_eq!(server.len(), 1);
    st.put("mooncake/ram/n1", "{}").unwrap(); // non-rpc_meta overwrite
    assert_eq!(st.get("mooncake/ram/n1").unwrap().as_deref(), Some("{}"));
    st.remove("mooncake/ram/n1").unwrap();
    assert_eq!(st.get("mooncake/ram/n1").unwrap(), None);
    st.remove("mooncake/ram/n1").unwrap(); // absent: still Ok
    assert!(server.is_empty());
    server.shutdown();
    server.shutdown(); // idempotent
}

#[test]
fn absent_key_is_none() {
    let server = start();
    let st = store(&server);
    assert_eq!(st.get("mooncake/ram/nobody").unwrap(), None);
    let client = HttpClient::new(&server.url()).unwrap();
    let (status, body) = client.request("GET", "/metadata?key=nope", b"").unwrap();
    assert_eq!((status, body.as_slice()), (404, &b"metadata not found"[..]));
    let (status, _) = client.request("DELETE", "/metadata?key=nope", b"").unwrap();
    assert_eq!(status, 404);
}

#[test]
fn rpc_meta_clash_is_refused() {
    let server = start();
    let st = store(&server);
    let key = "mooncake/rpc_meta/node-a";
    let v1 = r#"{"ip_or_host_name": "127.0.0.1", "rpc_port": 15123}"#;
    let v2 = r#"{"ip_or_host_name": "127.0.0.1", "rpc_port": 15124}"#;
    st.put(key, v1).unwrap();
    st.put(key, v1).unwrap(); // same body: fine
    let err = st.put(key, v2).unwrap_err();
    assert_eq!(err.code(), Code::Metadata);
    assert!(
        err.context().contains("different value"),
        "context should carry the server's explanation: {}",
        err.context()
    );
    assert_eq!(st.get(key).unwrap().as_deref(), Some(v1));
    // After removal the name is free again.
    st.remove(key).unwrap();
    st.put(key, v2).unwrap();
    assert_eq!(st.get(key).unwrap().as_deref(), Some(v2));
    // Keys without rpc_meta can be overwritten freely.
    st.put("mooncake/ram/x", v1).unwrap();
    st.put("mooncake/ram/x", v2).unwrap();
    assert_eq!(st.get("mooncake/ram/x").unwrap().as_deref(), Some(v2));
}

#[test]
fn rest_status_codes() {
    let server = start();
    let c = HttpClient::new(&server.url()).unwrap();
    assert_eq!(c.base_path(), "/metadata");
    let status = |m: &str, p: &str, b: &[u8]| c.request(m, p, b).unwrap().0;
    assert_eq!(status("GET", "/metadata", b""), 400);
    assert_eq!(status("PUT", "/metadata", b"{}"), 400);
    assert_eq!(status("DELETE", "/metadata?other=1", b""), 400);
    assert_eq!(status("GET", "/metadata?key=", b""), 400);
    assert_eq!(status("PATCH", "/metadata?key=a", b"{}"), 405);
    assert_eq!(status("GET", "/elsewhere?key=a", b""), 404);
    assert_eq!(status("PUT", "/metadata?key=bin", &[0xff, 0xfe]), 400);
    let (s, body) = c.request("GET", "/health", b"").unwrap();
    assert_eq!((s, body.as_slice()), (200, &b"OK"[..]));
    let (s, body) = c.request("HEAD", "/health", b"").unwrap();
    assert_eq!((s, body.len()), (200, 0));
    // POST works like PUT; the stored body comes back as JSON.
    let (s, body) = c.request("POST", "/metadata?key=p", b"[1,2]").unwrap();
    assert_eq!((s, body.as_slice()), (200, &b"metadata updated"[..]));
    let (s, body) = c.request("GET", "/metadata?key=p", b"").unwrap();
    assert_eq!((s, body.as_slice()), (200, &b"[1,2]"[..]));
    // '+' in a query means space.
    assert_eq!(status("PUT", "/metadata?key=a+b", b"1"), 200);
    assert_eq!(store(&server).get("a b").unwrap().as_deref(), Some("1"));
}

#[test]
fn url_handling() {
    assert!(HttpClient::new("https://127.0.0.1:1/metadata").is_err());
    let err = HttpMetadataStore::new("redis://127.0.0.1:1").unwrap_err();
    assert_eq!(err.code(), Code::Metadata);
    // No path: the REST base defaults to /metadata.
    let server = start();
    let url = format!("http://{}", server.local_addr());
    let st = HttpMetadataStore::new(&url).unwrap();
    st.put("k", "v").unwrap();
    assert_eq!(store(&server).get("k").unwrap().as_deref(), Some("v"));
}

#[test]
fn special_character_keys_round_trip() {
    let server = start();
    let st = store(&server);
    let keys = [
        "mooncake/ram/127.0.0.1:1234",
        "cluster 1/mooncake/rpc_meta/a b",
        "a&b=c&key=d",
        "100% + 50%",
        "?#[]@!$'()*,;",
        "ünïcødé/日本語/✓",
        "tab\there",
    ];
    for (i, k) in keys.iter().enumerate() {
        st.put(k, &format!("{{\"i\":{i},\"s\":\"é\"}}")).unwrap();
    }
    assert_eq!(server.len(), keys.len());
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            st.get(k).unwrap(),
            Some(format!("{{\"i\":{i},\"s\":\"é\"}}")),
            "key {k:?}"
        );
    }
    for k in keys {
        st.remove(k).unwrap();
        assert_eq!(st.get(k).unwrap(), None);
    }
    assert!(server.is_empty());
}

#[test]
fn malformed_requests_are_rejected_and_server_survives() {
    let server = start();
    let addr = server.local_addr();

    let (status, _) = raw_exchange(addr, b"HELLO THERE\r\n\r\n", false);
    assert_eq!(status, Some(400));
    let (status, _) = raw_exchange(addr, b"\x00\x01\x02 garbage\r\n\r\n", false);
    assert_eq!(status, Some(400));
    let (status, _) = raw_exchange(
        addr,
        b"GET /health HTTP/1.1\r\nNo colon here\r\n\r\n",
        false,
    );
    assert_eq!(status, Some(400));
    let (status, _) = raw_exchange(addr, b"GET /health HTTP/9.9\r\n\r\n", false);
    assert_eq!(status, Some(505));
    let (status, _) = raw_exchange(
        addr,
        b"PUT /metadata?key=a HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        false,
    );
    assert_eq!(status, Some(400));

    // Oversized head (> 16 KiB).
    let mut big = b"GET /health HTTP/1.1\r\nX-Big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 20 * 1024));
    big.extend_from_slice(b"\r\n\r\n");
    let (status, _) = raw_exchange(addr, &big, false);
    assert!(
        matches!(status, Some(431) | None),
        "oversized head: {status:?}"
    );

    // Head that never ends, beyond the limit.
    let endless = vec![b'x'; 32 * 1024];
    let (status, _) = raw_exchange(addr, &endless, false);
    assert!(matches!(status, Some(431) | Some(400) | None), "{status:?}");

    // Content-Length beyond the 16 MiB body limit.
    let (status, _) = raw_exchange(
        addr,
        b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: 17000000\r\n\r\nsome",
        false,
    );
    assert!(matches!(status, Some(413) | None), "{status:?}");

    // Chunked body beyond the limit also stops early.
    let mut chunked =
        b"PUT /metadata?key=a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    chunked.extend_from_slice(b"2000000\r\n"); // 32 MiB chunk
    let (status, _) = raw_exchange(addr, &chunked, false);
    assert!(matches!(status, Some(413) | None), "{status:?}");

    // Truncated body, then the client closes: no response, no crash.
    let (status, got) = raw_exchange(
        addr,
        b"PUT /metadata?key=trunc HTTP/1.1\r\nContent-Length: 100\r\n\r\n0123456789",
        true,
    );
    assert_eq!((status, got.len()), (None, 0));
    assert_eq!(store(&server).get("trunc").unwrap(), None);

    // Half a head, then close.
    let (status, _) = raw_exchange(addr, b"GET /metad", true);
    assert_eq!(status, None);

    assert_still_serving(&server);
}

#[test]
fn keep_alive_and_pipelining() {
    let server = start();
    let mut s = raw_connect(server.local_addr());
    s.write_all(b"PUT /metadata?key=ka HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n{\"a\":1}")
        .unwrap();
    let (status, headers, body) = read_one_response(&mut s);
    assert_eq!((status, body.as_slice()), (200, &b"metadata updated"[..]));
    assert!(headers.contains(&("connection".into(), "keep-alive".into())));
    s.write_all(b"GET /metadata?key=ka HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (status, headers, body) = read_one_response(&mut s);
    assert_eq!((status, body.as_slice()), (200, &b"{\"a\":1}"[..]));
    assert!(headers.contains(&("content-type".into(), "application/json".into())));

    // Two pipelined requests in one write, the last asking to close.
    s.write_all(
        b"GET /health HTTP/1.1\r\n\r\nGET /metadata?key=ka HTTP/1.1\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let (status, _, body) = read_one_response(&mut s);
    assert_eq!((status, body.as_slice()), (200, &b"OK"[..]));
    let (status, headers, body) = read_one_response(&mut s);
    assert_eq!((status, body.as_slice()), (200, &b"{\"a\":1}"[..]));
    assert!(headers.contains(&("connection".into(), "close".into())));
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty());

    // HTTP/1.0 without keep-alive closes after one response.
    let (status, got) = raw_exchange(server.local_addr(), b"GET /health HTTP/1.0\r\n\r\n", false);
    assert_eq!(status, Some(200));
    assert!(got.ends_with(b"\r\n\r\nOK"));
}

#[test]
fn chunked_and_expect_continue_request_bodies() {
    let server = start();
    let mut s = raw_connect(server.local_addr());
    s.write_all(
        b"PUT /metadata?key=chunky HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
          3\r\n{\"a\r\n5;ext\r\n\":42}\r\n0\r\n\r\n",
    )
    .unwrap();
    assert_eq!(read_one_response(&mut s).0, 200);
    assert_eq!(
        store(&server).get("chunky").unwrap().as_deref(),
        Some("{\"a\":42}")
    );

    s.write_all(
        b"PUT /metadata?key=exp HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
    )
    .unwrap();
    let mut interim = [0u8; 25];
    s.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(b"{}").unwrap();
    assert_eq!(read_one_response(&mut s).0, 200);
    assert_eq!(store(&server).get("exp").unwrap().as_deref(), Some("{}"));
}

#[test]
fn many_concurrent_clients() {
    let server = start();
    let url = server.url();
    let shared = Arc::new(HttpMetadataStore::new(&url).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let url = url.clone();
            let shared = shared.clone();
            thread::spawn(move || {
                let own = HttpMetadataStore::new(&url).unwrap();
                for i in 0..50 {
                    let st: &HttpMetadataStore = if i % 2 == 0 { &own } else { &shared };
                    let key = format!("mooncake/ram/t{t}/k{i}");
                    let val = format!("{{\"t\":{t},\"i\":{i}}}");
                    st.put(&key, &val).unwrap();
                    assert_eq!(st.get(&key).unwrap().as_deref(), Some(val.as_str()));
                    if i % 5 == 0 {
                        st.remove(&key).unwrap();
                        assert_eq!(st.get(&key).unwrap(), None);
                    }
                    // Everyone races on the same rpc_meta name with its own value:
                    // exactly one value wins and re-putting it stays accepted.
                    let rpc = format!("{{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":{t}}}");
                    match st.put("mooncake/rpc_meta/contended", &rpc) {
                        Ok(()) => {}
                        Err(e) => assert_eq!(e.code(), Code::Metadata),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // 8 threads x 50 keys, 10 per thread removed, plus the contended key.
    assert_eq!(server.len(), 8 * 40 + 1);
    let st = store(&server);
    let winner = st.get("mooncake/rpc_meta/contended").unwrap().unwrap();
    st.put("mooncake/rpc_meta/contended", &winner).unwrap();
    assert_eq!(
        st.get("mooncake/ram/t3/k7").unwrap().as_deref(),
        Some("{\"t\":3,\"i\":7}")
    );
    assert_eq!(st.get("mooncake/ram/t3/k10").unwrap(), None);
}

#[test]
fn shutdown_with_open_connections_completes() {
    let mut server = start();
    let st = store(&server);
    st.put("k", "v").unwrap(); // the store now holds a keep-alive connection
                               // An idle raw connection and one stuck in the middle of a body.
    let mut idle = raw_connect(server.local_addr());
    let mut stuck = raw_connect(server.local_addr());
    stuck
        .write_all(b"PUT /metadata?key=s HTTP/1.1\r\nContent-Length: 100\r\n\r\nabc")
        .unwrap();
    // Make sure the server has accepted the idle connection before shutting down.
    idle.write_all(b"GET /health HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(read_one_response(&mut idle).0, 200);

    server.shutdown(); // must not hang on the open connections

    let mut buf = [0u8; 16];
    assert!(matches!(idle.read(&mut buf), Ok(0) | Err(_)));
    assert!(matches!(stuck.read(&mut buf), Ok(0) | Err(_)));
    let err = st.get("k").unwrap_err();
    assert_eq!(err.code(), Code::Metadata);
    assert!(
        err.context().contains("metadata server"),
        "{}",
        err.context()
    );
    assert!(st.put("k", "w").is_err());
    drop(server); // Drop after shutdown is a no-op
}

#[test]
fn unreachable_server_is_a_metadata_error() {
    // Bind then drop a listener to get a port that nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let st = HttpMetadataStore::new(&format!("http://127.0.0.1:{port}/metadata")).unwrap();
    let err = st.get("k").unwrap_err();
    assert_eq!(err.code(), Code::Metadata);
    assert!(err.context().contains(&format!("127.0.0.1:{port}")));
}

#[test]
fn generic_server_handler_and_panics() {
    let handler = Arc::new(|req: &Request| -> Response {
        if req.path == "/panic" {
            panic!("handler panic (expected in this test)");
        }
        Response::json(
            201,
            format!(
                "{{\"method\":\"{}\",\"path\":\"{}\",\"q\":\"{}\",\"h\":\"{}\",\"len\":{}}}",
                req.method,
                req.path,
                req.query_param("q").unwrap_or("-"),
                req.header("x-TEST").unwrap_or("-"),
                req.body.len()
            ),
        )
    });
    let mut server = HttpServer::bind("127.0.0.1:0".parse().unwrap(), handler).unwrap();
    let c = HttpClient::new(&format!("http://{}/", server.local_addr())).unwrap();
    assert_eq!(c.base_path(), "");
    let (s, body) = c.request("POST", "/a%20b?q=x%26y", b"12345").unwrap();
    assert_eq!(s, 201);
    assert_eq!(
        String::from_utf8(body).unwrap(),
        r#"{"method":"POST","path":"/a b","q":"x&y","h":"-","len":5}"#
    );
    let (s, _) = c.request("GET", "/panic", b"").unwrap();
    assert_eq!(s, 500);
    let mut raw = raw_connect(server.local_addr());
    raw.write_all(b"GET /h HTTP/1.1\r\nX-Test: yes\r\n\r\n")
        .unwrap();
    let (s, _, body) = read_one_response(&mut raw);
    assert_eq!(s, 201);
    assert!(String::from_utf8(body).unwrap().contains("\"h\":\"yes\""));
    server.shutdown();
}

/// A hand-written peer exercising the client's response parsing: chunked bodies,
/// read-to-EOF bodies, interim 100 responses and servers that silently drop
/// keep-alive connections (the client must reconnect once).
#[test]
fn client_response_framing_and_reconnect() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = thread::spawn(move || {
        let responses: [&[u8]; 4] = [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=y\r\n world\r\n0\r\nTrailer: 1\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 202 Accepted\r\nContent-Length: 3\r\n\r\nabc",
            b"HTTP/1.0 200 OK\r\n\r\nuntil the end",
            b"HTTP/1.1 204 No Content\r\n\r\n",
        ];
        for resp in responses {
            // Each connection: read one request head, answer, close without saying so.
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(SAFETY_TIMEOUT)).unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if s.read(&mut b).unwrap() == 0 {
                    break;
                }
                head.push(b[0]);
            }
            s.write_all(resp).unwrap();
        }
    });
    let c = HttpClient::new(&format!("http://{addr}")).unwrap();
    let (s, body) = c.request("GET", "/one", b"").unwrap();
    assert_eq!((s, body.as_slice()), (200, &b"hello world"[..]));
    // The peer closed the keep-alive connection: the client reconnects by itself.
    let (s, body) = c.request("GET", "/two", b"").unwrap();
    assert_eq!((s, body.as_slice()), (202, &b"abc"[..]));
    let (s, body) = c.request("GET", "/three", b"").unwrap();
    assert_eq!((s, body.as_slice()), (200, &b"until the end"[..]));
    let (s, body) = c.request("DELETE", "/four", b"").unwrap();
    assert_eq!((s, body.len()), (204, 0));
    peer.join().unwrap();
    // Nobody listens any more: an error, not a hang.
    assert!(c.request("GET", "/five", b"").is_err());
}

/// A server that died without unpublishing leaves its `rpc_meta` record behind: its
/// successor under the same name replaces it once nothing listens at the recorded
/// port, but never takes the name from an owner that still listens.
#[test]
fn a_dead_owners_record_is_replaced_and_a_live_owners_kept() {
    use mooncake::metadata::{Directory, RpcMeta, SegmentDesc};
    let server = start();
    let dir = Directory::over(Arc::new(store(&server)), "");
    let desc = SegmentDesc::new("127.0.0.1:7001");
    let meta = |port| RpcMeta {
        ip_or_host_name: "127.0.0.1".into(),
        rpc_port: port,
    };
    // The previous owner's port: bound, then released (nothing listens there).
    let dead_port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    dir.publish(&desc, &meta(dead_port)).unwrap();
    let ours = meta(dead_port.wrapping_add(1).max(1));
    dir.publish(&desc, &ours).unwrap();
    let st = store(&server);
    let held = st.get("mooncake/rpc_meta/127.0.0.1:7001").unwrap().unwrap();
    assert_eq!(
        RpcMeta::parse(&held).unwrap(),
        ours,
        "the dead owner's record was replaced"
    );

    // An owner that still listens keeps the name.
    let live = TcpListener::bind("127.0.0.1:0").unwrap();
    let desc = SegmentDesc::new("127.0.0.1:7002");
    dir.publish(&desc, &meta(live.local_addr().unwrap().port()))
        .unwrap();
    let err = dir.publish(&desc, &ours).unwrap_err();
    assert_eq!(err.code(), Code::Metadata, "{err}");
    let held = st.get("mooncake/rpc_meta/127.0.0.1:7002").unwrap().unwrap();
    assert_eq!(
        RpcMeta::parse(&held).unwrap().rpc_port,
        live.local_addr().unwrap().port()
    );
}
