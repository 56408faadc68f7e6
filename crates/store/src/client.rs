//! A store client: optionally lends memory to the pool (a "node"), and puts and gets
//! objects by moving bytes peer to peer with the transfer engine while the master only
//! hands out places and leases.

use crate::util::sync::{StopSignal, Unpoisoned};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::codec::Writer;
use super::disk::DiskConfig;
use super::node::catalog::NodeCatalog;
use super::node::disk::NodeDisk;
use super::node::DrainReport;
use super::protocol::{
    shown_key, KeyResult, Lookup, NoteRing, NoteWrite, ObjectDesc, OwnerTicket, Piece, PoolStats,
    ReplicaDesc, ReplicateConfig, Request, Response, SegmentInfo, NOTE_SLOT,
};
use super::replica_cache::ReplicaCache;
use super::rpc::RpcClient;
use crate::auth::ClusterSecret;
use crate::engine::{Engine, EngineConfig, TaskState};
use crate::error::{Code, Error, Result};
use crate::transport::Op;
use crate::util::crc32c::{crc32c_append, crc32c_combine};

mod mounts;
mod prefault;
mod read;
mod sessions;
mod tasks;

use read::ReadInto;

pub use mounts::{Backing, SEGMENT_ALIGN};

/// A node's note ring has a slot per this many bytes of its segment, within bounds:
/// slots are lent to puts until the node clears their notes, within a poll or two.
const NOTE_SLOTS_PER: u64 = 256 << 10;
const MIN_NOTE_SLOTS: u64 = 64;
const MAX_NOTE_SLOTS: u64 = 4096;
pub use tasks::{TaskId, TaskInfo, TaskKind, TaskStatus};

/// What a store [`Client`] connects to and how it behaves.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `host:port` of the master's RPC.
    pub master_address: String,
    /// Bytes of memory lent to the pool; 0 makes a pure client.
    pub global_segment_size: u64,
    /// Kept for Mooncake compatibility: staging for transports that need registered
    /// local memory (RDMA). TCP and shared memory read and write user buffers directly.
    pub local_buffer_size: u64,
    /// Check each object's CRC32C on read (computed per slice while the bytes move,
    /// in the same pass as a same-host copy). A get straight into device memory over
    /// a transport that fills it natively cannot be checked by the host and is not.
    pub verify_checksum: bool,
    /// Reuse a key's replica descriptors while the lease granted with them lasts, so a
    /// repeated get needs no master round trip (see `replica_cache`).
    pub cache_replicas: bool,
    /// How often the client pings the master (and remounts when asked).
    pub ping_interval: Duration,
    /// The client's transfer engine: metadata connection, segment name
    /// (`local_server_name`, Mooncake's `local_hostname`), protocol, workers, ...
    pub engine: EngineConfig,
    /// A disk tier for objects evicted from this node's segment (`--ssd-path`,
    /// `--ssd-size`); nodes only.
    pub disk: Option<DiskConfig>,
    /// Commit the segment's memory in the background from its allocation on, at idle
    /// priority, while a CPU is idle beside it, and only while the machine (and the
    /// process's memory cgroup) keeps a reserve, so puts do not pay the kernel's first
    /// touch (see `prefault`). Default on; `MC_STORE_PREFAULT=0` in the environment
    /// turns the default off.
    pub prefault_segment: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            master_address: "127.0.0.1:50051".to_owned(),
            global_segment_size: 0,
            local_buffer_size: 16 << 20,
            verify_checksum: true,
            cache_replicas: true,
            ping_interval: Duration::from_secs(1),
            engine: EngineConfig::default(),
            disk: None,
            prefault_segment: prefault_by_default(),
        }
    }
}

/// `prefault_segment`'s default: on unless `MC_STORE_PREFAULT` says off.
fn prefault_by_default() -> bool {
    match std::env::var("MC_STORE_PREFAULT") {
        Err(_) => true,
        Ok(v) => crate::util::switch::parse(&v).unwrap_or_else(|| {
            log::warn!("MC_STORE_PREFAULT={v:?} is not 1 or 0: taken as 1");
            true
        }),
    }
}

impl ClientConfig {
    /// A client of `master` whose engine finds peers through `metadata` and moves
    /// bytes with `protocol`.
    pub fn connect(master: &str, metadata: &str, protocol: &str) -> Result<ClientConfig> {
        let mut c = ClientConfig {
            master_address: master.to_owned(),
            ..ClientConfig::default()
        };
        c.engine.set("metadata", metadata)?;
        c.engine.set("protocol", protocol)?;
        Ok(c)
    }
}

/// Where nodes find segment descriptors by default: the master's embedded metadata
/// server on its default port (8080).
pub fn default_metadata(master_address: &str) -> String {
    let host = crate::engine::segments::host_of(master_address);
    format!(
        "http://{}/metadata",
        crate::metadata::directory::join_host_port(host, 8080)
    )
}

