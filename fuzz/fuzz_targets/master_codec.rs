//! The master RPC codec: a method number (2 bytes) and a payload decoded as a request
//! and as a response. The encoding is canonical, so what decodes re-encodes to the very
//! same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::store::codec::Writer;
use mooncake::store::protocol::{Request, Response};

fuzz_target!(|data: &[u8]| {
    let Some((method, payload)) = data.split_first_chunk::<2>() else {
        return;
    };
    let method = u16::from_le_bytes(*method);
    if let Ok(req) = Request::decode(method, payload) {
        assert_eq!(req.method(), method);
        let mut w = Writer::new();
        req.encode(&mut w);
        assert_eq!(w.into_bytes(), payload, "request {req:?}");
    }
    if let Ok(resp) = Response::decode(method, payload) {
        let mut w = Writer::new();
        resp.encode(&mut w);
        let bytes = w.into_bytes();
        assert_eq!(Response::decode(method, &bytes).ok(), Some(resp.clone()));
        assert_eq!(bytes, payload, "response {resp:?}");
    }
});
