//! Locks taken whatever a panicking holder left behind. A thread that panicked while
//! holding a lock poisons it; this crate's locks guard state whose invariants hold
//! between statements (maps, queues, counters updated in one step), so the next
//! holder takes it as it is rather than panicking in turn, which across the C ABI
//! would abort the host process. One pair of traits, so the choice is made once.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

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
}
