//! Commit notes (`protocol::note`): a put the master acknowledges without waiting for
//! the node's catalog is named by its note in the node's ring, so a master that lost
//! its state gets the object back at the node's remount. Notes sealed under another
//! key, copied to another slot, or cleared (the put revoked, the commit applied) bring
//! nothing back. One master, one node catalog and a writer, in-process; the node polls
//! only when a test says so.

use std::time::Duration;

use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::node::catalog::NodeCatalog;
use mooncake::store::protocol::{
    note, CatalogEvent, NotePlace, NoteRing, NoteWrite, OwnerTicket, ReplicaDesc, ReplicateConfig,
    Request, Response, SegmentInfo, NOTE_SLOT,
};
use mooncake::util::crc32c::crc32c;
use mooncake::Code;

const CLIENT: u64 = 1;

/// With `MC_NOTES_TRACE` set, what the runs do (to read a failing seed by).
fn trace(line: impl FnOnce() -> String) {
    if std::env::var_os("MC_NOTES_TRACE").is_some() {
        eprintln!("{}", line());
    }
}
const SLOTS: u32 = 64;

/// A node's memory: its segment and, apart from it, its note ring.
struct Node {
    segment: Vec<u8>,
    ring_memory: Vec<u8>,
    info: SegmentInfo,
    ring: NoteRing,
    catalog: NodeCatalog,
}

impl Node {
    fn new(size: usize) -> Box<Node> {
        Node::with_slots(size, SLOTS)
    }

    fn with_slots(size: usize, slots: u32) -> Box<Node> {
        let segment = vec![0u8; size];
        let ring_memory = vec![0u8; slots as usize * NOTE_SLOT];
        let info = SegmentInfo {
            name: "node".into(),
            base: segment.as_ptr() as u64,
            size: size as u64,
        };
        let ring = NoteRing {
            addr: ring_memory.as_ptr() as u64,
            slots,
        };
        // SAFETY: the ring is `ring_memory`, owned by the node beside the catalog and
        // written only through `write` (notes) and the catalog.
        let catalog = unsafe { NodeCatalog::new(None, ring) };
        Box::new(Node {
            segment,
            ring_memory,
            info,
            ring,
            catalog,
        })
    }

    /// What an engine write does: `bytes` land at `addr`, in the segment or the ring.
    fn write(&mut self, addr: u64, bytes: &[u8]) {
        let (memory, base) = if addr >= self.ring.addr && addr < self.ring.addr + self.ring.bytes()
        {
            (&mut self.ring_memory, self.ring.addr)
        } else {
            (&mut self.segment, self.info.base)
        };
        let at = (addr - base) as usize;
        memory[at..at + bytes.len()].copy_from_slice(bytes);
    }

    /// One catalog poll, applied; the events it carried (a reset carries none).
    fn poll(&mut self, m: &Master) -> (bool, Vec<CatalogEvent>) {
        let req = self.catalog.poll_request(CLIENT, &self.info.name);
        let Response::SegmentEvents(ev) = m.handle(req).unwrap() else {
            panic!("wrong answer")
        };
        let seen = (ev.reset, ev.events.clone());
        trace(|| format!("  poll: reset {}, {} events", ev.reset, ev.events.len()));
        // SAFETY: the segment is `self.segment`, alive and writable.
        unsafe { self.catalog.apply(ev, &self.info) };
        seen
    }

    /// A poll that loses the node its place in the log, whose answer (the new epoch
    /// and its key) never reaches the node.
    fn poll_lost(&mut self, m: &Master) {
        self.catalog.forget_master();
        let req = self.catalog.poll_request(CLIENT, &self.info.name);
        m.handle(req).unwrap();
    }

    /// Mounts the segment on `m` as a node does after its master lost it: the
    /// catalog, notes folded in; how many pieces came from notes.
    fn remount(&mut self, m: &Master) -> u64 {
        self.catalog.forget_master();
        // SAFETY: the segment is `self.segment`, alive and readable.
        let (requests, announced) =
            unsafe { (self.catalog).remount_requests(CLIENT, &self.info, OwnerTicket::default()) };
        for req in requests {
            if let Request::Remount { entries, .. } = &req {
                for e in entries {
                    trace(|| format!("  remount {} v{}", e.key, e.version));
                }
            }
            m.handle(req).unwrap();
        }
        announced.noted
    }
}