/// The metadata URL for a client of the master at `master_address` that was given none:
/// the one the master reports (its embedded metadata server; a loopback or unspecified
/// host there becomes the host this client reaches the master at). A master too old to
/// answer gets `default_metadata`; one that runs no metadata server is an error asking
/// for the URL.
pub fn metadata_of_master(master_address: &str, secret: Option<&ClusterSecret>) -> Result<String> {
    let rpc = RpcClient::new(master_address, secret.cloned())?;
    let url = match rpc.call(&Request::MetadataUrl) {
        Ok(Response::MetadataUrl(url)) => url,
        Ok(other) => {
            return Err(Error::protocol(format!(
                "master {master_address} answered {other:?} to a metadata URL request"
            )))
        }
        // An older master drops the connection on a method it does not know; if it
        // answers a request it does know, that is what happened.
        Err(e) => {
            return match rpc.call(&Request::Stats) {
                Ok(_) => Ok(default_metadata(master_address)),
                Err(_) => Err(e),
            }
        }
    };
    if url.is_empty() {
        return Err(Error::invalid(format!(
            "the master at {master_address} runs no metadata server; give the metadata URL"
        )));
    }
    Ok(reachable_metadata_url(&url, master_address))
}

/// `url` with a loopback or unspecified host replaced by the master's host (the
/// metadata server listens on the master's address, which this client reaches).
fn reachable_metadata_url(url: &str, master_address: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let Some(port) = authority
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
    else {
        return url.to_owned();
    };
    let local = crate::engine::segments::host_of(authority)
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified());
    if !local {
        return url.to_owned();
    }
    let master_host = crate::engine::segments::host_of(master_address);
    format!(
        "{scheme}://{}{path}",
        crate::metadata::directory::join_host_port(master_host, port)
    )
}

/// Where one key's bytes are, locally: `(address, length)` parts that concatenate to
/// the value.
pub type Parts = Vec<(u64, u64)>;

/// Local memory placed against an object's bytes: `(object offset, local address,
/// length)` each.
pub type Fragments = Vec<(u64, u64, u64)>;

/// Fragments as a read or write plans them: most objects are one part, kept in place.
pub(super) type FragmentList = crate::util::SmallList<(u64, u64, u64)>;

/// Parts laid end to end from the object's first byte.
pub(super) fn fragments(parts: &[(u64, u64)]) -> FragmentList {
    let mut off = 0;
    parts
        .iter()
        .map(|&(addr, len)| {
            let f = (off, addr, len);
            off += len;
            f
        })
        .collect()
}

/// This client as the master knows it (shared with the pinger thread): its id, the
/// RPC connection, the segment it mounts, and the pinger's stop flag and wake-up.
pub(super) struct MasterSession {
    pub(super) id: u64,
    pub(super) rpc: RpcClient,
    /// The engine whose descriptor peers need to reach this client's segment.
    pub(super) engine: Arc<Engine>,
    pub(super) segment: Option<SegmentInfo>,
    /// What this node's segment holds, for a master that lost its state.
    pub(super) catalog: Mutex<NodeCatalog>,
    /// The master's ticket for the segment's name, shown at every remount so that
    /// the name comes back to this node whoever took it meanwhile (none yet: default).
    pub(super) owner: Mutex<OwnerTicket>,
    /// The segment was drained and unmounted: never mount it again.
    pub(super) drained: AtomicBool,
    /// A drain runs (one at a time; a second caller waits for it).
    pub(super) draining: Mutex<()>,
    /// The drain the master asked for, running beside the cataloger.
    pub(super) drain_thread: Mutex<Option<JoinHandle<()>>>,
    /// Raised when the client closes: ends the pinger, the cataloger and drains.
    pub(super) stop: StopSignal,
    /// Descriptors kept within their leases, and the reads served from them.
    cache: ReplicaCache,
    /// Whether the master takes `Touch` and `GetReplicasKeepable`: `KEEPS_*`.
    keeps: AtomicU8,
    /// Segments lent besides the main one.
    pub(super) mounts: mounts::Mounts,
    /// Copy and move tasks, and the thread running them.
    tasks: tasks::Tasks,
    /// Reads of objects the master staged from a node's disk tier for them.
    disk_reads: AtomicU64,
}

/// Not asked yet (see `MasterSession::master_keeps`).
const KEEPS_UNKNOWN: u8 = 0;
const KEEPS_YES: u8 = 1;
/// An older master: keep no descriptors.
const KEEPS_NO: u8 = 2;

/// A store client: an engine for the bytes and an RPC channel to the master.
pub struct Client {
    config: ClientConfig,
    engine: Arc<Engine>,
    shared: Arc<MasterSession>,
    pinger: Option<JoinHandle<()>>,
    /// Keeps the segment's catalog (nodes only).
    cataloger: Option<JoinHandle<()>>,
    segment_ptr: Option<*mut u8>,
    /// Commits the segment's memory in the background (joined before it is freed).
    prefault: Option<prefault::Prefault>,
    /// Put and get sessions.
    sessions: sessions::Sessions,
}

// SAFETY: the raw segment pointer is only handed back to the engine that owns it.
unsafe impl Send for Client {}
// SAFETY: `segment_ptr` is only set at construction and taken in Drop (`&mut self`), so `&Client`
// never touches it; every other field is Sync.
unsafe impl Sync for Client {}

