//! Mounted segments, each with its own allocator, and replica placement across them.

use crate::util::sync::{Unpoisoned, UnpoisonedRw};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::config::AllocationStrategy;
use super::segment_log::SegmentLog;
use crate::allocator::{Allocation, AllocatorConfig, SlabAllocator};
use crate::protocol::{
    CatalogEvent, OwnerTicket, Piece, ReplicaDesc, ReplicateConfig, SegmentInfo,
};

/// One node's memory in the pool.
pub struct Segment {
    pub id: u64,
    /// What the segment is mounted, found and unmounted by: its engine segment name
    /// for a node's main segment, the id its client gave for an extra one (both kinds
    /// share `info.name`, the engine segment pieces on them are reached through).
    pub key: String,
    pub info: SegmentInfo,
    pub client: u64,
    pub alloc: SlabAllocator,
    /// What the owner's catalog of this segment has yet to learn.
    pub log: SegmentLog,
    /// Bytes of the owner's disk tier (0: none), as its catalog polls report.
    pub disk_capacity: AtomicU64,
    /// Leaving the pool: nothing new is placed here.
    pub draining: AtomicBool,
    /// Mounted by a remount whose objects are still being adopted: its node's catalog
    /// must not be given a snapshot yet (it would lack them, and the node would drop
    /// what the snapshot does not name, disk copies included).
    pub adopting: AtomicBool,
    /// The ticket its owner mounted the name under (`None`: mounted without one).
    pub owner: Option<OwnerTicket>,
}

/// An allocated range; dropping it gives the space back.
pub struct PieceAlloc {
    pub seg: Arc<Segment>,
    pub alloc: Allocation,
}

impl PieceAlloc {
    pub fn piece(&self) -> Piece {
        let (segment, addr, len) = self.wire();
        Piece {
            segment: segment.into(),
            addr,
            len,
        }
    }

    /// The piece as the wire names it: (segment, absolute address, length).
    pub fn wire(&self) -> (&str, u64, u64) {
        let info = &self.seg.info;
        (&info.name, info.base + self.alloc.offset, self.alloc.size)
    }
}

impl Drop for PieceAlloc {
    fn drop(&mut self) {
        // Before the space can be handed out again, so the owner's catalog learns of
        // the free before any later commit at the same address.
        let addr = self.seg.info.base + self.alloc.offset;
        self.seg.log.record(|| CatalogEvent::Free(addr));
        self.seg.alloc.free(self.alloc);
    }
}

/// One replica's pieces, in value order.
pub type ReplicaAlloc = Vec<PieceAlloc>;

pub fn describe(replicas: &[ReplicaAlloc]) -> Vec<ReplicaDesc> {
    replicas
        .iter()
        .map(|r| ReplicaDesc {
            pieces: r.iter().map(PieceAlloc::piece).collect(),
        })
        .collect()
}

/// Space in a segment that was dropped while someone may still write there (an
/// unfinished put's writer, say, whose bytes may land until `until_ms`): should the
/// same memory be mounted again, it is not lent before then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    pub addr: u64,
    pub len: u64,
    pub until_ms: u64,
}

/// The fences of one dropped segment, with the range they lie in.
struct Fenced {
    base: u64,
    size: u64,
    fences: Vec<Fence>,
}

#[derive(Default)]
pub struct SegmentTable {
    by_name: RwLock<HashMap<String, Arc<Segment>>>,
    next_id: AtomicU64,
    /// Fences of dropped segments, by key, until the key is mounted again.
    fenced: Mutex<HashMap<String, Fenced>>,
}

impl SegmentTable {
    /// Adds a segment under `key`, with the space of its fences (see `fence`) taken;
    /// `Err(existing owner)` if the key is taken by another client (a repeated mount
    /// by the same client changes nothing).
    pub fn mount(
        &self,
        key: &str,
        client: u64,
        info: SegmentInfo,
        config: &AllocatorConfig,
        now_ms: u64,
    ) -> Result<Vec<(PieceAlloc, u64)>, u64> {
        let mut map = self.by_name.write_locked();
        if let Some(s) = map.get(key) {
            return if s.client == client {
                Ok(Vec::new())
            } else {
                Err(s.client)
            };
        }
        // Fences on the node's note ring (beside the segment) go to its log.
        let (fences, ring_fences): (Vec<_>, Vec<_>) = self
            .take_fences(key, &info, now_ms)
            .into_iter()
            .partition(|f| f.addr >= info.base && f.addr < info.base.saturating_add(info.size));
        let config = config.for_segment(info.size);
        let (alloc, taken) = if fences.is_empty() {
            (SlabAllocator::new(info.size, config), Vec::new())
        } else {
            SlabAllocator::with_claims(info.size, config, &fence_claims(&info, &fences))
        };
        let seg = Arc::new(Segment {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            key: key.to_owned(),
            alloc,
            client,
            info,
            log: SegmentLog::default(),
            disk_capacity: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            adopting: AtomicBool::new(false),
            owner: None,
        });
        let now = std::time::Instant::now();
        let ring_fences = ring_fences.iter().map(|f| {
            let left = std::time::Duration::from_millis(f.until_ms.saturating_sub(now_ms));
            (f.addr, now + left)
        });
        seg.log.fence_notes(ring_fences.collect());
        map.insert(key.to_owned(), seg.clone());
        Ok(fenced_space(&seg, &fences, taken))
    }