/// A master started after `before` was, as a restarted one is: its versions begin
/// at the wall clock's millisecond, so it must not share its predecessor's.
fn restart_of(before: Master, ack_timeout: Duration) -> Master {
    drop(before);
    let ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    };
    let started = ms();
    // Bounded: the clock moves within a few milliseconds.
    for _ in 0..100_000_000u64 {
        if ms() > started + 1 {
            break;
        }
        std::hint::spin_loop();
    }
    master(ack_timeout)
}

fn master(ack_timeout: Duration) -> Master {
    master_polled(ack_timeout, Duration::ZERO)
}

/// A master whose catalog polls wait `poll_wait` for news.
fn master_polled(ack_timeout: Duration, poll_wait: Duration) -> Master {
    let mut cfg = MasterConfig::default();
    cfg.allocator.slab_size = 1 << 20;
    cfg.catalog_ack_timeout = ack_timeout;
    // Zero: a poll with nothing to say answers at once (the node here polls only when
    // a test says so, and never needs to wait for news).
    cfg.catalog_poll_wait = poll_wait;
    Master::with_clock(cfg, Clock::manual())
}

fn mount(m: &Master, node: &mut Node) {
    m.handle(Request::Mount {
        client: CLIENT,
        segment: node.info.clone(),
    })
    .unwrap();
    let (reset, _) = node.poll(m);
    assert!(reset, "a node's first poll starts its log");
    // The next one shows the node follows the log: from then on, notes.
    let (reset, _) = node.poll(m);
    assert!(!reset);
}

/// Starts a noted put of `value`, writes its bytes and notes into `node` as the
/// writer's engine batch would; the notes written.
fn start_and_write(m: &Master, node: &mut Node, key: &str, value: &[u8]) -> usize {
    let (replicas, notes) = start(m, key, value);
    land(node, &replicas, &notes, value);
    notes.len()
}

/// What the writer lands: the value in its replica, and its notes.
fn land(node: &mut Node, replicas: &[ReplicaDesc], notes: &[NoteWrite], value: &[u8]) {
    let piece = &replicas[0].pieces[0];
    trace(|| format!("  at {:#x}, {} notes", piece.addr, notes.len()));
    node.write(piece.addr, value);
    for n in notes {
        node.write(n.addr, &n.bytes);
    }
}