fn random_id() -> u64 {
    crate::sys::random_u64() | 1
}

impl Client {
    /// Starts the engine, connects to the master and mounts the global segment.
    pub fn new(config: ClientConfig) -> Result<Client> {
        let engine = Arc::new(Engine::new(config.engine.clone())?);
        Client::with_engine(config, engine)
    }

    /// A client moving bytes with an engine the caller also uses (Mooncake's
    /// `setup(..., engine=)`): its segment name and memory are the engine's, and
    /// `config.engine` is not used.
    pub fn with_engine(config: ClientConfig, engine: Arc<Engine>) -> Result<Client> {
        let rpc = RpcClient::new(
            &config.master_address,
            engine.config().cluster_secret.clone(),
        )?;
        let (segment, segment_ptr, ring, prefault) = if config.global_segment_size > 0 {
            let size = config.global_segment_size;
            // The note ring sits right after the segment, in the same registration,
            // outside what the pool allocates from.
            let slots = (size / NOTE_SLOTS_PER).clamp(MIN_NOTE_SLOTS, MAX_NOTE_SLOTS) as u32;
            let ring_bytes = slots as usize * NOTE_SLOT;
            let ptr = engine.allocate_buffer(size as usize + ring_bytes, "cpu:0")?;
            let info = SegmentInfo {
                name: engine.segment_name().to_owned(),
                base: ptr as u64,
                size,
            };
            let ring = NoteRing {
                addr: ptr as u64 + size,
                slots,
            };
            let prefault = config.prefault_segment.then(|| {
                // SAFETY: the buffer is ours, writable, and freed in Drop only after the
                // prefault is dropped (joined).
                unsafe { prefault::Prefault::start(ptr, size as usize + ring_bytes) }
            });
            (Some(info), Some(ptr), ring, prefault)
        } else {
            (None, None, NoteRing::default(), None)
        };
        let disk = match (&config.disk, &segment) {
            (Some(d), Some(_)) => Some(NodeDisk::open(d.clone())?),
            (Some(_), None) => {
                return Err(Error::invalid(
                    "a disk tier needs a segment to offload from (global_segment_size > 0)",
                ))
            }
            _ => None,
        };
        let shared = Arc::new(MasterSession {
            id: random_id(),
            rpc,
            engine: engine.clone(),
            segment,
            // SAFETY: the ring is the tail of this client's segment buffer, freed only
            // after the cataloger is joined, and written by nothing else than notes.
            catalog: Mutex::new(unsafe { NodeCatalog::new(disk, ring) }),
            owner: Mutex::new(OwnerTicket::default()),
            drained: AtomicBool::new(false),
            draining: Mutex::new(()),
            drain_thread: Mutex::new(None),
            stop: StopSignal::default(),
            cache: ReplicaCache::default(),
            keeps: AtomicU8::new(KEEPS_UNKNOWN),
            mounts: mounts::Mounts::default(),
            tasks: tasks::Tasks::default(),
            disk_reads: AtomicU64::new(0),
        });
        if shared.segment.is_none() {
            // A pure client mounts nothing; still, a master that cannot be reached is a
            // set-up error, as with Mooncake, not a surprise at the first put.
            shared.rpc.call(&Request::Stats)?;
        }
        match shared.register() {
            // A previous incarnation under the same name still holds it: the master
            // releases it after the client TTL, and the pinger remounts then.
            Err(e) if e.code() == Code::SegmentAlreadyExists => {
                log::warn!("{e}; will remount once the master releases the name");
            }
            other => other?,
        }
        let s = shared.clone();
        let interval = config.ping_interval;
        let pinger = std::thread::Builder::new()
            .name("mc-store-ping".into())
            .spawn(move || s.ping_loop(interval))
            .map_err(|e| Error::io("spawning pinger", e))?;
        let cataloger = match &shared.segment {
            Some(_) => {
                // Follow the segment's log before anyone can ask this node to read
                // from its disk tier (the first answer comes at once).
                shared.catalog_poll();
                let s = shared.clone();
                Some(
                    std::thread::Builder::new()
                        .name("mc-store-catalog".into())
                        .spawn(move || s.catalog_loop())
                        .map_err(|e| Error::io("spawning cataloger", e))?,
                )
            }
            None => None,
        };
        Ok(Client {
            config,
            engine,
            shared,
            pinger: Some(pinger),
            cataloger,
            segment_ptr,
            prefault,
            sessions: sessions::Sessions::default(),
        })
    }

    /// Drains this node before it leaves: no new object is placed on its segment,
    /// every object only it holds gets a replica on another node (written from this
    /// node's memory), then the segment is unmounted for good. Objects that found no
    /// place elsewhere are counted as lost.
    pub fn drain(&self) -> Result<DrainReport> {
        self.shared.drain()
    }

    /// The settings this client was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The transfer engine that moves this client's bytes.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Whether this node's segment was drained and unmounted (by `drain`, or as the
    /// master asked): it lends nothing any more.
    pub fn is_drained(&self) -> bool {
        self.shared.drained.load(Ordering::SeqCst)
    }

