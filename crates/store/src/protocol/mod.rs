//! Messages between store clients and the master; their bytes on the wire are in
//! `wire` (over `codec`). Every per-key operation is a batch: a single call is a batch
//! of one.

#![forbid(unsafe_code)]

pub mod note;
mod wire;

pub use wire::{
    encode_desc, encode_failed, encode_found, encode_replicas_of, KeyedAnswers, Lookup,
};

pub use note::{NoteKey, NotePlace, NoteRing, NoteWrite, NOTE_KEY_LEN, NOTE_SLOT};

use super::codec::{Reader, Writer};
use crate::error::{Code, Error, Result};
pub use crate::util::SmallList;
use std::sync::Arc;

/// Bumped on any incompatible change to these messages.
pub const PROTOCOL_VERSION: u16 = 1;
/// Keys longer than this are refused (`INVALID_KEY`).
pub const MAX_KEY_LEN: usize = 4096;

/// How an object is to be stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicateConfig {
    /// Copies on distinct segments; best effort (fewer when space lacks, at least 1).
    pub replica_num: u32,
    /// Never evicted.
    pub hard_pin: bool,
    /// Evicted only after every unpinned object, until `soft_pin_ttl_ms` passes.
    pub soft_pin: bool,
    /// Soft pin lifetime in milliseconds.
    pub soft_pin_ttl_ms: u64,
    /// Segments to try first, in order.
    pub preferred_segments: Vec<String>,
    /// Put a replica in the writer's own segment first.
    pub prefer_same_node: bool,
    /// Objects that share lease and eviction fate.
    pub group_ids: Vec<String>,
}

/// Mooncake's default soft-pin TTL (30 min) and its ceiling (24 h).
pub const DEFAULT_SOFT_PIN_TTL_MS: u64 = 30 * 60 * 1000;
/// Ceiling for `soft_pin_ttl_ms`.
pub const MAX_SOFT_PIN_TTL_MS: u64 = 24 * 60 * 60 * 1000;

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig {
            replica_num: 1,
            hard_pin: false,
            soft_pin: false,
            soft_pin_ttl_ms: DEFAULT_SOFT_PIN_TTL_MS,
            preferred_segments: Vec::new(),
            prefer_same_node: false,
            group_ids: Vec::new(),
        }
    }
}

/// A contiguous range of a node's memory: `len` bytes at absolute `addr` of `segment`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The segment holding the bytes (shared: a batch's descriptors name a few
    /// segments many times).
    pub segment: Arc<str>,
    /// Absolute address in that segment.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One copy of an object: its pieces, in order, concatenate to the value (one piece
/// unless the object is striped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaDesc {
    /// The pieces, in order; together they hold the whole value.
    pub pieces: SmallList<Piece>,
}

impl AsRef<[Piece]> for ReplicaDesc {
    fn as_ref(&self) -> &[Piece] {
        &self.pieces
    }
}

/// What a reader needs: size, checksum, complete replicas, and how long its lease lasts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectDesc {
    /// Value size in bytes.
    pub size: u64,
    /// CRC32C of the whole value.
    pub crc32c: u32,
    /// How long the reader's lease lasts, in milliseconds.
    pub lease_ms: u64,
    /// The complete replicas.
    pub replicas: SmallList<ReplicaDesc>,
}

/// A node's memory lent to the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// The transfer-engine segment name the bytes are reached through.
    pub name: String,
    /// Absolute start address of the space lent to the pool.
    pub base: u64,
    /// Length of that space in bytes.
    pub size: u64,
}

/// What a node knows of one object piece in its segment, so that a master that lost
/// its state (restart, failover) can take the object back without moving a byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogEntry {
    /// The object's key.
    pub key: String,
    /// The put that wrote it: a later put of the same key has a larger version.
    pub version: u64,
    /// Value size in bytes.
    pub size: u64,
    /// CRC32C of the whole value.
    pub crc32c: u32,
    /// Never evicted.
    pub hard_pin: bool,
    /// The whole replica this piece belongs to, in value order.
    pub replica: ReplicaDesc,
    /// Which of `replica.pieces` lies in the node's segment.
    pub index: u32,
}

impl CatalogEntry {
    /// This entry's piece (the one in the node's segment).
    pub fn piece(&self) -> Option<&Piece> {
        self.replica.pieces.get(self.index as usize)
    }

