//! HTTP/1.1 responses as the client reads them: interim answers, status lines, and
//! bodies framed by length, chunks or the end of the stream. The first byte picks the
//! method the response answers (a HEAD answer has no body).
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::http::fuzzing::parse_response;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, bytes)) = data.split_first() else {
        return;
    };
    let method = if pick & 1 == 0 { "GET" } else { "HEAD" };
    if let Ok((status, body, _keep_alive)) = parse_response(bytes, method) {
        assert!((200..=599).contains(&status), "{status}");
        assert!(body.len() <= bytes.len());
        if method == "HEAD" {
            assert!(body.is_empty());
        }
    }
});