    /// This client's segment (and engine) name.
    pub fn hostname(&self) -> &str {
        self.engine.segment_name()
    }

    /// The client id the master knows this client by.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    fn call(&self, req: Request) -> Result<Response> {
        self.shared.call_with_touches(&req)
    }

    /// Whether descriptors are kept between gets.
    fn caching(&self) -> bool {
        self.config.cache_replicas && self.shared.master_keeps()
    }

    /// Descriptors kept now (for tests and benches).
    pub fn cached_descriptors(&self) -> usize {
        self.shared.cache.len()
    }

    /// How many reads got an object the master staged from a node's disk tier for
    /// them (Mooncake's offload RPC reads; counted when descriptors are kept, as they
    /// are by default).
    pub fn disk_reads(&self) -> u64 {
        self.shared.disk_reads.load(Ordering::Relaxed)
    }

    /// Stores `value` under `key`. Re-putting an existing key succeeds and leaves it
    /// unchanged (use `upsert` to replace).
    pub fn put(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> Result<()> {
        let parts = vec![(value.as_ptr() as u64, value.len() as u64)];
        // SAFETY: `value` is borrowed for the whole call, which waits for the transfer.
        one(unsafe { self.batch_put_from(&[key], &[parts], config, false) })
    }

    /// Replaces `key`'s value (refused while a reader holds its lease).
    pub fn upsert(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> Result<()> {
        let parts = vec![(value.as_ptr() as u64, value.len() as u64)];
        // SAFETY: `value` is a borrowed slice, readable for its length for the whole call, and
        // `batch_put_from` returns only after the transfer reading it is done.
        one(unsafe { self.batch_put_from(&[key], &[parts], config, true) })
    }

    /// Puts several keys, each from one or more local buffers (concatenated), in one
    /// round trip to the master and one engine batch. Per-key results.
    ///
    /// # Safety
    /// Every part must be readable for its length until the call returns.
    pub unsafe fn batch_put_from(
        &self,
        keys: &[&str],
        parts: &[Parts],
        config: &ReplicateConfig,
        upsert: bool,
    ) -> Vec<Result<()>> {
        if keys.len() != parts.len() {
            return keys
                .iter()
                .map(|_| Err(Error::invalid("keys and buffers differ in count")))
                .collect();
        }
        self.shared.cache.drop_keys(keys.iter().copied());
        let sizes: Vec<u64> = parts.iter().map(|p| p.iter().map(|x| x.1).sum()).collect();
        // The notes the master seals carry the checksums: computed before it is asked.
        let crcs: Vec<u32> = parts
            .iter()
            // SAFETY: the caller keeps the parts readable for the call.
            .map(|p| unsafe { crc_of(p) })
            .collect();
        let items = keys
            .iter()
            .zip(&sizes)
            .zip(&crcs)
            .map(|((k, s), c)| (k.to_string(), *s, *c))
            .collect();
        let answer = self.call(Request::PutStartNoted {
            client: self.shared.id,
            items,
            config: config.clone(),
            upsert,
        });
        let (started, notes) = match answer {
            Ok(Response::PutStartNoted(r)) if r.len() == keys.len() => {
                let mut notes = Vec::new();
                let started: Vec<KeyResult<Vec<ReplicaDesc>>> = r
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| {
                        r.map(|(reps, n)| {
                            notes.extend(n.into_iter().map(|n| (i, n)));
                            reps
                        })
                    })
                    .collect();
                (started, notes)
            }
            Ok(other) => {
                return all_err(
                    keys.len(),
                    Error::protocol(format!("unexpected answer {other:?}")),
                )
            }
            Err(e) => return all_err(keys.len(), e),
        };
        // One engine batch for every replica of every key being written.
        let mut plan = Vec::new();
        let mut results: Vec<Result<()>> = Vec::with_capacity(keys.len());
        for (i, r) in started.iter().enumerate() {
            results.push(match r {
                Ok(replicas) => {
                    for rep in replicas {
                        plan.push((i, rep));
                    }
                    Ok(())
                }
                // Immutable values: someone already stored (or is storing) this key.
                Err(Code::ObjectAlreadyExists) if !upsert => Ok(()),
                Err(code) => Err(Error::new(*code, format!("put {}", shown_key(keys[i])))),
            });
        }
        let frags: Vec<FragmentList> = parts.iter().map(|p| fragments(p)).collect();
        let outcome = self.move_replicas(Op::Write, &plan, &frags, None, &notes);
        let mut ends = Vec::new();
        let mut revokes = Vec::new();
        for (i, r) in started.iter().enumerate() {
            if r.is_err() {
                continue;
            }
            match &outcome[i] {
                Some(Ok(())) => ends.push((i, crcs[i])),
                Some(Err(e)) => {
                    results[i] = Err(e.clone());
                    revokes.push(keys[i].to_string());
                }
                None => {}
            }
        }
        if !revokes.is_empty() {
            if let Err(e) = self.call(Request::PutRevoke {
                client: self.shared.id,
                keys: revokes,
            }) {
                log::warn!("revoking failed puts: {e}");
            }
        }
        if !ends.is_empty() {
            let items = ends
                .iter()
                .map(|&(i, crc)| (keys[i].to_string(), crc))
                .collect();
            match self.call(Request::PutEnd {
                client: self.shared.id,
                items,
            }) {
                Ok(Response::PerKey(r)) if r.len() == ends.len() => {
                    for (&(i, _), res) in ends.iter().zip(r) {
                        if let Err(code) = res {
                            results[i] = Err(Error::new(
                                code,
                                format!("finishing put of {}", shown_key(keys[i])),
                            ));
                        }
                    }
                }
                Ok(other) => {
                    let e = Error::protocol(format!("unexpected PutEnd answer {other:?}"));
                    for &(i, _) in &ends {
                        results[i] = Err(e.clone());
                    }
                }
                Err(e) => {
                    for &(i, _) in &ends {
                        results[i] = Err(e.clone());
                    }
                }
            }
        }
        results
    }

    /// Moves every (key index, replica) in `plan` between local `frags` and the
    /// replicas in one engine batch, with the (key index, note) writes in `notes`.
    /// Per key: None if not in the plan, else whether every replica of it moved (and
    /// its notes landed). With `checksums` (reads of whole objects), each key's bytes
    /// are folded into its entry as they land (see `run_checksummed`).
    fn move_replicas<F: std::ops::Deref<Target = [(u64, u64, u64)]>>(
        &self,
        op: Op,
        plan: &[(usize, &ReplicaDesc)],
        frags: &[F],
        checksums: Option<&mut [Option<u32>]>,
        notes: &[(usize, NoteWrite)],
    ) -> Vec<Option<Result<()>>> {
        let mut outcome: Vec<Option<Result<()>>> = vec![None; frags.len()];
        // (One request per piece and key, mostly.)
        let mut reqs = Vec::with_capacity(plan.len() + notes.len());
        let mut owner = Vec::with_capacity(plan.len() + notes.len());
        let mut segments = SegmentIds::default();
        for (i, rep) in plan {
            let mut off = 0;
            for piece in &rep.pieces {
                let frags = &frags[*i];
                match scatter(
                    &mut segments,
                    &self.engine,
                    op,
                    frags,
                    off,
                    piece,
                    &mut reqs,
                ) {
                    Ok(n) => owner.extend(std::iter::repeat_n(*i, n)),
                    Err(e) => outcome[*i] = Some(Err(e)),
                }
                off += piece.len;
            }
            outcome[*i].get_or_insert(Ok(()));
        }
        for (i, note) in notes {
            match self.engine.open_segment(&note.segment) {
                Ok(segment) => {
                    owner.push(*i);
                    reqs.push(crate::engine::Request {
                        op: Op::Write,
                        local: note.bytes.as_ptr() as u64,
                        segment,
                        remote: note.addr,
                        len: note.bytes.len() as u64,
                    });
                }
                Err(e) => outcome[*i] = Some(Err(e)),
            }
        }
        if reqs.is_empty() {
            return outcome;
        }
        let states = match checksums {
            Some(crcs) => run_checksummed(&self.engine, &reqs, &owner, crcs),
            None => run_batch(&self.engine, &reqs),
        };
        for (task, i) in owner.iter().enumerate() {
            if let Err(e) = &states[task] {
                if matches!(outcome[*i], Some(Ok(()))) {
                    outcome[*i] = Some(Err(e.clone()));
                }
            }
        }
        outcome
    }

    /// True when `key` exists and is complete.
    pub fn exists(&self, key: &str) -> Result<bool> {
        one(self.batch_exists(&[key]))
    }

    /// Existence without taking a lease (probing never blocks eviction).
    pub fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        let req = Request::Exists {
            keys: keys.iter().map(|k| k.to_string()).collect(),
        };
        self.per_key(req, keys, "exists", |r| match r {
            Response::Exists(v) => Ok(v),
            other => Err(other),
        })
    }

    /// The object's size (takes a read lease, like Mooncake's).
    pub fn size(&self, key: &str) -> Result<u64> {
        self.describe(key).map(|(d, _)| d.size)
    }

    /// Where `key` lives: size, checksum and complete memory replicas (leased, like a
    /// read), and the segment whose node's disk tier holds a copy, if one does. Reads
    /// nothing back from disk.
    pub fn describe(&self, key: &str) -> Result<(ObjectDesc, Option<String>)> {
        let req = Request::Describe {
            keys: vec![key.to_owned()],
        };
        let mut disk = Vec::new();
        let desc = one(self.per_key(req, &[key], "describe", |r| match r {
            Response::Described { descs, disk: d } if d.len() == descs.len() => {
                disk = d;
                Ok(descs)
            }
            other => Err(other),
        }))?;
        Ok((desc, disk.pop().filter(|d| !d.is_empty())))
    }

    /// Removes several keys in one round trip; per-key results.
    pub fn batch_remove(&self, keys: &[&str], force: bool) -> Vec<Result<()>> {
        self.shared.cache.drop_keys(keys.iter().copied());
        self.done_per_key(
            Request::RemoveKeys {
                keys: keys.iter().map(|k| k.to_string()).collect(),
                force,
            },
            keys,
            "remove",
        )
    }

    /// Drops the replicas of several keys on `segment` (every replica when it is
    /// empty); per key whether something was dropped. Objects being written or read,
    /// and keys with no replica there, are left alone (`false`).
    pub fn batch_replica_clear(&self, keys: &[&str], segment: &str) -> Vec<Result<bool>> {
        self.shared.cache.drop_keys(keys.iter().copied());
        let req = Request::ReplicaClear {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            segment: segment.to_owned(),
        };
        self.done_per_key(req, keys, "replica clear")
            .into_iter()
            .map(|r| match r {
                Ok(()) => Ok(true),
                Err(e) => match e.code() {
                    Code::ObjectNotFound
                    | Code::ObjectHasLease
                    | Code::ReplicaIsNotReady
                    | Code::SegmentNotFound => Ok(false),
                    _ => Err(e),
                },
            })
            .collect()
    }

    /// Sends a request answered per key (`pick` takes the per-key answers out of the
    /// response, or gives it back when it is of the wrong kind) and names each failure
    /// after `what` and its key.
    fn per_key<T>(
        &self,
        req: Request,
        keys: &[&str],
        what: &str,
        pick: impl FnOnce(Response) -> std::result::Result<Vec<KeyResult<T>>, Response>,
    ) -> Vec<Result<T>> {
        let answers = match self.call(req).map(pick) {
            Ok(Ok(v)) if v.len() == keys.len() => v,
            Ok(Ok(v)) => {
                let e = format!("{} answers for {} keys", v.len(), keys.len());
                return all_err(keys.len(), Error::protocol(e));
            }
            Ok(Err(other)) => {
                let e = Error::protocol(format!("unexpected answer {other:?}"));
                return all_err(keys.len(), e);
            }
            Err(e) => return all_err(keys.len(), e),
        };
        answers
            .into_iter()
            .zip(keys)
            .map(|(r, k)| r.map_err(|c| Error::new(c, format!("{what} {}", shown_key(k)))))
            .collect()
    }

    /// [`Client::per_key`] for requests answered `Ok` or a code per key.
    fn done_per_key(&self, req: Request, keys: &[&str], what: &str) -> Vec<Result<()>> {
        self.per_key(req, keys, what, |r| match r {
            Response::PerKey(v) => Ok(v),
            other => Err(other),
        })
    }

    /// Whether the master answers.
    pub fn health(&self) -> Result<()> {
        // At once: a health check must not wait out an absent master.
        self.shared.rpc.call_now(&Request::Stats).map(drop)
    }

    /// Removes `key` (even when leased, with `force`).
    pub fn remove(&self, key: &str, force: bool) -> Result<()> {
        self.shared.cache.drop_keys([key]);
        self.call(Request::Remove {
            key: key.to_owned(),
            force,
        })
        .map(|_| ())
    }

    /// Removes every object (leased ones too, with `force`); returns how many.
    pub fn remove_all(&self, force: bool) -> Result<u64> {
        self.shared.cache.clear();
        count(self.call(Request::RemoveAll { force }))
    }

    /// Removes the objects whose key matches `pattern`; returns how many.
    pub fn remove_by_regex(&self, pattern: &str, force: bool) -> Result<u64> {
        self.shared.cache.clear();
        count(self.call(Request::RemoveByRegex {
            pattern: pattern.to_owned(),
            force,
        }))
    }

    /// The master's pool statistics.
    pub fn stats(&self) -> Result<PoolStats> {
        match self.call(Request::Stats)? {
            Response::Stats(s) => Ok(s),
            other => Err(Error::protocol(format!("unexpected answer {other:?}"))),
        }
    }

    /// Registers a buffer for zero-copy puts and gets (required by RDMA transports;
    /// harmless otherwise).
    ///
    /// # Safety
    /// As `Engine::register_memory`.
    pub unsafe fn register_buffer(&self, addr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: this fn's contract is `Engine::register_memory`'s: the caller keeps `[addr,
        // addr+len)` valid, and open to peer access, until it is unregistered.
        unsafe { self.engine.register_memory(addr, len, "cpu:0") }
    }

    /// Unregisters a buffer registered with `register_buffer`.
    pub fn unregister_buffer(&self, addr: *mut u8) -> Result<()> {
        self.engine.unregister_memory(addr)
    }
}