    /// Remembers that writers may still land in `fences` of the segment just dropped
    /// from under `key`: mounted again over the same range, its allocator holds them
    /// until their time (`take_fences`). Fences past their time are forgotten here.
    pub fn fence(&self, key: &str, info: &SegmentInfo, fences: Vec<Fence>, now_ms: u64) {
        let mut fenced = self.fenced.locked();
        fenced.retain(|_, f| f.fences.iter().any(|f| f.until_ms > now_ms));
        if fences.iter().any(|f| f.until_ms > now_ms) {
            let entry = Fenced {
                base: info.base,
                size: info.size,
                fences,
            };
            fenced.insert(key.to_owned(), entry);
        }
    }

    /// The fences still in force for a segment mounted under `key` over `info`'s
    /// range (taken: the caller holds them now). Another range is other memory: its
    /// addresses lie elsewhere in the layout, and a write aimed at the old one cannot
    /// be told apart from any other stray write.
    pub fn take_fences(&self, key: &str, info: &SegmentInfo, now_ms: u64) -> Vec<Fence> {
        match self.fenced.locked().remove(key) {
            Some(f) if f.base == info.base && f.size == info.size => f
                .fences
                .into_iter()
                .filter(|f| f.until_ms > now_ms)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Gives back fences taken for a mount that did not happen.
    pub fn restore_fences(&self, key: &str, info: &SegmentInfo, fences: Vec<Fence>) {
        if !fences.is_empty() {
            let entry = Fenced {
                base: info.base,
                size: info.size,
                fences,
            };
            self.fenced.locked().insert(key.to_owned(), entry);
        }
    }

    /// Adds a segment whose space is partly in use already (`alloc` was rebuilt from
    /// its owner's catalog), its name held under `owner`; `Err(existing owner)` if the
    /// name is taken.
    pub fn mount_rebuilt(
        &self,
        client: u64,
        info: SegmentInfo,
        alloc: SlabAllocator,
        owner: Option<OwnerTicket>,
    ) -> Result<Arc<Segment>, u64> {
        let mut map = self.by_name.write_locked();
        if let Some(s) = map.get(&info.name) {
            return Err(s.client);
        }
        let seg = Arc::new(Segment {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            key: info.name.clone(),
            alloc,
            client,
            info,
            log: SegmentLog::default(),
            disk_capacity: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            adopting: AtomicBool::new(true),
            owner,
        });
        map.insert(seg.info.name.clone(), seg.clone());
        Ok(seg)
    }

    /// The segment mounted under `key`.
    pub fn get(&self, key: &str) -> Option<Arc<Segment>> {
        let map = self.by_name.read_locked();
        map.get(key).cloned()
    }

    /// Whether `seg` is still mounted (not dropped, nor replaced by a remount).
    pub fn holds(&self, seg: &Arc<Segment>) -> bool {
        self.get(&seg.key).is_some_and(|s| Arc::ptr_eq(&s, seg))
    }

    pub fn unmount(&self, key: &str) -> Option<Arc<Segment>> {
        self.by_name.write_locked().remove(key)
    }

    /// Every segment reached through the engine segment `name` (a node's main segment
    /// and its extra ones).
    pub fn named(&self, name: &str) -> Vec<Arc<Segment>> {
        self.snapshot()
            .into_iter()
            .filter(|s| s.info.name == name)
            .collect()
    }

    pub fn snapshot(&self) -> Vec<Arc<Segment>> {
        let map = self.by_name.read_locked();
        let mut v: Vec<_> = map.values().cloned().collect();
        v.sort_by_key(|s| s.id);
        v
    }

    pub fn has_client(&self, client: u64) -> bool {
        let map = self.by_name.read_locked();
        map.values().any(|s| s.client == client)
    }

    /// The keys of `client`'s segments.
    pub fn of_client(&self, client: u64) -> Vec<String> {
        let map = self.by_name.read_locked();
        map.values()
            .filter(|s| s.client == client)
            .map(|s| s.key.clone())
            .collect()
    }

    pub fn capacity_and_used(&self) -> (u64, u64) {
        let map = self.by_name.read_locked();
        map.values().fold((0, 0), |(c, u), s| {
            (c + usable(&s.alloc), u + s.alloc.used_bytes())
        })
    }
}

/// `fences` as allocator claims `(offset, len)` in `info`'s segment (which they were
/// taken for: see `take_fences`).
pub fn fence_claims(info: &SegmentInfo, fences: &[Fence]) -> Vec<(u64, u64)> {
    fences.iter().map(|f| (f.addr - info.base, f.len)).collect()
}

/// The space `taken` for `fences` in `seg`, each with the time it is held until (a
/// fence the layout refused is not held: a claim from the node's catalog holds that
/// space already).
pub fn fenced_space(
    seg: &Arc<Segment>,
    fences: &[Fence],
    taken: Vec<Option<Allocation>>,
) -> Vec<(PieceAlloc, u64)> {
    fences
        .iter()
        .zip(taken)
        .filter_map(|(f, alloc)| {
            let piece = PieceAlloc {
                seg: seg.clone(),
                alloc: alloc?,
            };
            Some((piece, f.until_ms))
        })
        .collect()
}

/// Bytes an allocator can hand out: whole slabs only (a shorter tail stays unused).
pub fn usable(alloc: &SlabAllocator) -> u64 {
    alloc.slab_count() as u64 * alloc.slab_size()
}

/// Orders candidate segments for one object by the configured strategy.
pub fn placement_order(
    mut segs: Vec<Arc<Segment>>,
    strategy: AllocationStrategy,
    config: &ReplicateConfig,
    writer: u64,
    seed: u64,
) -> Vec<Arc<Segment>> {
    segs.retain(|s| !s.draining.load(Ordering::Relaxed));
    if segs.is_empty() {
        return segs;
    }
    match strategy {
        AllocationStrategy::FreeRatioFirst => segs.sort_by(|a, b| {
            let free =
                |s: &Segment| 1.0 - s.alloc.used_bytes() as f64 / s.alloc.capacity().max(1) as f64;
            free(b).total_cmp(&free(a))
        }),
        _ => {
            let start = (seed % segs.len() as u64) as usize;
            segs.rotate_left(start);
        }
    }
    let local_first = config.prefer_same_node || strategy == AllocationStrategy::LocalFirst;
    if local_first {
        // Stable: keeps the strategy's order within each group.
        segs.sort_by_key(|s| s.client != writer);
    }
    for name in config.preferred_segments.iter().rev() {
        // Every segment of that name (a node's main and extra ones) moves up, in order.
        let (mut first, rest): (Vec<_>, Vec<_>) =
            segs.into_iter().partition(|s| &s.info.name == name);
        first.extend(rest);
        segs = first;
    }
    segs
}

/// Allocates up to `replicas` copies of `size` bytes on distinct segments. Objects
/// larger than a segment's largest block are striped: each replica gets its own
/// subset of segments and its pieces go round-robin over it.
pub fn allocate(order: &[Arc<Segment>], size: u64, replicas: u32) -> Vec<ReplicaAlloc> {
    let replicas = (replicas.max(1) as usize).min(order.len());
    // Exact: the list lives as long as the object (a growing Vec would hold four).
    let mut out = Vec::with_capacity(replicas);
    let mut used = vec![false; order.len()];
    for r in 0..replicas {
        let single = order.iter().enumerate().find_map(|(i, s)| {
            if used[i] || size > s.alloc.max_object_size() {
                return None;
            }
            let a = s.alloc.alloc(size)?;
            used[i] = true;
            Some(vec![PieceAlloc {
                seg: s.clone(),
                alloc: a,
            }])
        });
        if let Some(rep) = single {
            out.push(rep);
            continue;
        }
        // Striping: this replica's segments are those with index ≡ r (mod replicas).
        let mine: Vec<usize> = (0..order.len())
            .filter(|i| i % replicas == r && !used[*i])
            .collect();
        if let Some(rep) = stripe(order, &mine, size) {
            for i in &mine {
                used[*i] = true;
            }
            out.push(rep);
        }
    }
    out
}

fn stripe(order: &[Arc<Segment>], mine: &[usize], size: u64) -> Option<ReplicaAlloc> {
    let piece_max = mine
        .iter()
        .map(|&i| order[i].alloc.max_object_size())
        .min()?;
    if piece_max == 0 {
        return None;
    }
    let mut pieces = Vec::new();
    let mut left = size;
    let mut k = 0;
    while left > 0 {
        let len = left.min(piece_max);
        // Try each of this replica's segments, starting at the round-robin position.
        let a = (0..mine.len()).find_map(|j| {
            let s = &order[mine[(k + j) % mine.len()]];
            s.alloc.alloc(len).map(|a| PieceAlloc {
                seg: s.clone(),
                alloc: a,
            })
        })?; // dropping `pieces` on failure gives back what was taken
        pieces.push(a);
        left -= len;
        k += 1;
    }
    Some(pieces)
}