    /// About how many bytes the entry takes on the wire (for sizing messages).
    pub fn wire_size(&self) -> usize {
        let pieces: usize = self
            .replica
            .pieces
            .iter()
            .map(|p| p.segment.len() + 24)
            .sum();
        self.key.len() + 48 + pieces
    }
}

/// A master's word that a segment name is its holder's since `issued_ms` (Unix
/// milliseconds): the node keeps it and shows it at every remount, and the name goes
/// to whoever shows the earliest valid one (see `Request::Remount`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerTicket {
    /// When the name was first mounted under this ticket (0: the node has none yet).
    pub issued_ms: u64,
    /// Tells apart tickets issued in the same millisecond.
    pub nonce: u64,
    /// The master's MAC over the segment name, `issued_ms` and `nonce`.
    pub mac: u64,
}

impl OwnerTicket {
    fn encode(&self, w: &mut Writer) {
        w.u64(self.issued_ms).u64(self.nonce).u64(self.mac);
    }

    fn decode(r: &mut Reader) -> Result<OwnerTicket> {
        Ok(OwnerTicket {
            issued_ms: r.u64()?,
            nonce: r.u64()?,
            mac: r.u64()?,
        })
    }
}

/// An object a node keeps in its disk tier (as it announces it to a master).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskEntry {
    /// The object's key.
    pub key: String,
    /// The put that wrote it.
    pub version: u64,
    /// Value size in bytes.
    pub size: u64,
    /// CRC32C of the value.
    pub crc32c: u32,
}

/// One change to a segment's catalog, in the master's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CatalogEvent {
    /// An object piece was committed at `entry.piece().addr`.
    Commit(CatalogEntry),
    /// The piece at this address is gone (removed, evicted, replaced).
    Free(u64),
    /// The object at this address was evicted from memory: keep it in the disk tier
    /// (before acknowledging: the space is reused only then).
    Offload(u64),
    /// Read the disk tier's copy of `key` (`version`) into memory at `pieces` (before
    /// acknowledging; a copy that cannot be read is reported lost).
    Load {
        /// The object.
        key: String,
        /// The version the master expects.
        version: u64,
        /// Where the value goes in the node's segment, in value order, as
        /// `(addr, len)`: one piece, or several for an object larger than a block.
        pieces: Vec<(u64, u64)>,
    },
    /// In a reset's snapshot: the disk tier's copy of `key` is the object's (copies
    /// the snapshot does not name by its end are dropped).
    Keep(String),
    /// Drop the disk tier's copy of `key` if it is of `version` (the object was
    /// removed or replaced).
    Forget {
        /// The object.
        key: String,
        /// The version whose copy goes (a later one stays).
        version: u64,
    },
    /// The note of this lend of a slot of the node's ring is consumed (its commit is
    /// above, or its put was dropped): clear it, and open no note of that lend or an
    /// earlier one in the slot again.
    Unnote {
        /// The slot.
        slot: u32,
        /// The lend (see `note::NotePlace`).
        lend: u64,
    },
}

/// The master's answer to `SegmentEvents`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentEvents {
    /// The master incarnation the sequence numbers belong to.
    pub instance: u64,
    /// The catalog starts over: the events from here on list the segment's every
    /// object (then what changed since); entries they have not named by
    /// `snapshot_end` are gone.
    pub reset: bool,
    /// With `reset`: the sequence number by which the snapshot is complete.
    pub snapshot_end: u64,
    /// The segment is draining: its node moves every object only it holds elsewhere
    /// (`Relocate`), then unmounts.
    pub draining: bool,
    /// Sequence number of the last event here (acknowledge it with the next call).
    pub last: u64,
    /// The changes, oldest first.
    pub events: Vec<CatalogEvent>,
    /// With `reset`, to a node that keeps a note ring: the key this epoch's notes are
    /// sealed with (the epoch is `last`). Sent after `events`.
    pub note_key: Option<NoteKey>,
}

/// Pool-wide figures the master reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Mounted segments.
    pub segments: u64,
    /// Bytes lent to the pool.
    pub capacity: u64,
    /// Bytes allocated to objects.
    pub used: u64,
    /// Objects stored.
    pub objects: u64,
    /// Objects evicted since start.
    pub evicted_objects: u64,
    /// Bytes evicted since start.
    pub evicted_bytes: u64,
}

