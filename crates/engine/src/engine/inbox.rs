//! Received notifications, bounded in bytes as well as count: a peer can fill its own
//! share of the inbox, never the engine's memory. What does not fit is dropped and
//! counted.

use crate::util::sync::Unpoisoned;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A message another engine sent us with `notify`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name.
    pub from: String,
    /// The message text.
    pub message: String,
}

impl Notification {
    fn bytes(&self) -> usize {
        self.from.len() + self.message.len()
    }
}

/// Limits of an [`Inbox`].
#[derive(Clone, Copy, Debug)]
pub struct InboxLimits {
    /// Largest notification (sender name plus message) accepted.
    pub max_message: usize,
    /// Bytes queued from one sender name at most.
    pub max_per_sender: usize,
    /// Bytes and notifications queued in all.
    pub max_total: usize,
    /// Notifications queued in all.
    pub max_count: usize,
}

impl Default for InboxLimits {
    fn default() -> Self {
        InboxLimits {
            max_message: 64 << 10,
            max_per_sender: 4 << 20,
            max_total: 64 << 20,
            max_count: 65536,
        }
    }
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Notification>,
    bytes: usize,
    by_sender: HashMap<String, usize>,
}

impl Queue {
    fn pop_front(&mut self) -> Option<Notification> {
        let n = self.items.pop_front()?;
        self.bytes -= n.bytes();
        if let Some(b) = self.by_sender.get_mut(&n.from) {
            *b -= n.bytes();
            if *b == 0 {
                self.by_sender.remove(&n.from);
            }
        }
        Some(n)
    }
}

/// Bounded queue of notifications received from peers.
#[derive(Default)]
pub struct Inbox {
    limits: InboxLimits,
    queue: Mutex<Queue>,
    dropped: AtomicU64,
}

impl Inbox {
    /// An empty inbox that enforces `limits`.
    pub fn new(limits: InboxLimits) -> Inbox {
        Inbox {
            limits,
            ..Inbox::default()
        }
    }

    /// Queues `n`, or drops it (counted) when it is too large or its sender's share or
    /// the inbox is full; whether it was queued.
    pub fn push(&self, n: Notification) -> bool {
        let size = n.bytes();
        let l = &self.limits;
        let mut q = self.queue.locked();
        let senders = q.by_sender.get(&n.from).copied().unwrap_or(0);
        let fits = size <= l.max_message
            && senders + size <= l.max_per_sender
            && q.bytes + size <= l.max_total
            && q.items.len() < l.max_count;
        if !fits {
            drop(q);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            log::debug!(
                "notification of {size} bytes from {:.64} dropped (inbox limits)",
                n.from
            );
            return false;
        }
        q.bytes += size;
        *q.by_sender.entry(n.from.clone()).or_default() += size;
        q.items.push_back(n);
        true
    }

    /// Takes every queued notification.
    pub fn take_all(&self) -> Vec<Notification> {
        let mut q = self.queue.locked();
        std::iter::from_fn(|| q.pop_front()).collect()
    }

    /// Shows the oldest notification to `f` and removes it only if `f` returns `Ok`
    /// (atomically). `None` when none is queued.
    pub fn take_with<T, E>(
        &self,
        f: impl FnOnce(&Notification) -> Result<T, E>,
    ) -> Option<Result<T, E>> {
        let mut q = self.queue.locked();
        let result = f(q.items.front()?);
        if result.is_ok() {
            q.pop_front();
        }
        Some(result)
    }

    /// Notifications dropped by the limits since the engine started.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(from: &str, len: usize) -> Notification {
        Notification {
            from: from.into(),
            message: "m".repeat(len),
        }
    }

    #[test]
    fn limits_bound_bytes_per_message_sender_and_total() {
        let inbox = Inbox::new(InboxLimits {
            max_message: 100,
            max_per_sender: 250,
            max_total: 400,
            max_count: 10,
        });
        assert!(!inbox.push(note("a", 200)), "over the message limit");
        assert!(inbox.push(note("a", 99)));
        assert!(inbox.push(note("a", 99)));
        assert!(!inbox.push(note("a", 99)), "over a's share");
        assert!(inbox.push(note("b", 99)));
        assert!(inbox.push(note("c", 99)));
        assert!(!inbox.push(note("d", 99)), "over the total");
        assert_eq!(inbox.dropped(), 3);
        // Taking frees the room, per sender too.
        let first = inbox.take_with(|n| Ok::<_, ()>(n.from.clone())).unwrap();
        assert_eq!(first, Ok("a".to_owned()));
        assert!(inbox.push(note("a", 99)));
        assert_eq!(inbox.take_all().len(), 4);
        assert!(inbox.take_with(|_| Ok::<_, ()>(())).is_none());
        assert!(inbox.push(note("d", 99)));
    }

    #[test]
    fn a_refused_take_keeps_the_notification() {
        let inbox = Inbox::default();
        assert!(inbox.push(note("a", 5)));
        assert_eq!(
            inbox.take_with(|_| Err::<(), _>("small buffer")),
            Some(Err("small buffer"))
        );
        assert_eq!(inbox.take_all(), vec![note("a", 5)]);
    }

    #[test]
    fn count_limit_holds() {
        let inbox = Inbox::new(InboxLimits {
            max_count: 2,
            ..InboxLimits::default()
        });
        assert!(inbox.push(note("a", 1)));
        assert!(inbox.push(note("a", 1)));
        assert!(!inbox.push(note("a", 1)));
    }
}
