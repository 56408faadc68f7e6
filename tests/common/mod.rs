//! Helpers shared by the integration tests.
#![allow(dead_code)]

use mooncake::{Engine, EngineConfig};

pub fn engine_with(metadata: &str, protocol: &str) -> Engine {
    let mut cfg = EngineConfig::default();
    cfg.set("metadata", metadata).unwrap();
    cfg.set("protocol", protocol).unwrap();
    Engine::new(cfg).expect("engine starts")
}

/// A deterministic byte pattern that differs per seed and offset.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A registered buffer that unregisters itself on drop.
pub struct Registered<'a> {
    pub engine: &'a Engine,
    pub buf: Vec<u8>,
}

impl<'a> Registered<'a> {
    pub fn new(engine: &'a Engine, buf: Vec<u8>) -> Registered<'a> {
        let mut r = Registered { engine, buf };
        // SAFETY: the Vec lives in `r` and is unregistered before it is dropped.
        unsafe { engine.register_memory(r.buf.as_mut_ptr(), r.buf.len(), "cpu:0") }.unwrap();
        r
    }

    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let _ = self.engine.unregister_memory(self.buf.as_mut_ptr());
    }
}