/// A client → master RPC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Keep-alive; the answer says whether to remount.
    Ping {
        /// The calling client.
        client: u64,
    },
    /// Lends a segment to the pool.
    Mount {
        /// The calling client.
        client: u64,
        /// The segment lent.
        segment: SegmentInfo,
    },
    /// Takes a segment back.
    Unmount {
        /// The calling client.
        client: u64,
        /// The segment's name.
        name: String,
    },
    /// Allocates replicas for each `(key, size)`; per-key placements.
    PutStart {
        /// The calling client.
        client: u64,
        /// `(key, size)` pairs.
        items: Vec<(String, u64)>,
        /// Replication and pinning.
        config: ReplicateConfig,
        /// Overwrite existing keys instead of failing them.
        upsert: bool,
    },
    /// As `PutStart`, for values whose checksums the writer knows before it writes:
    /// each placement comes with the sealed commit notes the writer puts beside the
    /// bytes (`note`), and the put's `PutEnd` then need not wait for the nodes.
    PutStartNoted {
        /// The calling client.
        client: u64,
        /// `(key, size, crc32c)` triples.
        items: Vec<(String, u64, u32)>,
        /// Replication and pinning.
        config: ReplicateConfig,
        /// Overwrite existing keys instead of failing them.
        upsert: bool,
    },
    /// Marks each `(key, crc32c)` written and readable.
    PutEnd {
        /// The calling client.
        client: u64,
        /// `(key, crc32c)` pairs.
        items: Vec<(String, u32)>,
    },
    /// Abandons puts started but not finished.
    PutRevoke {
        /// The calling client.
        client: u64,
        /// Keys whose put is abandoned.
        keys: Vec<String>,
    },
    /// Looks up each key's replicas and takes a read lease.
    GetReplicas {
        /// Keys to look up.
        keys: Vec<String>,
    },
    /// Whether each key exists and is complete.
    Exists {
        /// Keys to check.
        keys: Vec<String>,
    },
    /// Removes one key.
    Remove {
        /// The key.
        key: String,
        /// Remove even when leased.
        force: bool,
    },
    /// Removes every object; answers how many.
    RemoveAll {
        /// Remove leased objects too.
        force: bool,
    },
    /// Removes the keys matching a regex; answers how many.
    RemoveByRegex {
        /// The regex.
        pattern: String,
        /// Remove leased objects too.
        force: bool,
    },
    /// Pool statistics.
    Stats,
    /// Removes each key (leased ones only with `force`); per-key results.
    RemoveKeys {
        /// Keys to remove.
        keys: Vec<String>,
        /// Remove even when leased.
        force: bool,
    },
    /// Drops the replicas of each key on `segment` (every replica when empty); per key
    /// `Ok` when something was dropped.
    ReplicaClear {
        /// Keys whose replicas go.
        keys: Vec<String>,
        /// The segment to clear them from (empty: all).
        segment: String,
    },
    /// The URL of the metadata service the master's nodes publish to (its embedded
    /// server). Added within protocol version 1: an older master closes the connection.
    MetadataUrl,
    /// Mounts a segment that already holds objects (after the master lost its state):
    /// the node's catalog, in chunks; the segment is mounted with those objects at the
    /// `last` one.
    Remount {
        /// The calling client.
        client: u64,
        /// The segment lent.
        segment: SegmentInfo,
        /// A chunk of the node's catalog.
        entries: Vec<CatalogEntry>,
        /// A chunk of what the node's disk tier holds.
        disk: Vec<DiskEntry>,
        /// This is the final chunk.
        last: bool,
        /// The node's ticket for the segment's name (a default one: none yet), which
        /// the answer to the last chunk renews (`Response::Mounted`); `None` from a
        /// node that predates tickets (then the answer is `Done`). Added within
        /// protocol version 1, after `last`.
        owner: Option<OwnerTicket>,
    },
    /// Waits (briefly) for changes to a segment's catalog, acknowledging those up to
    /// `acked` of master `instance` (0: none yet; the answer then resets the catalog).
    SegmentEvents {
        /// The calling client (the segment's owner).
        client: u64,
        /// The segment.
        segment: String,
        /// The master incarnation `acked` counts in.
        instance: u64,
        /// The last event applied.
        acked: u64,
        /// Bytes of the node's disk tier (0: none): evicted objects may go there.
        disk_capacity: u64,
        /// Keys whose disk-tier copy is gone (evicted there, corrupt, unreadable).
        lost: Vec<String>,
        /// The node's note ring (no slots: none). Sent after `lost`, by nodes that
        /// keep one.
        ring: NoteRing,
    },
    /// Stops placing anything new on a segment of the caller's, before it leaves.
    Drain {
        /// The calling client (the segment's owner).
        client: u64,
        /// The segment.
        segment: String,
    },
    /// For each key with no replica outside the draining `segment`: a new replica's
    /// place elsewhere (empty when the object is safe already).
    Relocate {
        /// The calling client (the segment's owner).
        client: u64,
        /// The draining segment.
        segment: String,
        /// Objects with a piece in it.
        keys: Vec<String>,
    },
    /// Ends relocations: each `(key, moved)` whose bytes were (or were not) written to
    /// the place `Relocate` gave; a moved replica replaces the one in the segment.
    RelocateEnd {
        /// The calling client.
        client: u64,
        /// The draining segment.
        segment: String,
        /// Keys and whether their bytes moved.
        items: Vec<(String, bool)>,
    },
    /// Reads a client served from descriptors it kept (see `replica_cache`), so the
    /// master's eviction order still counts them: each inner list is one read batch's
    /// keys in batch order. Takes no lease; unknown keys are skipped.
    Touch {
        /// Keys, per read batch, in batch order.
        batches: Vec<Vec<String>>,
    },
    /// `GetReplicas`, also saying per key whether the descriptor may be kept for the
    /// lease (not for a copy staged from disk for this reader, whose reads the master
    /// must count).
    GetReplicasKeepable {
        /// The keys, as for `GetReplicas`.
        keys: Vec<String>,
    },
    /// Lends one more segment of the caller's besides its main one (memory its engine
    /// registered later). `id` names the segment in the master, unique in the pool
    /// (`Unmount` and `Drain` take it); `segment.name` is the engine segment pieces on
    /// it are reached through, which the caller's other segments share.
    MountExtra {
        /// The calling client.
        client: u64,
        /// The segment's id in the master.
        id: String,
        /// Where it is and how large.
        segment: SegmentInfo,
    },
    /// Starts copying `key` onto the segments named `targets`: a new replica is placed on
    /// each that holds none, and the object is leased while the caller copies. With a
    /// `source` (a move; one target) the copy reads the replica on that segment, which
    /// `CopyEnd` then drops; without one, any replica.
    CopyStart {
        /// The calling client.
        client: u64,
        /// The object.
        key: String,
        /// The segment a move takes the object from; empty for a copy.
        source: String,
        /// The segments to place it on.
        targets: Vec<String>,
    },
    /// Ends the copy `ticket` of `CopyStart`: `done` when its bytes reached every placed
    /// replica, which then joins the object (the object unchanged meanwhile); else their
    /// space goes.
    CopyEnd {
        /// The calling client.
        client: u64,
        /// The copy, as `CopyStart` answered.
        ticket: u64,
        /// The bytes moved.
        done: bool,
    },
    /// The caller finished reading copies staged from a disk tier for it (a
    /// `GetReplicasKeepable` answer not keepable): their space is free again now
    /// rather than at the end of the read lease. Copies not staged are not touched.
    ReleaseStaged {
        /// Each copy: the key, and the address of its replica's first piece.
        items: Vec<(String, u64)>,
    },
    /// Where each key's replicas are, memory and disk tier, without reading anything
    /// back (`get_replica_desc`); leases the memory replicas as `GetReplicas` does.
    Describe {
        /// The keys.
        keys: Vec<String>,
    },
}