impl MasterSession {
    /// `req`, with the queued touches (if any) pipelined ahead of it: one round trip.
    pub(crate) fn call_with_touches(&self, req: &Request) -> Result<Response> {
        self.call_encoded(req.method(), &req.payload(), &mut || {})
    }

    /// A lookup of `keys` for a reader that keeps descriptors (`GetReplicasKeepable`),
    /// its payload written straight from them, as `call_with_touches` sends a request;
    /// `meanwhile` runs once while the master works on it (see
    /// `RpcClient::call_meanwhile`).
    pub(crate) fn lookup(&self, keys: &[&str], meanwhile: &mut dyn FnMut()) -> Result<Response> {
        let mut w = Writer::new();
        Lookup::encode(keys, &mut w);
        self.call_encoded(Lookup::method(true), &w.into_bytes(), meanwhile)
    }

    /// A request given encoded, with the queued touches (if any) pipelined ahead.
    fn call_encoded(
        &self,
        method: u16,
        payload: &[u8],
        meanwhile: &mut dyn FnMut(),
    ) -> Result<Response> {
        let batches = self.cache.take_touches();
        // Touches are only queued once `master_keeps` found the master takes them.
        let touches = (!batches.is_empty()).then_some(Request::Touch { batches });
        self.rpc
            .call_meanwhile(touches.as_ref(), method, payload, meanwhile)
    }

