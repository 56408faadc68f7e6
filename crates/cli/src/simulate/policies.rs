//! FIFO, LRU and Belady-optimal caches of whole prefix blocks, with the
//! `kvcache-simulator` package's semantics (its Python and C++ backends agree on them):
//!
//! * **hits**: a request's hit tokens are those of its longest cached prefix; a cached
//!   block after a missing one does not count;
//! * **FIFO** caches blocks (tree nodes) in insertion order, regardless of the prefix
//!   tree: a hit does not refresh a block; each missing block of a request is inserted,
//!   evicting the oldest block first when full;
//! * **LRU** and **optimal** keep the cached set a rooted subtree: only leaves are
//!   evicted, and a block is inserted only when its parent is cached (else the rest of
//!   the request is not inserted). The blocks of the current request cached before its
//!   inserts are protected. LRU evicts the leaf touched longest ago (prefix hits and
//!   inserts touch); optimal evicts the leaf whose next use is furthest, and inserts a
//!   block only when that victim is needed later than the block itself (else it stops
//!   inserting for this request). Ties go to the higher node number;
//! * the **ceiling** is an unbounded cache.
//!
//! A capacity is "underfilled" (the package leaves it out of its table) when the cache
//! never filled up during the first half of the requests.

use std::collections::{BinaryHeap, VecDeque};

use super::plan::Plan;

/// A policy the simulator runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// First in, first out.
    Fifo,
    /// Least recently used leaf.
    Lru,
    /// Belady: the leaf whose next use is furthest.
    Optimal,
    /// The real master (allocator, eviction, leases) under a manual clock.
    Store,
}

impl Policy {
    /// All policies, in display order.
    pub const ALL: [Policy; 4] = [Policy::Fifo, Policy::Lru, Policy::Optimal, Policy::Store];

    /// Its command-line and report name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Fifo => "fifo",
            Policy::Lru => "lru",
            Policy::Optimal => "optimal",
            Policy::Store => "store",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// Hit and input tokens, over all requests and over the measured last half.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Hit tokens, all requests.
    pub hit: u64,
    /// Input tokens, all requests.
    pub total: u64,
    /// Hit tokens, last half.
    pub hit_last_half: u64,
    /// Input tokens, last half.
    pub total_last_half: u64,
    /// The cache was full before the last half began.
    pub filled: bool,
}

impl Tally {
    /// Counts request `r` of `plan` with its first `k` blocks hit.
    pub fn add(&mut self, plan: &Plan, r: usize, k: usize) {
        let hit = plan.prefix_tokens(r, k);
        let total = plan.prefix_tokens(r, plan.range(r).len());
        self.hit += hit;
        self.total += total;
        if r >= plan.warmup {
            self.hit_last_half += hit;
            self.total_last_half += total;
        }
    }

    /// Hit rate over all requests.
    pub fn rate(&self) -> f64 {
        ratio(self.hit, self.total)
    }