/// Starts a noted put of `value`: where it goes, and its notes.
fn start(m: &Master, key: &str, value: &[u8]) -> (Vec<ReplicaDesc>, Vec<NoteWrite>) {
    let Response::PutStartNoted(mut r) = m
        .handle(Request::PutStartNoted {
            client: CLIENT,
            items: vec![(key.into(), value.len() as u64, crc32c(value))],
            config: ReplicateConfig::default(),
            upsert: false,
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    r.pop().unwrap().unwrap()
}

fn end(m: &Master, key: &str, value: &[u8]) -> Result<(), Code> {
    let Response::PerKey(mut r) = m
        .handle(Request::PutEnd {
            client: CLIENT,
            items: vec![(key.into(), crc32c(value))],
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    r.pop().unwrap()
}

/// The checksum `m` holds for `key`.
fn stored_crc(m: &Master, key: &str) -> Result<u32, Code> {
    let Response::GetReplicas(mut r) = m
        .handle(Request::GetReplicas {
            keys: vec![key.into()],
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    r.pop().unwrap().map(|d| d.crc32c)
}

#[test]
fn a_put_acknowledged_without_waiting_comes_back_from_its_note() {
    // Were `PutEnd` to wait for the node (which polls only when told), it would give
    // up after this long and drop the node's log: the next poll would be a reset.
    let m = master(Duration::from_secs(5));
    let mut node = Node::new(1 << 20);
    mount(&m, &mut node);
    let a = vec![0xA1u8; 4096];
    assert_eq!(start_and_write(&m, &mut node, "a", &a), 1);
    end(&m, "a", &a).unwrap();
    let (reset, events) = node.poll(&m);
    assert!(!reset, "the put did not wait for the node");
    assert!(matches!(
        events[..],
        [CatalogEvent::Commit(_), CatalogEvent::Unnote { .. }]
    ));
    // "b" is acknowledged, and the master is lost before its node hears of it.
    let b = vec![0xB2u8; 3000];
    assert_eq!(start_and_write(&m, &mut node, "b", &b), 1);
    end(&m, "b", &b).unwrap();
    let restarted = restart_of(m, Duration::from_secs(5));
    assert_eq!(node.remount(&restarted), 1, "one piece came from its note");
    assert_eq!(stored_crc(&restarted, "a"), Ok(crc32c(&a)));
    assert_eq!(stored_crc(&restarted, "b"), Ok(crc32c(&b)));
}

#[test]
fn forged_copied_revoked_and_consumed_notes_bring_nothing_back() {
    // No waiting here: the node applies what it is sent only when it polls.
    let m = master(Duration::ZERO);
    let mut node = Node::new(1 << 20);
    mount(&m, &mut node);
    // Revoked after its bytes and note landed: the node is told to clear the note.
    let r = vec![7u8; 4096];
    start_and_write(&m, &mut node, "revoked", &r);
    m.handle(Request::PutRevoke {
        client: CLIENT,
        keys: vec!["revoked".into()],
    })
    .unwrap();
    // Committed, then removed: the commit's `Unnote` clears the note. Written again
    // into its slot afterwards (replayed by a member that kept a copy), it names
    // nothing.
    let g = vec![9u8; 2048];
    let (replicas, gone_notes) = start(&m, "gone", &g);
    land(&mut node, &replicas, &gone_notes, &g);
    end(&m, "gone", &g).unwrap();
    m.handle(Request::Remove {
        key: "gone".into(),
        force: false,
    })
    .unwrap();
    let (_, events) = node.poll(&m);
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, CatalogEvent::Unnote { .. }))
            .count(),
        2
    );
    for n in &gone_notes {
        node.write(n.addr, &n.bytes);
    }
    // A note of a put that never was, sealed under a key the node never got, over
    // bytes that match its checksum; and a copy of a genuine note in another slot.
    let k = vec![5u8; 4096];
    let genuine_slot = {
        let before = node.ring_memory.clone();
        start_and_write(&m, &mut node, "kept", &k);
        (0..SLOTS as usize)
            .find(|s| {
                node.ring_memory[s * NOTE_SLOT..][..NOTE_SLOT]
                    != before[s * NOTE_SLOT..][..NOTE_SLOT]
            })
            .unwrap()
    };
    end(&m, "kept", &k).unwrap();
    let copy = node.ring_memory[genuine_slot * NOTE_SLOT..][..NOTE_SLOT].to_vec();
    let other = (genuine_slot + 1) % SLOTS as usize;
    let at = node.ring.slot_addr(other as u32);
    node.write(at, &copy);
    assert!(
        note::open(&copy, &[0; 32], 0, 0).is_none(),
        "a genuine note does not open under another key"
    );
    let forged_value = vec![3u8; 1024];
    let forged_at = node.info.base + (512 << 10);
    node.write(forged_at, &forged_value);
    let entry = Some(mooncake::store::protocol::CatalogEntry {
        key: "forged".into(),
        version: u64::MAX / 2,
        size: 1024,
        crc32c: crc32c(&forged_value),
        hard_pin: false,
        replica: mooncake::store::protocol::ReplicaDesc {
            pieces: vec![mooncake::store::protocol::Piece {
                segment: node.info.name.as_str().into(),
                addr: forged_at,
                len: 1024,
            }]
            .into(),
        },
        index: 0,
    });
    let slot = (genuine_slot + 2) % SLOTS as usize;
    let place = NotePlace {
        epoch: 1,
        slot: slot as u32,
        lend: u64::MAX,
    };
    let forged = note::seal(&[0x42; 32], place, entry.as_ref().unwrap()).unwrap();
    node.write(node.ring.slot_addr(slot as u32), &forged);
    let restarted = restart_of(m, Duration::ZERO);
    assert_eq!(
        node.remount(&restarted),
        1,
        "only the genuine note of \"kept\""
    );
    assert_eq!(stored_crc(&restarted, "kept"), Ok(crc32c(&k)));
    for key in ["revoked", "gone", "forged"] {
        assert_eq!(
            stored_crc(&restarted, key),
            Err(Code::ObjectNotFound),
            "{key}"
        );
    }
}

#[test]
fn a_node_without_a_ring_gets_no_notes_and_its_puts_wait() {
    let m = master(Duration::ZERO);
    let mut node = Node::new(1 << 20);
    node.ring = NoteRing::default();
    // SAFETY: no ring.
    node.catalog = unsafe { NodeCatalog::new(None, NoteRing::default()) };
    mount(&m, &mut node);
    let v = vec![1u8; 100];
    assert_eq!(start_and_write(&m, &mut node, "v", &v), 0);
    end(&m, "v", &v).unwrap();
    assert_eq!(stored_crc(&m, "v"), Ok(crc32c(&v)));
}

#[test]
fn a_reset_reads_the_notes_of_the_epoch_it_ends() {
    let m = master(Duration::from_secs(5));
    let mut node = Node::new(1 << 20);
    mount(&m, &mut node);
    let c = vec![0xC3u8; 4096];
    start_and_write(&m, &mut node, "c", &c);
    end(&m, "c", &c).unwrap();
    // The node loses its place in the log before it heard of "c": its next poll
    // starts a new epoch, under a new key, and the old notes are read first.
    node.catalog.forget_master();
    let (reset, _) = node.poll(&m);
    assert!(reset);
    node.poll(&m);
    let d = vec![0xD4u8; 4096];
    assert_eq!(start_and_write(&m, &mut node, "d", &d), 1);
    end(&m, "d", &d).unwrap();
    // The master is lost before the snapshot arrived: "c" is known from the note
    // read at the reset, "d" from its note of the new epoch.
    let restarted = restart_of(m, Duration::from_secs(5));
    assert_eq!(node.remount(&restarted), 1);
    assert_eq!(stored_crc(&restarted, "c"), Ok(crc32c(&c)));
    assert_eq!(stored_crc(&restarted, "d"), Ok(crc32c(&d)));
}

/// What a key is, as the writer and remover saw it.
#[derive(Clone)]
enum Known {
    Absent,
    /// Acknowledged; `kept`: the node can name it if the master is lost now (its note
    /// landed, or its commit reached the node's catalog).
    Stored {
        value: Vec<u8>,
        kept: bool,
    },
    /// Started and written (with its note, if `noted`), not ended yet; `epoch`
    /// counts the node's log resets before the start.
    Writing {
        value: Vec<u8>,
        noted: bool,
        epoch: u64,
    },
    /// Removed or revoked; `told`: the node has applied it since.
    Gone {
        value: Vec<u8>,
        told: bool,
    },
}

impl std::fmt::Debug for Known {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Known::Absent => write!(f, "absent"),
            Known::Stored { value, kept } => {
                write!(f, "stored ({} bytes, kept {kept})", value.len())
            }
            Known::Writing { value, noted, .. } => {
                write!(f, "writing ({} bytes, noted {noted})", value.len())
            }
            Known::Gone { value, told } => write!(f, "gone ({} bytes, told {told})", value.len()),
        }
    }
}

/// A small seeded generator (xorshift64*): the same seed, the same run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// Checks every key against `m` after a restart; what each key is now.
fn check_after_restart(m: &Master, known: &mut [Known], seed: u64) {
    for (i, k) in known.iter_mut().enumerate() {
        let key = format!("k{i}");
        let stored = stored_crc(m, &key);
        let (must, value) = match &*k {
            Known::Absent => (Some(false), None),
            Known::Stored { value, kept } => (kept.then_some(true), Some(value)),
            Known::Writing { value, .. } => (None, Some(value)),
            Known::Gone { value, told } => (told.then_some(false), Some(value)),
        };
        match (&stored, must) {
            (Ok(_), Some(false)) | (Err(_), Some(true)) => {
                panic!("seed {seed}: {key} was {k:?}, after the restart {stored:?}")
            }
            _ => {}
        }
        if let (Ok(crc), Some(v)) = (&stored, value) {
            assert_eq!(
                *crc,
                crc32c(v),
                "seed {seed}: {key} came back with other bytes"
            );
        }
        *k = match (stored, value) {
            (Ok(_), Some(v)) => Known::Stored {
                value: v.clone(),
                kept: true,
            },
            _ => Known::Absent,
        };
    }
}

/// Seeded runs of noted and waiting puts, ends, revokes, removes, node polls, lost
/// log places (the new epoch's answer delivered or lost) and master restarts on a ring too small for every put: after each
/// restart, every acknowledged object the node could name is back with its bytes,
/// nothing the node heard was removed is, and nothing comes back with other bytes.
#[test]
fn seeded_runs_keep_what_was_acknowledged() {
    let seeds: u64 = std::env::var("MC_NOTES_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    for seed in 0..seeds {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        // No waiting: the node applies what it is sent only when the run polls.
        let mut m = master(Duration::ZERO);
        // Room for every slab size class the values need: nothing is evicted.
        let mut node = Node::with_slots(64 << 20, 6);
        mount(&m, &mut node);
        let mut known = vec![Known::Absent; 10];
        // Whether the node has something to hear (a poll with nothing waits).
        let mut news = false;
        // The node's log resets so far: a note sealed before one no longer covers
        // its put (whose end then waits for the node, here not at all).
        let mut epoch = 0;
        for _ in 0..80 {
            let i = rng.below(known.len() as u64) as usize;
            let key = format!("k{i}");
            let step = rng.below(11);
            trace(|| format!("seed {seed}: step {step} on {key} ({:?})", known[i]));
            match step {
                0..=2 => {
                    if let Known::Absent | Known::Gone { told: true, .. } = known[i] {
                        let len = 1 + rng.below(6000) as usize;
                        let value: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
                        let noted = start_and_write(&m, &mut node, &key, &value) > 0;
                        known[i] = Known::Writing {
                            value,
                            noted,
                            epoch,
                        };
                    }
                }
                3 | 4 => {
                    if let Known::Writing {
                        value,
                        noted,
                        epoch: started,
                    } = known[i].clone()
                    {
                        end(&m, &key, &value).unwrap();
                        // Noted in this epoch: acknowledged without waiting, kept by
                        // its note.
                        known[i] = Known::Stored {
                            value,
                            kept: noted && started == epoch,
                        };
                        news = true;
                    }
                }
                5 => match known[i].clone() {
                    Known::Writing { value, .. } => {
                        m.handle(Request::PutRevoke {
                            client: CLIENT,
                            keys: vec![key],
                        })
                        .unwrap();
                        known[i] = Known::Gone { value, told: false };
                        news = true;
                    }
                    Known::Stored { value, .. } => {
                        m.handle(Request::Remove { key, force: true }).unwrap();
                        known[i] = Known::Gone { value, told: false };
                        news = true;
                    }
                    _ => {}
                },
                6 | 7 => {
                    // A reset's answer (after a lost one) tells nothing yet: its
                    // snapshot comes with the next poll.
                    if news && !node.poll(&m).0 {
                        news = false;
                        for k in known.iter_mut() {
                            match k {
                                Known::Stored { kept, .. } => *kept = true,
                                Known::Gone { told, .. } => *told = true,
                                _ => {}
                            }
                        }
                    }
                }
                8 => {
                    node.catalog.forget_master();
                    node.poll(&m);
                    news = true;
                    epoch += 1;
                }
                9 => {
                    node.poll_lost(&m);
                    news = true;
                    epoch += 1;
                }
                _ => {
                    m = restart_of(m, Duration::ZERO);
                    node.remount(&m);
                    check_after_restart(&m, &mut known, seed);
                    node.poll(&m);
                    news = true;
                    epoch += 1;
                }
            }
        }
    }
}

/// Runs `during` while `node` polls `m` in a thread of its own, as a node's catalog
/// thread does. An answer that comes after `during` returned is not applied: the
/// master is taken to have died then, with its answer unsent.
fn with_poller<T>(m: &Master, node: &mut Node, during: impl FnOnce() -> T) -> T {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| loop {
            let req = node.catalog.poll_request(CLIENT, &node.info.name);
            let Ok(Response::SegmentEvents(ev)) = m.handle(req) else {
                panic!("wrong answer")
            };
            if stop.load(Ordering::SeqCst) {
                break;
            }
            // SAFETY: the segment is `node.segment`, alive and writable.
            unsafe { node.catalog.apply(ev, &node.info) };
        });
        let out = during();
        stop.store(true, Ordering::SeqCst);
        out
    })
}