    /// Whether the master takes `Touch` and `GetReplicasKeepable`, asked once with an
    /// empty touch: an older master drops the connection on a method it does not know
    /// (and then answers one it knows), and then no descriptors are kept.
    fn master_keeps(&self) -> bool {
        match self.keeps.load(Ordering::Relaxed) {
            KEEPS_YES => return true,
            KEEPS_NO => return false,
            _ => {}
        }
        match self.rpc.call(&Request::Touch {
            batches: Vec::new(),
        }) {
            Ok(_) => {
                self.keeps.store(KEEPS_YES, Ordering::Relaxed);
                true
            }
            Err(e) if self.rpc.call(&Request::Stats).is_ok() => {
                log::warn!("the master does not take touches ({e}); not keeping descriptors");
                self.keeps.store(KEEPS_NO, Ordering::Relaxed);
                false
            }
            Err(_) => false, // the master is away: ask again next time
        }
    }

    /// Sends the queued touches now.
    fn flush_touches(&self) {
        let batches = self.cache.take_touches();
        if !batches.is_empty() {
            self.send_touches(&Request::Touch { batches });
        }
    }

    fn send_touches(&self, touch: &Request) {
        if let Err(e) = self.rpc.call(touch) {
            log::debug!("touches not sent: {e}");
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shared.flush_touches();
        self.shared.stop.raise();
        if let Some(p) = &self.prefault {
            // It ends while the rest winds down; joined before the segment goes.
            p.stop_soon();
        }
        if let Some(p) = self.pinger.take() {
            let _ = p.join();
        }
        // A copy in progress reads and writes through the engine: let it end first.
        self.shared.tasks.stop();
        self.shared.reap_extras(true);
        if let Some(seg) = self
            .shared
            .segment
            .as_ref()
            .filter(|_| !self.shared.drained.load(Ordering::SeqCst))
        {
            // The unmount also ends the cataloger's poll at once.
            if let Err(e) = self.shared.rpc.call(&Request::Unmount {
                client: self.shared.id,
                name: seg.name.clone(),
            }) {
                log::debug!("unmount on close: {e}");
            }
        }
        if let Some(c) = self.cataloger.take() {
            let _ = c.join();
        }
        // It reads the segment, which goes below: it stops at its next chunk.
        let drain = self.shared.drain_thread.locked().take();
        if let Some(d) = drain {
            let _ = d.join();
        }
        // It writes page tables of the segment's mapping: it ends before that goes.
        drop(self.prefault.take());
        if let Some(ptr) = self.segment_ptr.take() {
            let _ = self.engine.free_buffer(ptr);
        }
    }
}

/// The engine's handles of the segments a plan names, the last one remembered: a
/// batch's pieces mostly name one segment (one shared string per answer), and opening
/// it by name hashes the name under a lock each time.
#[derive(Default)]
pub(super) struct SegmentIds(Option<(Arc<str>, crate::engine::SegmentId)>);

impl SegmentIds {
    /// The handle of segment `name`, opened when it is not the last one asked for.
    fn of(&mut self, engine: &Engine, name: &Arc<str>) -> Result<crate::engine::SegmentId> {
        if let Some((last, id)) = &self.0 {
            if Arc::ptr_eq(last, name) || **last == **name {
                return Ok(*id);
            }
        }
        let id = engine.open_segment(name)?;
        self.0 = Some((name.clone(), id));
        Ok(id)
    }
}

/// Appends to `out` the engine requests moving the value bytes `[off, off+piece.len)`
/// that `frags` cover; how many (none appended on error).
pub(super) fn scatter(
    segments: &mut SegmentIds,
    engine: &Engine,
    op: Op,
    frags: &[(u64, u64, u64)],
    off: u64,
    piece: &Piece,
    out: &mut Vec<crate::engine::Request>,
) -> Result<usize> {
    let segment = segments.of(engine, &piece.segment)?;
    let before = out.len();
    for &(start, addr, len) in frags {
        let lo = off.max(start);
        let hi = (off + piece.len).min(start + len);
        if lo < hi {
            out.push(crate::engine::Request {
                op,
                local: addr + (lo - start),
                segment,
                remote: piece.addr + (lo - off),
                len: hi - lo,
            });
        }
    }
    Ok(out.len() - before)
}

/// Runs requests as one batch; a result per request.
pub(super) fn run_batch(engine: &Engine, reqs: &[crate::engine::Request]) -> Vec<Result<()>> {
    // SAFETY: the callers' buffers outlive this call, which returns only when no task
    // can touch them any more. Small batches run on this thread (no worker hand-off).
    match unsafe { engine.transfer_sync_states(reqs) } {
        Ok(states) => states
            .into_iter()
            .map(|s| match s {
                TaskState::Completed => Ok(()),
                s => Err(Error::new(Code::TransferFail, format!("task ended {s:?}"))),
            })
            .collect(),
        Err(e) => vec![Err(e); reqs.len()],
    }
}

/// Runs `reqs` (reads; `owner[t]` is the key of request `t`, a key's requests in the
/// order of its bytes) as one checksummed engine batch, joining each completed
/// request's CRC32C onto its key's entry of `crcs`. An entry becomes `None` when part
/// of the key went into device memory that no host copy passed through (nothing to
/// verify it with). A result per request.
fn run_checksummed(
    engine: &Engine,
    reqs: &[crate::engine::Request],
    owner: &[usize],
    crcs: &mut [Option<u32>],
) -> Vec<Result<()>> {
    // SAFETY: the callers' buffers outlive this call, which returns only when no task
    // can touch them any more.
    let states = match unsafe { engine.read_checksummed(reqs) } {
        Ok(states) => states,
        Err(e) => return vec![Err(e); reqs.len()],
    };
    let mut results = Vec::with_capacity(reqs.len());
    for ((r, &key), (state, crc)) in reqs.iter().zip(owner).zip(states) {
        results.push(match state {
            TaskState::Completed => {
                crcs[key] = crcs[key].zip(crc).map(|(a, b)| crc32c_combine(a, b, r.len));
                Ok(())
            }
            s => Err(Error::new(Code::TransferFail, format!("task ended {s:?}"))),
        });
    }
    results
}

/// The positions in `0..n` where `holds` is true, in order. The vector is sized once,
/// from the first position found (a filtered range collected grows it step by step,
/// a cost a batch pays per call); none found, nothing is allocated.
fn positions(n: usize, holds: impl Fn(usize) -> bool) -> Vec<usize> {
    let Some(first) = (0..n).find(|&i| holds(i)) else {
        return Vec::new();
    };
    let mut found = Vec::with_capacity(n - first);
    found.push(first);
    found.extend((first + 1..n).filter(|&i| holds(i)));
    found
}

fn all_err<T>(n: usize, e: Error) -> Vec<Result<T>> {
    (0..n).map(|_| Err(e.clone())).collect()
}

fn one<T>(mut v: Vec<Result<T>>) -> Result<T> {
    v.pop()
        .unwrap_or_else(|| Err(Error::new(Code::Internal, "empty batch result")))
}

fn count(r: Result<Response>) -> Result<u64> {
    match r? {
        Response::Count(n) => Ok(n),
        other => Err(Error::protocol(format!("unexpected answer {other:?}"))),
    }
}

/// CRC32C over all parts in order.
///
/// # Safety
/// Every part must be readable.
unsafe fn crc_of(parts: &Parts) -> u32 {
    parts
        .iter()
        .filter(|p| p.1 > 0)
        .fold(0, |crc, &(addr, len)| {
            // SAFETY: the caller guarantees every part is readable for its length, and
            // empty parts (whose address may be anything) are skipped, so `addr` is a
            // valid pointer to `len` bytes.
            crc32c_append(crc, unsafe {
                std::slice::from_raw_parts(addr as *const u8, len as usize)
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_found_in_order_in_one_allocation_or_none() {
        let odd = positions(9, |i| i % 2 == 1);
        assert_eq!(odd, [1, 3, 5, 7]);
        // Room for every position from the first one found: never grown.
        assert_eq!(odd.capacity(), 8);
        let none = positions(64, |_| false);
        assert!(none.is_empty() && none.capacity() == 0);
        assert_eq!(positions(3, |_| true), [0, 1, 2]);
        assert!(positions(0, |_| true).is_empty());
    }

    #[test]
    fn metadata_url_takes_the_masters_host_when_local() {
        let m = "10.1.2.3:50051";
        assert_eq!(
            reachable_metadata_url("http://127.0.0.1:8081/metadata", m),
            "http://10.1.2.3:8081/metadata"
        );
        assert_eq!(
            reachable_metadata_url("http://[::1]:9000/metadata", "[fd00::5]:1"),
            "http://[fd00::5]:9000/metadata"
        );
        // A routable host, or a URL without a port, is kept as it is.
        let kept = "http://meta.example:8080/metadata";
        assert_eq!(reachable_metadata_url(kept, m), kept);
        assert_eq!(
            reachable_metadata_url("http://127.0.0.1/metadata", m),
            "http://127.0.0.1/metadata"
        );
        assert_eq!(
            reachable_metadata_url("http://127.0.0.1:8080/metadata", "127.0.0.1:50051"),
            "http://127.0.0.1:8080/metadata"
        );
    }
}