    /// Hit rate over the last half of the requests (the package's figure).
    pub fn rate_last_half(&self) -> f64 {
        ratio(self.hit_last_half, self.total_last_half)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Runs `policy` (not `Store`) with room for `capacity` blocks.
pub fn run(plan: &Plan, policy: Policy, capacity: u64) -> Tally {
    let capacity = capacity.min(u64::from(u32::MAX)) as u32;
    match policy {
        Policy::Fifo => fifo(plan, capacity),
        Policy::Lru => Trie::new(plan, capacity, false).run(),
        Policy::Optimal => Trie::new(plan, capacity, true).run(),
        Policy::Store => unreachable!("the store policy runs the master"),
    }
}

/// The unbounded cache: every block ever seen stays.
pub fn ceiling(plan: &Plan) -> Tally {
    let mut seen = vec![false; plan.parent.len()];
    let mut t = Tally {
        filled: true,
        ..Tally::default()
    };
    for r in 0..plan.requests() {
        let events = &plan.node[plan.range(r)];
        let k = events.iter().take_while(|&&n| seen[n as usize]).count();
        t.add(plan, r, k);
        for &n in events {
            seen[n as usize] = true;
        }
    }
    t
}

fn fifo(plan: &Plan, capacity: u32) -> Tally {
    let mut t = Tally::default();
    if capacity == 0 {
        (0..plan.requests()).for_each(|r| t.add(plan, r, 0));
        return t;
    }
    let mut cached = vec![false; plan.parent.len()];
    let mut queue: Vec<u32> = Vec::with_capacity(capacity as usize * 2);
    let mut head = 0usize;
    let mut size = 0u32;
    for r in 0..plan.requests() {
        let events = &plan.node[plan.range(r)];
        let k = events.iter().take_while(|&&n| cached[n as usize]).count();
        t.add(plan, r, k);
        for &n in events {
            if cached[n as usize] {
                continue;
            }
            if size >= capacity {
                while head < queue.len() {
                    let victim = queue[head] as usize;
                    head += 1;
                    if cached[victim] {
                        cached[victim] = false;
                        size -= 1;
                        break;
                    }
                }
            }
            if size < capacity {
                cached[n as usize] = true;
                size += 1;
                queue.push(n);
                if size >= capacity && r < plan.warmup {
                    t.filled = true;
                }
            }
        }
        if head > (1 << 20) && head * 2 > queue.len() {
            queue.drain(..head);
            head = 0;
        }
    }
    t
}

/// LRU and optimal over the prefix tree: leaves in a priority queue with lazy deletion
/// (an entry is live while its node's version is unchanged). LRU's fresh keys only grow,
/// so its touches go to a plain queue, already in order; the few entries pushed with an
/// older key (a parent left a leaf, a protected leaf put back) go to the heap, and the
/// next victim is the better of the two heads.
struct Trie<'a> {
    plan: &'a Plan,
    capacity: u32,
    optimal: bool,
    present: Vec<bool>,
    children: Vec<u32>,
    version: Vec<u32>,
    key: Vec<u32>,
    protected: Vec<u32>,
    mark: u32,
    /// `(priority, version)`: the largest priority is the next victim; it packs the
    /// key (inverted for LRU, whose victim has the smallest) above the node number.
    heap: BinaryHeap<(u64, u32)>,
    /// LRU only: entries pushed by touches, in falling priority (rising clock).
    fresh: VecDeque<(u64, u32)>,
    skipped: Vec<(u64, u32)>,
    size: u32,
    clock: u32,
}

impl<'a> Trie<'a> {
    fn new(plan: &'a Plan, capacity: u32, optimal: bool) -> Trie<'a> {
        let nodes = plan.parent.len();
        let mut present = vec![false; nodes];
        present[0] = true;
        Trie {
            plan,
            capacity,
            optimal,
            present,
            children: vec![0; nodes],
            version: vec![0; nodes],
            key: vec![0; nodes],
            protected: vec![0; nodes],
            mark: 1,
            heap: BinaryHeap::new(),
            fresh: VecDeque::with_capacity(if optimal { 0 } else { capacity as usize * 2 }),
            skipped: Vec::new(),
            size: 0,
            clock: 0,
        }
    }

    fn priority(&self, node: u32, key: u32) -> u64 {
        let k = if self.optimal { key } else { u32::MAX - key };
        u64::from(k) << 32 | u64::from(node)
    }

    fn unpack(&self, priority: u64) -> (usize, u32) {
        let k = (priority >> 32) as u32;
        let key = if self.optimal { k } else { u32::MAX - k };
        ((priority & 0xFFFF_FFFF) as usize, key)
    }

    /// Queues `node` as an eviction candidate if it is a cached leaf; `fresh`: its key
    /// is LRU's clock just now (larger than every key queued before).
    fn push_leaf(&mut self, node: usize, fresh: bool) {
        if node == 0 || !self.present[node] || self.children[node] != 0 {
            return;
        }
        self.version[node] = self.version[node].wrapping_add(1);
        let entry = (
            self.priority(node as u32, self.key[node]),
            self.version[node],
        );
        if fresh && !self.optimal {
            self.fresh.push_back(entry);
        } else {
            self.heap.push(entry);
        }
    }

    /// The entry with the highest priority of the heap and the fresh queue.
    fn pop(&mut self) -> Option<(u64, u32)> {
        match (self.fresh.front(), self.heap.peek()) {
            (Some(f), Some(h)) if f.0 > h.0 => self.fresh.pop_front(),
            (Some(_), None) => self.fresh.pop_front(),
            _ => self.heap.pop(),
        }
    }

    /// Refreshes a cached node: LRU's clock, or optimal's next use (`event`'s).
    fn touch(&mut self, node: usize, event: usize) {
        if node == 0 || !self.present[node] {
            return;
        }
        self.key[node] = if self.optimal {
            self.plan.next_use[event]
        } else {
            self.clock = self.clock.wrapping_add(1);
            self.clock
        };
        self.push_leaf(node, true);
    }

    fn add(&mut self, node: usize, event: usize) {
        let parent = self.plan.parent[node] as usize;
        self.present[node] = true;
        self.size += 1;
        self.children[parent] += 1;
        self.touch(node, event);
    }

    fn restore_skipped(&mut self) {
        for item in self.skipped.drain(..) {
            self.heap.push(item);
        }
    }

    /// Evicts one unprotected leaf; optimal refuses a victim needed no later than
    /// `candidate_key` (the block that would take its place).
    fn evict_leaf(&mut self, candidate_key: u32) -> bool {
        loop {
            let Some((priority, version)) = self.pop() else {
                self.restore_skipped();
                return false;
            };
            let (node, key) = self.unpack(priority);
            if !self.present[node]
                || self.children[node] != 0
                || self.version[node] != version
                || self.key[node] != key
            {
                continue;
            }
            if self.protected[node] == self.mark {
                self.skipped.push((priority, version));
                continue;
            }
            if self.optimal && key <= candidate_key {
                self.heap.push((priority, version));
                self.restore_skipped();
                return false;
            }
            self.present[node] = false;
            self.size -= 1;
            let parent = self.plan.parent[node] as usize;
            self.children[parent] -= 1;
            if parent > 0 && self.present[parent] && self.children[parent] == 0 {
                self.push_leaf(parent, false);
            }
            self.restore_skipped();
            return true;
        }
    }

    fn protect(&mut self, range: std::ops::Range<usize>) {
        self.mark += 1;
        if self.mark == 0x7FFF_FFFF {
            self.protected.iter_mut().for_each(|m| *m = 0);
            self.mark = 1;
        }
        for i in range {
            let n = self.plan.node[i] as usize;
            if self.present[n] {
                self.protected[n] = self.mark;
            }
        }
    }

    fn run(mut self) -> Tally {
        let plan = self.plan;
        let mut t = Tally::default();
        for r in 0..plan.requests() {
            let range = plan.range(r);
            if self.capacity == 0 {
                t.add(plan, r, 0);
                continue;
            }
            // The cached set is a rooted subtree, so the cached blocks of a request
            // are exactly its longest cached prefix.
            let mut k = 0;
            for i in range.clone() {
                let n = plan.node[i] as usize;
                if !self.present[n] {
                    break;
                }
                self.touch(n, i);
                k += 1;
            }
            t.add(plan, r, k);
            self.protect(range.clone());
            for i in range.start + k..range.end {
                let n = plan.node[i] as usize;
                if self.present[n] {
                    continue;
                }
                if self.size >= self.capacity {
                    let candidate = if self.optimal { plan.next_use[i] } else { 0 };
                    if !self.evict_leaf(candidate) {
                        break;
                    }
                }
                if self.size < self.capacity && self.present[plan.parent[n] as usize] {
                    self.add(n, i);
                    if self.size >= self.capacity && r < plan.warmup {
                        t.filled = true;
                    }
                } else {
                    break;
                }
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::parse;
    use super::*;

    /// One request per line of ids, one token per block.
    fn plan(requests: &[&[u64]]) -> Plan {
        let text: String = requests
            .iter()
            .map(|ids| {
                let list: Vec<String> = ids.iter().map(u64::to_string).collect();
                format!(
                    "{{\"input_length\": {}, \"hash_ids\": [{}]}}\n",
                    ids.len(),
                    list.join(",")
                )
            })
            .collect();
        parse(&text, "t", 1, None).unwrap()
    }

    fn hits(p: &Plan, policy: Policy, capacity: u64) -> u64 {
        run(p, policy, capacity).hit
    }

    #[test]
    fn known_answers_on_a_small_trace() {
        // Three single-block documents read round-robin, cache of two.
        let p = plan(&[&[1], &[2], &[3], &[1], &[2], &[3], &[1]]);
        // FIFO and LRU both cycle through misses; optimal keeps what is next needed.
        assert_eq!(hits(&p, Policy::Fifo, 2), 0);
        assert_eq!(hits(&p, Policy::Lru, 2), 0);
        // 1, 2 cached; 3 is needed at request 5, later than 1 (request 3) and 2 (4):
        // optimal keeps them and does not insert 3. Then 1 hits, 2 hits, 3 misses and
        // replaces 2 (never needed again), 1 hits.
        assert_eq!(hits(&p, Policy::Optimal, 2), 3);
        assert_eq!(ceiling(&p).hit, 4);

        // A hit refreshes LRU but not FIFO.
        let p = plan(&[&[1], &[2], &[1], &[3], &[1]]);
        assert_eq!(hits(&p, Policy::Fifo, 2), 1);
        assert_eq!(hits(&p, Policy::Lru, 2), 2);
    }

    #[test]
    fn only_the_longest_cached_prefix_counts() {
        // Request 2 has blocks 1 and 3 cached but 2 missing: only block 1 counts.
        let p = plan(&[&[1, 2, 3], &[1, 9], &[1, 2, 3]]);
        for policy in [Policy::Fifo, Policy::Lru, Policy::Optimal] {
            let t = run(&p, policy, 100);
            assert_eq!(t.hit, 1 + 3, "{policy:?}");
            assert_eq!(t.total, 8);
            // The last half is request 1 on: 1 + 3 of 5 tokens.
            assert_eq!((t.hit_last_half, t.total_last_half), (4, 5), "{policy:?}");
            assert!(!t.filled, "never full");
        }
        // With room for two (answers checked against the package): FIFO evicts 1 and
        // then 2 for 3 and 9, so the third request hits only its head, re-inserted by
        // the second. LRU evicts leaf 2 for 3, and then cannot insert 3 (its parent is
        // gone): 1 stays and hits twice. Optimal keeps the blocks used again.
        assert_eq!(run(&p, Policy::Fifo, 2).hit, 1);
        assert_eq!(run(&p, Policy::Lru, 2).hit, 2);
        assert_eq!(run(&p, Policy::Optimal, 2).hit, 3);
    }

    #[test]
    fn optimal_is_at_least_lru_and_fifo_and_at_most_the_ceiling() {
        // A pseudo-random workload of shared prefixes.
        let mut x = 12345u64;
        let mut reqs: Vec<Vec<u64>> = Vec::new();
        for _ in 0..400 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let doc = x % 30;
            let len = 1 + (x >> 8) % 6;
            reqs.push((0..len).map(|j| doc * 100 + j).collect());
        }
        let refs: Vec<&[u64]> = reqs.iter().map(Vec::as_slice).collect();
        let p = plan(&refs);
        let top = ceiling(&p).hit_last_half;
        for cap in [1, 3, 8, 20, 50, 200] {
            let opt = run(&p, Policy::Optimal, cap).hit_last_half;
            let lru = run(&p, Policy::Lru, cap).hit_last_half;
            let fifo = run(&p, Policy::Fifo, cap).hit_last_half;
            assert!(
                opt >= lru && opt >= fifo && opt <= top,
                "{cap}: {opt} {lru} {fifo}"
            );
        }
        assert_eq!(run(&p, Policy::Lru, 10_000).hit, ceiling(&p).hit);
    }
}