#[test]
fn a_revoke_after_a_reset_returns_once_the_node_dropped_the_put() {
    // Polls wait for news as they do in a cluster: nothing the revoke records reaches
    // the node unless the revoke asks for it.
    let m = master_polled(Duration::from_secs(10), Duration::from_millis(500));
    let mut node = Node::new(1 << 20);
    mount(&m, &mut node);
    let p = vec![0x5Au8; 4096];
    assert_eq!(start_and_write(&m, &mut node, "p", &p), 1);
    // The node loses its place: its reset reads the note, so it now holds "p" until
    // told otherwise (the snapshot that would drop it comes with its next poll).
    node.catalog.forget_master();
    assert!(node.poll(&m).0);
    with_poller(&m, &mut node, || {
        m.handle(Request::PutRevoke {
            client: CLIENT,
            keys: vec!["p".into()],
        })
        .unwrap()
    });
    let restarted = restart_of(m, Duration::from_secs(10));
    node.remount(&restarted);
    assert_eq!(stored_crc(&restarted, "p"), Err(Code::ObjectNotFound));
}

#[test]
fn a_note_written_after_its_put_was_dropped_names_nothing() {
    let m = master(Duration::ZERO);
    let mut node = Node::new(1 << 20);
    mount(&m, &mut node);
    // The writer is slow: its put is removed (by force) before its batch lands.
    let q = vec![0x71u8; 4096];
    let (replicas, notes) = start(&m, "q", &q);
    assert_eq!(notes.len(), 1);
    m.handle(Request::Remove {
        key: "q".into(),
        force: true,
    })
    .unwrap();
    let (_, events) = node.poll(&m);
    assert!(events
        .iter()
        .any(|e| matches!(e, CatalogEvent::Unnote { .. })));
    land(&mut node, &replicas, &notes, &q);
    let restarted = restart_of(m, Duration::ZERO);
    assert_eq!(node.remount(&restarted), 0);
    assert_eq!(stored_crc(&restarted, "q"), Err(Code::ObjectNotFound));
}

#[test]
fn a_slot_a_writer_may_still_fill_is_not_lent_after_its_segment_mounts_again() {
    let m = master(Duration::ZERO);
    let mut node = Node::new(1 << 20);
    mount(&m, &mut node);
    let (_, before) = start(&m, "slow", &[1u8; 100]);
    // The segment leaves the pool (here by its owner) and comes back over the same
    // memory and ring while the writer of "slow" may still write its note.
    m.handle(Request::Unmount {
        client: CLIENT,
        name: node.info.name.clone(),
    })
    .unwrap();
    node.catalog.forget_master();
    mount(&m, &mut node);
    let lent: Vec<u64> = (0..SLOTS)
        .map(|i| start(&m, &format!("after{i}"), &[2u8; 100]).1)
        .filter_map(|n| n.first().map(|n| n.addr))
        .collect();
    assert!(!lent.is_empty());
    assert!(
        !lent.contains(&before[0].addr),
        "the slow writer's slot was lent again"
    );
}
