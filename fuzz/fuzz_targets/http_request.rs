//! HTTP/1.1 requests as the server reads them off a connection (keep-alive, several
//! requests back to back, `Content-Length` and chunked bodies, targets and queries).
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::http::fuzzing::parse_requests;
use mooncake::http::{percent_decode, percent_encode, MAX_REQUEST_BODY};

fuzz_target!(|data: &[u8]| {
    let (requests, _refusal) = parse_requests(data);
    let mut body_bytes = 0;
    for (req, _keep_alive) in &requests {
        assert!(req.body.len() <= MAX_REQUEST_BODY);
        body_bytes += req.body.len();
        assert!(
            req.path.starts_with('/') || req.path == "*",
            "{:?}",
            req.path
        );
        // A decoded path survives the encoder the client uses for it.
        assert_eq!(
            percent_decode(&percent_encode(&req.path)).as_deref(),
            Some(req.path.as_str())
        );
    }
    // Every body byte came from the input.
    assert!(body_bytes <= data.len());
});