/// The master's answer to `CopyStart`: what to read and where to write it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyPlan {
    /// Names this copy in `CopyEnd`.
    pub ticket: u64,
    /// Value size in bytes.
    pub size: u64,
    /// CRC32C of the value (the copy is checked against it).
    pub crc32c: u32,
    /// The replica to read.
    pub source: ReplicaDesc,
    /// The new replicas to write, one per target that held none.
    pub targets: Vec<ReplicaDesc>,
}

/// Result of one key in a batch: `Ok` or a store code.
pub type KeyResult<T> = std::result::Result<T, Code>;

/// The master's answer to a [`Request`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// Answer to `Ping`.
    Ping {
        /// The master lost this client's segments: mount them again.
        need_remount: bool,
    },
    /// Success with nothing to report.
    Done,
    /// A remount's last chunk was taken: the ticket to show at the next one (to a
    /// request that carried one; others get `Done`).
    Mounted(OwnerTicket),
    /// Per key: where to write its replicas.
    PutStart(Vec<KeyResult<Vec<ReplicaDesc>>>),
    /// Per key: where to write its replicas, and the notes to write beside them (none
    /// when the put has to wait for the nodes' catalogs instead).
    PutStartNoted(Vec<KeyResult<(Vec<ReplicaDesc>, Vec<NoteWrite>)>>),
    /// Per key: success or the code it failed with.
    PerKey(Vec<KeyResult<()>>),
    /// Per key: the object's descriptor.
    GetReplicas(Vec<KeyResult<ObjectDesc>>),
    /// Per key: whether it exists.
    Exists(Vec<KeyResult<bool>>),
    /// How many objects an operation affected.
    Count(u64),
    /// Pool statistics.
    Stats(PoolStats),
    /// Empty when the master runs no metadata server.
    MetadataUrl(String),
    /// Answer to `SegmentEvents`.
    SegmentEvents(SegmentEvents),
    /// The answer to `GetReplicasKeepable`: `GetReplicas`' answer, then per key
    /// whether the descriptor may be kept.
    Keepable {
        /// As `GetReplicas`.
        descs: Vec<KeyResult<ObjectDesc>>,
        /// Per key: may be kept for its lease.
        keepable: Vec<bool>,
    },
    /// Answer to `CopyStart`.
    CopyStart(CopyPlan),
    /// The answer to `Describe`: per key its memory replicas (possibly none), then
    /// per key the segment whose node's disk tier holds a copy ("" for none).
    Described {
        /// As `GetReplicas`, without reading anything back.
        descs: Vec<KeyResult<ObjectDesc>>,
        /// Per key: the disk tier's segment, or "".
        disk: Vec<String>,
    },
}

