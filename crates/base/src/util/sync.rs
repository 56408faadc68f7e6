//! Locks taken whatever a panicking holder left behind. A thread that panicked while
//! holding a lock poisons it; this crate's locks guard state whose invariants hold
//! between statements (maps, queues, counters updated in one step), so the next
//! holder takes it as it is rather than panicking in turn, which across the C ABI
//! would abort the host process. One pair of traits, so the choice is made once.
//!
//! And the one stop signal threads sleep on between rounds of work ([`StopSignal`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// `Mutex::lock`, ignoring poison (see the module).
pub trait Unpoisoned<T: ?Sized> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> Unpoisoned<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `RwLock::read` and `write`, ignoring poison (see the module).
pub trait UnpoisonedRw<T: ?Sized> {
    /// A read guard, poisoned or not.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// A write guard, poisoned or not.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> UnpoisonedRw<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// A stop request that wakes its waiters at once: a background thread sleeps on it
/// between rounds (`while !stop.wait(period) { ... }`) and its owner raises it to end
/// the thread without waiting out the period.
#[derive(Debug, Default)]
pub struct StopSignal {
    raised: Mutex<bool>,
    cv: Condvar,
}

impl StopSignal {
    /// A signal not yet raised, shared.
    pub fn new() -> Arc<StopSignal> {
        Arc::new(StopSignal::default())
    }

    /// Raises it; every waiter returns.
    pub fn raise(&self) {
        *self.raised.locked() = true;
        self.cv.notify_all();
    }

    /// Whether it was raised.
    pub fn is_raised(&self) -> bool {
        *self.raised.locked()
    }

    /// Waits up to `d`; true if raised (at once when it already was).
    pub fn wait(&self, d: Duration) -> bool {
        let guard = self.raised.locked();
        let (guard, _) = self
            .cv
            .wait_timeout_while(guard, d, |raised| !*raised)
            .unwrap_or_else(|e| e.into_inner());
        *guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panicking_holder_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let rw = std::sync::Arc::new(RwLock::new(1));
        let (m2, rw2) = (m.clone(), rw.clone());
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            let _w = rw2.write().unwrap();
            panic!("poison both");
        })
        .join();
        assert!(m.is_poisoned() && rw.is_poisoned());
        *m.locked() += 1;
        *rw.write_locked() += 1;
        assert_eq!((*m.locked(), *rw.read_locked()), (2, 2));
    }

    #[test]
    fn a_raised_stop_signal_wakes_a_waiter_at_once_and_stays_raised() {
        let stop = StopSignal::new();
        assert!(
            !stop.wait(Duration::from_millis(1)),
            "not raised: times out"
        );
        let waiter = {
            let stop = stop.clone();
            std::thread::spawn(move || stop.wait(Duration::from_secs(3600)))
        };
        stop.raise();
        assert!(waiter.join().unwrap(), "woken by the raise, not the hour");
        assert!(stop.is_raised() && stop.wait(Duration::from_secs(3600)));
    }
}
