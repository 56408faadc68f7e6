//! Log rate limiting: a peer that sends garbage in a loop must not fill the log. Each
//! call site gets a [`LogLimiter`] (the [`warn_limited!`](crate::warn_limited) macro
//! makes one per site): a few lines per interval pass, the rest are counted, and the
//! count is reported with the first line of a later interval.

use crate::util::sync::Unpoisoned;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines one call site may log per interval before it is muted.
pub const DEFAULT_BURST: u32 = 10;
/// Length of one rate-limiting interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

struct Window {
    start: Option<Instant>,
    used: u32,
    suppressed: u64,
}

/// Admits at most `burst` lines per `interval`.
pub struct LogLimiter {
    burst: u32,
    interval: Duration,
    window: Mutex<Window>,
}

impl LogLimiter {
    /// A limiter letting `burst` lines through per `interval`.
    pub const fn new(burst: u32, interval: Duration) -> LogLimiter {
        LogLimiter {
            burst,
            interval,
            window: Mutex::new(Window {
                start: None,
                used: 0,
                suppressed: 0,
            }),
        }
    }

    /// Whether a line may be logged now: `Some(k)` says yes, after reporting `k`
    /// lines suppressed since the last one logged; `None` says suppress it.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    /// As [`LogLimiter::admit`], at time `now`.
    pub fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut w = self.window.locked();
        let expired = w
            .start
            .is_none_or(|s| now.saturating_duration_since(s) >= self.interval);
        if expired {
            w.start = Some(now);
            w.used = 0;
        }
        if w.used >= self.burst {
            w.suppressed += 1;
            return None;
        }
        w.used += 1;
        Some(std::mem::take(&mut w.suppressed))
    }
}

/// `log::warn!`, at most [`DEFAULT_BURST`] lines per [`DEFAULT_INTERVAL`] from this
/// call site; what is held back is counted in a "suppressed" line that comes later.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => {{
        static LIMITER: $crate::util::ratelimit::LogLimiter = $crate::util::ratelimit::LogLimiter::new(
            $crate::util::ratelimit::DEFAULT_BURST,
            $crate::util::ratelimit::DEFAULT_INTERVAL,
        );
        if let Some(suppressed) = LIMITER.admit() {
            if suppressed > 0 {
                log::warn!("({suppressed} similar warnings suppressed)");
            }
            log::warn!($($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_lines_are_counted_until_the_next_interval() {
        let limiter = LogLimiter::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let passed: Vec<_> = (0..10).map(|_| limiter.admit_at(t0)).collect();
        assert_eq!(passed[..3], [Some(0), Some(0), Some(0)]);
        assert!(passed[3..].iter().all(Option::is_none));
        // Next interval: the first line carries the count of the seven held back.
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(limiter.admit_at(t1), Some(7));
        assert_eq!(limiter.admit_at(t1), Some(0));
    }

    #[test]
    fn the_macro_compiles_and_logs() {
        for i in 0..3 {
            crate::warn_limited!("line {i}");
        }
    }
}