/// Declares the master's RPC methods once: each one's number on the wire and the
/// `Request` variant that carries it. `Method` and `Request::kind` follow from it; the
/// codecs match on the names, never on numbers.
macro_rules! rpc_methods {
    ($($number:literal => $name:ident,)*) => {
        /// A master RPC method (a frame's method field).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum Method {
            $(#[doc = concat!("Carries `Request::", stringify!($name), "`.")]
            $name = $number,)*
        }

        impl Method {
            /// The method a frame's number names, if any.
            pub fn from_wire(number: u16) -> Option<Method> {
                match number {
                    $($number => Some(Method::$name),)*
                    _ => None,
                }
            }
        }

        impl Request {
            /// The method this request travels as.
            pub fn kind(&self) -> Method {
                match self {
                    $(Request::$name { .. } => Method::$name,)*
                }
            }
        }
    };
}

rpc_methods! {
    1 => Ping,
    2 => Mount,
    3 => Unmount,
    4 => PutStart,
    5 => PutEnd,
    6 => PutRevoke,
    7 => GetReplicas,
    8 => Exists,
    9 => Remove,
    10 => RemoveAll,
    11 => RemoveByRegex,
    12 => Stats,
    13 => RemoveKeys,
    14 => ReplicaClear,
    15 => MetadataUrl,
    16 => Remount,
    17 => SegmentEvents,
    18 => Drain,
    19 => Relocate,
    20 => RelocateEnd,
    21 => Touch,
    22 => GetReplicasKeepable,
    23 => MountExtra,
    24 => CopyStart,
    25 => CopyEnd,
    26 => ReleaseStaged,
    27 => Describe,
    28 => PutStartNoted,
}

/// The most bytes of a key that error and log text shows.
pub const SHOWN_KEY_BYTES: usize = 128;

/// A key for error and log text: quoted, and cut to its first `SHOWN_KEY_BYTES` bytes
/// (at a character boundary) with a note of its full length when longer, so a rejected
/// multi-megabyte key does not flood the log.
pub fn shown_key(key: &str) -> String {
    if key.len() <= SHOWN_KEY_BYTES {
        return format!("{key:?}");
    }
    let mut end = SHOWN_KEY_BYTES;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}... ({} bytes)", &key[..end], key.len())
}

/// Checks a key: non-empty and at most `MAX_KEY_LEN` bytes.
pub fn check_key(key: &str) -> KeyResult<()> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        Err(Code::InvalidKey)
    } else {
        Ok(())
    }
}
