//! Monotonic milliseconds for leases and timeouts; tests drive a manual clock instead
//! of sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The master's time source, in milliseconds since it started (never 0).
#[derive(Clone)]
pub enum Clock {
    /// Real monotonic time since this instant.
    System(Instant),
    /// Test time, moved by hand.
    Manual(Arc<AtomicU64>),
}

impl Clock {
    /// A clock following real monotonic time.
    pub fn system() -> Clock {
        Clock::System(Instant::now())
    }

    /// A clock that stands still until `advance` moves it.
    pub fn manual() -> Clock {
        Clock::Manual(Arc::new(AtomicU64::new(1)))
    }

    /// Milliseconds now.
    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::System(start) => start.elapsed().as_millis() as u64 + 1,
            Clock::Manual(ms) => ms.load(Ordering::SeqCst),
        }
    }

    /// Moves a manual clock forward; a system clock ignores this.
    pub fn advance(&self, ms: u64) {
        if let Clock::Manual(now) = self {
            now.fetch_add(ms, Ordering::SeqCst);
        }
    }
}
