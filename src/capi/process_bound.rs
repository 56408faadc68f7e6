//! What a C handle owns, tied to the process that made it.
//!
//! A forked child inherits every handle's memory but none of its threads, and shares its
//! sockets, mailboxes and mappings with the parent. Used there, a store would interleave
//! its requests with the parent's on one connection or wait forever for a worker that
//! does not exist; freed there, it would join threads that never come back and unmount
//! the parent's segment at the master. So in a child every borrow is refused with a
//! clear error, and freeing a handle leaks what it owns instead of tearing it down:
//! the parent keeps all of it. (Upstream's library has no such guard.)

use std::mem::ManuallyDrop;

use crate::error::{Code, Error, Result};
use mooncake_base::sys::fork_generation;

/// `T`, usable only in the process that made it.
pub(crate) struct ProcessBound<T> {
    value: ManuallyDrop<T>,
    generation: u64,
    pid: u32,
}

impl<T> ProcessBound<T> {
    pub(crate) fn new(value: T) -> Self {
        ProcessBound {
            value: ManuallyDrop::new(value),
            generation: fork_generation(),
            pid: std::process::id(),
        }
    }

    fn in_its_process(&self) -> bool {
        fork_generation() == self.generation
    }

    /// The value; `MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS` in a forked child.
    pub(crate) fn get(&self, what: &str) -> Result<&T> {
        if self.in_its_process() {
            return Ok(&self.value);
        }
        Err(Error::new(
            Code::UnavailableInCurrentStatus,
            format!(
                "this {what} was set up in process {} before it forked; its threads and \
                 connections stay with that process: set up a new {what} in this one \
                 (or start child processes with the 'spawn' method)",
                self.pid
            ),
        ))
    }
}

impl<T> Drop for ProcessBound<T> {
    fn drop(&mut self) {
        if self.in_its_process() {
            // SAFETY: dropped once, here; `value` is not used again.
            unsafe { ManuallyDrop::drop(&mut self.value) };
        } else {
            log::debug!(
                "a handle of process {} freed in a forked child: left to the parent",
                self.pid
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    static DROPPED: AtomicBool = AtomicBool::new(false);

    struct Noted;

    impl Drop for Noted {
        fn drop(&mut self) {
            DROPPED.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_forked_child_is_refused_the_value_and_never_drops_it() {
        let bound = ProcessBound::new(Noted);
        assert!(bound.get("thing").is_ok());
        // SAFETY: the child only reads memory, drops `bound` and leaves with _exit: no
        // lock another thread of this test process might hold is taken before that.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let refused = matches!(
                bound.get("thing"),
                Err(e) if e.code() == Code::UnavailableInCurrentStatus
            );
            drop(bound);
            let code = match (refused, DROPPED.load(Ordering::SeqCst)) {
                (true, false) => 0,
                (false, _) => 1,
                (true, true) => 2,
            };
            // SAFETY: ends the child without running the test harness's exit path.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status));
        match libc::WEXITSTATUS(status) {
            0 => {}
            1 => panic!("the child was given the value"),
            _ => panic!("the child dropped the parent's value"),
        }
        assert!(bound.get("thing").is_ok(), "the parent still has it");
        drop(bound);
        assert!(DROPPED.load(Ordering::SeqCst), "the parent drops it");
    }
}
