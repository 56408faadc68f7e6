//! A lock-free Treiber stack of `u32` ids with a tagged head.
//!
//! The head is one `AtomicU64`: a 32-bit tag bumped by every successful CAS (so a
//! head that was popped and pushed back in between never compares equal: no ABA)
//! and the top's link value (`id + 1`, 0 for empty). Each id's `next` link lives in
//! a caller-owned `AtomicU32` that is never freed while the stack is in use, so a
//! popper that read a stale head may read a stale link but its CAS then fails.
//!
//! Block links double as the allocated flag: a block that is handed out has the
//! link [`ALLOCATED`], and a free claims it back with one CAS from that value, so
//! a double free is refused without touching the stack.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Link value meaning "no next id" (and an empty head).
pub(crate) const NIL: u32 = 0;
/// Link value of a block that is allocated (on no stack).
pub(crate) const ALLOCATED: u32 = u32::MAX;
/// The largest id a stack can hold (its link value must stay below [`ALLOCATED`]).
pub(crate) const MAX_ID: u32 = u32::MAX - 2;

/// The link value that points at `id`.
#[inline]
pub(crate) fn link_to(id: u32) -> u32 {
    debug_assert!(id <= MAX_ID);
    id + 1
}

#[inline]
fn pack(tag: u32, top: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(top)
}

#[inline]
fn tag(head: u64) -> u32 {
    (head >> 32) as u32
}

#[inline]
fn top(head: u64) -> u32 {
    head as u32
}

#[derive(Default)]
pub(crate) struct TaggedStack {
    head: AtomicU64,
}

impl TaggedStack {
    /// Pops the top id and returns it with its link cell. `link(id)` must return
    /// the cell of any id ever pushed here.
    #[inline]
    pub(crate) fn pop<'a>(
        &self,
        link: impl Fn(u32) -> &'a AtomicU32,
    ) -> Option<(u32, &'a AtomicU32)> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let first = top(head);
            if first == NIL {
                return None;
            }
            let cell = link(first - 1);
            let next = cell.load(Ordering::Relaxed);
            let new = pack(tag(head).wrapping_add(1), next);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    // The head did not move between reading the link and the CAS, so
                    // `next` is the link of a block that was on this stack.
                    debug_assert_ne!(next, ALLOCATED, "an allocated block was on a free list");
                    return Some((first - 1, cell));
                }
                Err(seen) => head = seen,
            }
        }
    }

    /// Pushes a chain already linked from `first` to the id whose cell is
    /// `last_cell` (that cell is overwritten): one CAS however long the chain.
    pub(crate) fn push_chain(&self, first: u32, last_cell: &AtomicU32) {
        debug_assert!(first <= MAX_ID, "block id {first} out of range");
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            last_cell.store(top(head), Ordering::Relaxed);
            let new = pack(tag(head).wrapping_add(1), link_to(first));
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(seen) => head = seen,
            }
        }
    }

    /// Pushes `id` if its cell holds [`ALLOCATED`]; returns false (changing
    /// nothing) if it does not, i.e. the id is already free.
    #[inline]
    pub(crate) fn push_allocated(&self, id: u32, cell: &AtomicU32) -> bool {
        debug_assert!(id <= MAX_ID, "block id {id} out of range");
        let mut head = self.head.load(Ordering::Relaxed);
        if cell
            .compare_exchange(ALLOCATED, top(head), Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        loop {
            let new = pack(tag(head).wrapping_add(1), link_to(id));
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(seen) => {
                    head = seen;
                    cell.store(top(head), Ordering::Relaxed);
                }
            }
        }
    }

    /// Empties the stack in one CAS and returns the old top's link value; the
    /// chain behind it is then private to the caller (walk it by links to NIL).
    pub(crate) fn take_all(&self) -> u32 {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            if top(head) == NIL {
                return NIL;
            }
            let new = pack(tag(head).wrapping_add(1), NIL);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return top(head),
                Err(seen) => head = seen,
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        top(self.head.load(Ordering::Acquire)) == NIL
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn cells(n: usize) -> Vec<AtomicU32> {
        (0..n).map(|_| AtomicU32::new(ALLOCATED)).collect()
    }

    #[test]
    fn lifo_order_and_double_push_refused() {
        let links = cells(4);
        let s = TaggedStack::default();
        assert!(s.pop(|i| &links[i as usize]).is_none());
        for id in 0..4 {
            assert!(s.push_allocated(id, &links[id as usize]));
        }
        assert!(!s.push_allocated(2, &links[2]), "already free");
        for want in (0..4).rev() {
            let (id, cell) = s.pop(|i| &links[i as usize]).unwrap();
            assert_eq!(id, want);
            cell.store(ALLOCATED, Ordering::Relaxed);
        }
        assert!(s.is_empty());
    }

    #[test]
    fn chains_push_in_one_step_and_take_all_empties() {
        let links = cells(5);
        for (i, cell) in links.iter().enumerate().take(4) {
            cell.store(link_to(i as u32 + 1), Ordering::Relaxed);
        }
        let s = TaggedStack::default();
        s.push_chain(0, &links[4]);
        let mut walked = Vec::new();
        let mut at = s.take_all();
        while at != NIL {
            walked.push(at - 1);
            at = links[(at - 1) as usize].load(Ordering::Relaxed);
        }
        assert_eq!(walked, [0, 1, 2, 3, 4]);
        assert!(s.is_empty());
    }

    #[test]
    fn concurrent_pop_push_keeps_every_id_exactly_once() {
        const N: u32 = 64;
        let links = cells(N as usize);
        let s = TaggedStack::default();
        for id in 0..N {
            assert!(s.push_allocated(id, &links[id as usize]));
        }
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..20_000 {
                        if let Some((id, cell)) = s.pop(|i| &links[i as usize]) {
                            cell.store(ALLOCATED, Ordering::Relaxed);
                            assert!(s.push_allocated(id, cell));
                        }
                    }
                });
            }
        });
        let mut seen = vec![false; N as usize];
        while let Some((id, _)) = s.pop(|i| &links[i as usize]) {
            assert!(
                !std::mem::replace(&mut seen[id as usize], true),
                "id {id} twice"
            );
        }
        assert!(seen.iter().all(|&b| b));
    }
}
