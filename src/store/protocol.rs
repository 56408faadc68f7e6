//! Messages between store clients and the master, and their encoding (`codec`).
//! Every per-key operation is a batch: a single call is a batch of one.

use super::codec::{Reader, Writer};
use crate::error::{Code, Error, Result};

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
    /// The segment holding the bytes.
    pub segment: String,
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
    pub pieces: Vec<Piece>,
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
    pub replicas: Vec<ReplicaDesc>,
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
}

impl Request {
    /// The method number this request travels under (see `rpc_methods!`).
    pub fn method(&self) -> u16 {
        self.kind() as u16
    }

    /// Writes the request's payload.
    pub fn encode(&self, w: &mut Writer) {
        match self {
            Request::Ping { client } => {
                w.u64(*client);
            }
            Request::Mount { client, segment } => {
                w.u64(*client)
                    .str(&segment.name)
                    .u64(segment.base)
                    .u64(segment.size);
            }
            Request::Unmount { client, name } => {
                w.u64(*client).str(name);
            }
            Request::PutStart {
                client,
                items,
                config,
                upsert,
            } => {
                w.u64(*client).list(items, |w, (k, s)| {
                    w.str(k).u64(*s);
                });
                encode_config(w, config);
                w.bool(*upsert);
            }
            Request::PutEnd { client, items } => {
                w.u64(*client).list(items, |w, (k, c)| {
                    w.str(k).u32(*c);
                });
            }
            Request::PutRevoke { client, keys } => {
                w.u64(*client).list(keys, |w, k| {
                    w.str(k);
                });
            }
            Request::GetReplicas { keys }
            | Request::Exists { keys }
            | Request::GetReplicasKeepable { keys }
            | Request::Describe { keys } => {
                w.list(keys, |w, k| {
                    w.str(k);
                });
            }
            Request::Remove { key, force } => {
                w.str(key).bool(*force);
            }
            Request::RemoveAll { force } => {
                w.bool(*force);
            }
            Request::RemoveByRegex { pattern, force } => {
                w.str(pattern).bool(*force);
            }
            Request::Stats | Request::MetadataUrl => {}
            Request::RemoveKeys { keys, force } => {
                w.list(keys, |w, k| {
                    w.str(k);
                });
                w.bool(*force);
            }
            Request::ReplicaClear { keys, segment } => {
                w.list(keys, |w, k| {
                    w.str(k);
                });
                w.str(segment);
            }
            Request::Remount {
                client,
                segment,
                entries,
                disk,
                last,
                owner,
            } => {
                w.u64(*client)
                    .str(&segment.name)
                    .u64(segment.base)
                    .u64(segment.size);
                w.list(entries, encode_entry);
                w.list(disk, |w, d| {
                    w.str(&d.key).u64(d.version).u64(d.size).u32(d.crc32c);
                });
                w.bool(*last);
                if let Some(t) = owner {
                    t.encode(w);
                }
            }
            Request::SegmentEvents {
                client,
                segment,
                instance,
                acked,
                disk_capacity,
                lost,
            } => {
                w.u64(*client).str(segment).u64(*instance).u64(*acked);
                w.u64(*disk_capacity);
                w.list(lost, |w, k| {
                    w.str(k);
                });
            }
            Request::Drain { client, segment } => {
                w.u64(*client).str(segment);
            }
            Request::Relocate {
                client,
                segment,
                keys,
            } => {
                w.u64(*client).str(segment);
                w.list(keys, |w, k| {
                    w.str(k);
                });
            }
            Request::RelocateEnd {
                client,
                segment,
                items,
            } => {
                w.u64(*client).str(segment);
                w.list(items, |w, (k, moved)| {
                    w.str(k).bool(*moved);
                });
            }
            Request::Touch { batches } => {
                w.list(batches, |w, keys| {
                    w.list(keys, |w, k| {
                        w.str(k);
                    });
                });
            }
            Request::MountExtra {
                client,
                id,
                segment,
            } => {
                w.u64(*client)
                    .str(id)
                    .str(&segment.name)
                    .u64(segment.base)
                    .u64(segment.size);
            }
            Request::CopyStart {
                client,
                key,
                source,
                targets,
            } => {
                w.u64(*client).str(key).str(source);
                w.list(targets, |w, t| {
                    w.str(t);
                });
            }
            Request::CopyEnd {
                client,
                ticket,
                done,
            } => {
                w.u64(*client).u64(*ticket).bool(*done);
            }
            Request::ReleaseStaged { items } => {
                w.list(items, |w, (k, addr)| {
                    w.str(k).u64(*addr);
                });
            }
        }
    }

    /// Reads a request of method `method` from its payload.
    pub fn decode(method: u16, payload: &[u8]) -> Result<Request> {
        let mut r = Reader::new(payload);
        let keys = |r: &mut Reader| r.list(4, |r| r.string());
        let Some(kind) = Method::from_wire(method) else {
            return Err(Error::protocol(format!("unknown store method {method}")));
        };
        let req = match kind {
            Method::Ping => Request::Ping { client: r.u64()? },
            Method::Mount => Request::Mount {
                client: r.u64()?,
                segment: SegmentInfo {
                    name: r.string()?,
                    base: r.u64()?,
                    size: r.u64()?,
                },
            },
            Method::Unmount => Request::Unmount {
                client: r.u64()?,
                name: r.string()?,
            },
            Method::PutStart => Request::PutStart {
                client: r.u64()?,
                items: r.list(12, |r| Ok((r.string()?, r.u64()?)))?,
                config: decode_config(&mut r)?,
                upsert: r.bool()?,
            },
            Method::PutEnd => Request::PutEnd {
                client: r.u64()?,
                items: r.list(8, |r| Ok((r.string()?, r.u32()?)))?,
            },
            Method::PutRevoke => Request::PutRevoke {
                client: r.u64()?,
                keys: keys(&mut r)?,
            },
            Method::GetReplicas => Request::GetReplicas {
                keys: keys(&mut r)?,
            },
            Method::Exists => Request::Exists {
                keys: keys(&mut r)?,
            },
            Method::Remove => Request::Remove {
                key: r.string()?,
                force: r.bool()?,
            },
            Method::RemoveAll => Request::RemoveAll { force: r.bool()? },
            Method::RemoveByRegex => Request::RemoveByRegex {
                pattern: r.string()?,
                force: r.bool()?,
            },
            Method::Stats => Request::Stats,
            Method::RemoveKeys => Request::RemoveKeys {
                keys: keys(&mut r)?,
                force: r.bool()?,
            },
            Method::ReplicaClear => Request::ReplicaClear {
                keys: keys(&mut r)?,
                segment: r.string()?,
            },
            Method::MetadataUrl => Request::MetadataUrl,
            Method::Remount => Request::Remount {
                client: r.u64()?,
                segment: SegmentInfo {
                    name: r.string()?,
                    base: r.u64()?,
                    size: r.u64()?,
                },
                entries: r.list(40, decode_entry)?,
                disk: r.list(24, |r| {
                    Ok(DiskEntry {
                        key: r.string()?,
                        version: r.u64()?,
                        size: r.u64()?,
                        crc32c: r.u32()?,
                    })
                })?,
                last: r.bool()?,
                // Nodes that predate tickets end here.
                owner: if r.finish().is_ok() {
                    None
                } else {
                    Some(OwnerTicket::decode(&mut r)?)
                },
            },
            Method::SegmentEvents => Request::SegmentEvents {
                client: r.u64()?,
                segment: r.string()?,
                instance: r.u64()?,
                acked: r.u64()?,
                disk_capacity: r.u64()?,
                lost: keys(&mut r)?,
            },
            Method::Drain => Request::Drain {
                client: r.u64()?,
                segment: r.string()?,
            },
            Method::Relocate => Request::Relocate {
                client: r.u64()?,
                segment: r.string()?,
                keys: keys(&mut r)?,
            },
            Method::RelocateEnd => Request::RelocateEnd {
                client: r.u64()?,
                segment: r.string()?,
                items: r.list(5, |r| Ok((r.string()?, r.bool()?)))?,
            },
            Method::Touch => Request::Touch {
                batches: r.list(4, keys)?,
            },
            Method::GetReplicasKeepable => Request::GetReplicasKeepable {
                keys: keys(&mut r)?,
            },
            Method::MountExtra => Request::MountExtra {
                client: r.u64()?,
                id: r.string()?,
                segment: SegmentInfo {
                    name: r.string()?,
                    base: r.u64()?,
                    size: r.u64()?,
                },
            },
            Method::CopyStart => Request::CopyStart {
                client: r.u64()?,
                key: r.string()?,
                source: r.string()?,
                targets: keys(&mut r)?,
            },
            Method::CopyEnd => Request::CopyEnd {
                client: r.u64()?,
                ticket: r.u64()?,
                done: r.bool()?,
            },
            Method::ReleaseStaged => Request::ReleaseStaged {
                items: r.list(12, |r| Ok((r.string()?, r.u64()?)))?,
            },
            Method::Describe => Request::Describe {
                keys: keys(&mut r)?,
            },
        };
        r.finish()?;
        Ok(req)
    }
}

fn encode_entry(w: &mut Writer, e: &CatalogEntry) {
    w.str(&e.key)
        .u64(e.version)
        .u64(e.size)
        .u32(e.crc32c)
        .bool(e.hard_pin);
    encode_replicas(w, std::slice::from_ref(&e.replica));
    w.u32(e.index);
}

fn decode_entry(r: &mut Reader) -> Result<CatalogEntry> {
    let key = r.string()?;
    let (version, size, crc32c, hard_pin) = (r.u64()?, r.u64()?, r.u32()?, r.bool()?);
    let mut replicas = decode_replicas(r)?;
    let index = r.u32()?;
    let replica = match (replicas.pop(), replicas.is_empty()) {
        (Some(rep), true) if (index as usize) < rep.pieces.len() => rep,
        _ => {
            return Err(Error::protocol(
                "catalog entry: one replica holding its piece",
            ))
        }
    };
    Ok(CatalogEntry {
        key,
        version,
        size,
        crc32c,
        hard_pin,
        replica,
        index,
    })
}

fn encode_config(w: &mut Writer, c: &ReplicateConfig) {
    w.u32(c.replica_num)
        .bool(c.hard_pin)
        .bool(c.soft_pin)
        .u64(c.soft_pin_ttl_ms);
    w.list(&c.preferred_segments, |w, s| {
        w.str(s);
    });
    w.bool(c.prefer_same_node);
    w.list(&c.group_ids, |w, s| {
        w.str(s);
    });
}

fn decode_config(r: &mut Reader) -> Result<ReplicateConfig> {
    Ok(ReplicateConfig {
        replica_num: r.u32()?,
        hard_pin: r.bool()?,
        soft_pin: r.bool()?,
        soft_pin_ttl_ms: r.u64()?,
        preferred_segments: r.list(4, |r| r.string())?,
        prefer_same_node: r.bool()?,
        group_ids: r.list(4, |r| r.string())?,
    })
}

fn encode_result<T>(w: &mut Writer, r: &KeyResult<T>, ok: impl FnOnce(&mut Writer, &T)) {
    match r {
        Ok(v) => {
            w.i32(0);
            ok(w, v);
        }
        Err(code) => {
            w.i32(*code as i32);
        }
    }
}

fn decode_result<T>(
    r: &mut Reader,
    ok: impl FnOnce(&mut Reader) -> Result<T>,
) -> Result<KeyResult<T>> {
    match r.i32()? {
        0 => Ok(Ok(ok(r)?)),
        code => Ok(Err(Code::from_i32(code).ok_or_else(|| {
            Error::protocol(format!("unknown status code {code}"))
        })?)),
    }
}

fn encode_replicas(w: &mut Writer, replicas: &[ReplicaDesc]) {
    w.list(replicas, |w, rep| {
        w.list(&rep.pieces, |w, p| {
            w.str(&p.segment).u64(p.addr).u64(p.len);
        });
    });
}

fn decode_replicas(r: &mut Reader) -> Result<Vec<ReplicaDesc>> {
    r.list(4, |r| {
        Ok(ReplicaDesc {
            pieces: r.list(20, |r| {
                Ok(Piece {
                    segment: r.string()?,
                    addr: r.u64()?,
                    len: r.u64()?,
                })
            })?,
        })
    })
}

fn encode_descs(w: &mut Writer, items: &[KeyResult<ObjectDesc>]) {
    w.list(items, |w, r| {
        encode_result(w, r, |w, o| {
            w.u64(o.size).u32(o.crc32c).u64(o.lease_ms);
            encode_replicas(w, &o.replicas);
        })
    });
}

fn decode_descs(r: &mut Reader) -> Result<Vec<KeyResult<ObjectDesc>>> {
    r.list(4, |r| {
        decode_result(r, |r| {
            Ok(ObjectDesc {
                size: r.u64()?,
                crc32c: r.u32()?,
                lease_ms: r.u64()?,
                replicas: decode_replicas(r)?,
            })
        })
    })
}

impl Response {
    /// Writes the response's payload.
    pub fn encode(&self, w: &mut Writer) {
        match self {
            Response::Ping { need_remount } => {
                w.bool(*need_remount);
            }
            Response::Done => {}
            Response::Mounted(ticket) => ticket.encode(w),
            Response::PutStart(items) => {
                w.list(items, |w, r| {
                    encode_result(w, r, |w, reps| encode_replicas(w, reps))
                });
            }
            Response::PerKey(items) => {
                w.list(items, |w, r| encode_result(w, r, |_, _| {}));
            }
            Response::GetReplicas(items) => encode_descs(w, items),
            Response::Keepable { descs, keepable } => {
                encode_descs(w, descs);
                w.list(keepable, |w, k| {
                    w.bool(*k);
                });
            }
            Response::Described { descs, disk } => {
                encode_descs(w, descs);
                w.list(disk, |w, d| {
                    w.str(d);
                });
            }
            Response::Exists(items) => {
                w.list(items, |w, r| {
                    encode_result(w, r, |w, b| {
                        w.bool(*b);
                    })
                });
            }
            Response::Count(n) => {
                w.u64(*n);
            }
            Response::Stats(s) => {
                w.u64(s.segments).u64(s.capacity).u64(s.used).u64(s.objects);
                w.u64(s.evicted_objects).u64(s.evicted_bytes);
            }
            Response::MetadataUrl(url) => {
                w.str(url);
            }
            Response::CopyStart(plan) => {
                w.u64(plan.ticket).u64(plan.size).u32(plan.crc32c);
                encode_replicas(w, std::slice::from_ref(&plan.source));
                encode_replicas(w, &plan.targets);
            }
            Response::SegmentEvents(ev) => {
                w.u64(ev.instance)
                    .bool(ev.reset)
                    .u64(ev.snapshot_end)
                    .bool(ev.draining)
                    .u64(ev.last);
                w.list(&ev.events, |w, e| match e {
                    CatalogEvent::Commit(entry) => {
                        w.u8(1);
                        encode_entry(w, entry);
                    }
                    CatalogEvent::Free(addr) => {
                        w.u8(2).u64(*addr);
                    }
                    CatalogEvent::Offload(addr) => {
                        w.u8(3).u64(*addr);
                    }
                    CatalogEvent::Load {
                        key,
                        version,
                        pieces,
                    } => match pieces.as_slice() {
                        // One piece keeps the form nodes of before striped loads read.
                        [(addr, size)] => {
                            w.u8(4).str(key).u64(*version).u64(*addr).u64(*size);
                        }
                        _ => {
                            w.u8(7).str(key).u64(*version);
                            w.list(pieces, |w, (addr, len)| {
                                w.u64(*addr).u64(*len);
                            });
                        }
                    },
                    CatalogEvent::Forget { key, version } => {
                        w.u8(5).str(key).u64(*version);
                    }
                    CatalogEvent::Keep(key) => {
                        w.u8(6).str(key);
                    }
                });
            }
        }
    }

    /// Decodes the answer to a request of `method`.
    pub fn decode(method: u16, payload: &[u8]) -> Result<Response> {
        let mut r = Reader::new(payload);
        let Some(kind) = Method::from_wire(method) else {
            return Err(Error::protocol(format!("unknown store method {method}")));
        };
        use Method as M;
        let resp = match kind {
            M::Ping => Response::Ping {
                need_remount: r.bool()?,
            },
            M::Mount
            | M::Unmount
            | M::Drain
            | M::Touch
            | M::MountExtra
            | M::CopyEnd
            | M::ReleaseStaged => Response::Done,
            // Masters that predate owner tickets answer a remount with nothing.
            M::Remount if payload.is_empty() => Response::Done,
            M::Remount => Response::Mounted(OwnerTicket::decode(&mut r)?),
            M::PutStart | M::Relocate => {
                Response::PutStart(r.list(4, |r| decode_result(r, decode_replicas))?)
            }
            M::PutEnd | M::PutRevoke | M::RemoveKeys | M::ReplicaClear | M::RelocateEnd => {
                Response::PerKey(r.list(4, |r| decode_result(r, |_| Ok(())))?)
            }
            M::GetReplicas => Response::GetReplicas(decode_descs(&mut r)?),
            M::GetReplicasKeepable => Response::Keepable {
                descs: decode_descs(&mut r)?,
                keepable: r.list(1, |r| r.bool())?,
            },
            M::Describe => Response::Described {
                descs: decode_descs(&mut r)?,
                disk: r.list(4, |r| r.string())?,
            },
            M::Exists => Response::Exists(r.list(4, |r| decode_result(r, |r| r.bool()))?),
            M::Remove | M::RemoveAll | M::RemoveByRegex => Response::Count(r.u64()?),
            M::Stats => Response::Stats(PoolStats {
                segments: r.u64()?,
                capacity: r.u64()?,
                used: r.u64()?,
                objects: r.u64()?,
                evicted_objects: r.u64()?,
                evicted_bytes: r.u64()?,
            }),
            M::MetadataUrl => Response::MetadataUrl(r.string()?),
            M::CopyStart => {
                let (ticket, size, crc32c) = (r.u64()?, r.u64()?, r.u32()?);
                // Exactly one source: anything else would not re-encode as it came.
                let mut sources = decode_replicas(&mut r)?;
                let source = match (sources.pop(), sources.is_empty()) {
                    (Some(s), true) => s,
                    _ => return Err(Error::protocol("a copy plan names one source replica")),
                };
                Response::CopyStart(CopyPlan {
                    ticket,
                    size,
                    crc32c,
                    source,
                    targets: decode_replicas(&mut r)?,
                })
            }
            M::SegmentEvents => Response::SegmentEvents(SegmentEvents {
                instance: r.u64()?,
                reset: r.bool()?,
                snapshot_end: r.u64()?,
                draining: r.bool()?,
                last: r.u64()?,
                events: r.list(6, |r| match r.u8()? {
                    1 => Ok(CatalogEvent::Commit(decode_entry(r)?)),
                    2 => Ok(CatalogEvent::Free(r.u64()?)),
                    3 => Ok(CatalogEvent::Offload(r.u64()?)),
                    4 => Ok(CatalogEvent::Load {
                        key: r.string()?,
                        version: r.u64()?,
                        pieces: vec![(r.u64()?, r.u64()?)],
                    }),
                    7 => {
                        let (key, version) = (r.string()?, r.u64()?);
                        let pieces = r.list(16, |r| Ok((r.u64()?, r.u64()?)))?;
                        // One piece travels as type 4: anything else would not
                        // re-encode as it came.
                        if pieces.len() < 2 {
                            return Err(Error::protocol("a striped load names several pieces"));
                        }
                        Ok(CatalogEvent::Load {
                            key,
                            version,
                            pieces,
                        })
                    }
                    6 => Ok(CatalogEvent::Keep(r.string()?)),
                    5 => Ok(CatalogEvent::Forget {
                        key: r.string()?,
                        version: r.u64()?,
                    }),
                    t => Err(Error::protocol(format!("catalog event type {t}"))),
                })?,
            }),
        };
        r.finish()?;
        Ok(resp)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_number_names_one_method_and_back() {
        let named: Vec<Method> = (0..=u16::MAX).filter_map(Method::from_wire).collect();
        assert_eq!(named.len(), 27);
        for m in named {
            assert_eq!(Method::from_wire(m as u16), Some(m));
        }
        assert_eq!(Request::Stats.kind(), Method::Stats);
        assert_eq!(
            Request::Stats.method(),
            12,
            "numbers on the wire never change"
        );
        assert!(Request::decode(0, &[]).is_err() && Response::decode(28, &[]).is_err());
    }

    #[test]
    fn long_keys_are_cut_in_messages() {
        assert_eq!(shown_key("a/b"), "\"a/b\"");
        let long = "k".repeat(10 << 20);
        let shown = shown_key(&long);
        assert!(shown.len() < SHOWN_KEY_BYTES + 40, "{shown}");
        assert!(
            shown.ends_with(&format!("... ({} bytes)", 10 << 20)),
            "{shown}"
        );
        // A cut never splits a character.
        let wide = "é".repeat(100);
        assert!(shown_key(&wide).contains("(200 bytes)"));
    }

    fn round_trip(req: Request, resp: Response) {
        let mut w = Writer::new();
        req.encode(&mut w);
        assert_eq!(Request::decode(req.method(), &w.into_bytes()).unwrap(), req);
        let mut w = Writer::new();
        resp.encode(&mut w);
        assert_eq!(
            Response::decode(req.method(), &w.into_bytes()).unwrap(),
            resp
        );
    }

    #[test]
    fn catalog_messages_round_trip() {
        let entry = CatalogEntry {
            key: "k/1".into(),
            version: 7 << 32 | 3,
            size: 5000,
            crc32c: 0xDEAD_BEEF,
            hard_pin: true,
            replica: ReplicaDesc {
                pieces: vec![
                    Piece {
                        segment: "a".into(),
                        addr: 4096,
                        len: 4000,
                    },
                    Piece {
                        segment: "b".into(),
                        addr: 0,
                        len: 1000,
                    },
                ],
            },
            index: 1,
        };
        let segment = SegmentInfo {
            name: "b".into(),
            base: 0,
            size: 1 << 20,
        };
        round_trip(
            Request::Remount {
                client: 9,
                segment,
                entries: vec![entry.clone()],
                disk: vec![DiskEntry {
                    key: "d".into(),
                    version: 3,
                    size: 10,
                    crc32c: 5,
                }],
                last: true,
                owner: None,
            },
            Response::Done,
        );
        let ticket = OwnerTicket {
            issued_ms: 1_700_000_000_000,
            nonce: 7,
            mac: 0xFEED,
        };
        round_trip(
            Request::Remount {
                client: 9,
                segment: SegmentInfo {
                    name: "b".into(),
                    base: 0,
                    size: 1 << 20,
                },
                entries: Vec::new(),
                disk: Vec::new(),
                last: true,
                owner: Some(ticket),
            },
            Response::Mounted(ticket),
        );
        round_trip(
            Request::SegmentEvents {
                client: 9,
                segment: "b".into(),
                instance: 4,
                acked: 12,
                disk_capacity: 1 << 30,
                lost: vec!["gone".into()],
            },
            Response::SegmentEvents(SegmentEvents {
                instance: 4,
                reset: false,
                snapshot_end: 0,
                draining: true,
                last: 14,
                events: vec![
                    CatalogEvent::Free(4096),
                    CatalogEvent::Commit(entry.clone()),
                    CatalogEvent::Offload(64),
                    CatalogEvent::Load {
                        key: "k".into(),
                        version: 2,
                        pieces: vec![(128, 9)],
                    },
                    CatalogEvent::Load {
                        key: "k".into(),
                        version: 2,
                        pieces: vec![(128, 9), (4096, 3)],
                    },
                    CatalogEvent::Forget {
                        key: "k".into(),
                        version: 2,
                    },
                    CatalogEvent::Keep("k".into()),
                ],
            }),
        );
        // The shortest events (a one-byte key) decode too, however many there are.
        let keeps = Response::SegmentEvents(SegmentEvents {
            instance: 1,
            reset: false,
            snapshot_end: 0,
            draining: false,
            last: 3,
            events: vec![CatalogEvent::Keep("a".into()); 3],
        });
        let mut w = Writer::new();
        keeps.encode(&mut w);
        assert_eq!(Response::decode(17, &w.into_bytes()).unwrap(), keeps);
        // An entry whose index names no piece is malformed.
        let mut w = Writer::new();
        encode_entry(&mut w, &CatalogEntry { index: 2, ..entry });
        assert!(decode_entry(&mut Reader::new(&w.into_bytes())).is_err());
    }

    #[test]
    fn touch_round_trips_and_keeps_each_batch_in_order() {
        round_trip(
            Request::Touch {
                batches: vec![vec!["a".into(), "b/2".into()], vec![], vec!["c".into()]],
            },
            Response::Done,
        );
        let desc = ObjectDesc {
            size: 10,
            crc32c: 3,
            lease_ms: 200,
            replicas: vec![ReplicaDesc {
                pieces: vec![Piece {
                    segment: "n".into(),
                    addr: 64,
                    len: 10,
                }],
            }],
        };
        round_trip(
            Request::GetReplicasKeepable {
                keys: vec!["a".into(), "b".into()],
            },
            Response::Keepable {
                descs: vec![Ok(desc.clone()), Err(Code::ObjectNotFound)],
                keepable: vec![true, false],
            },
        );
        round_trip(
            Request::Describe {
                keys: vec!["a".into(), "b".into()],
            },
            Response::Described {
                descs: vec![Ok(desc), Err(Code::ObjectNotFound)],
                disk: vec!["node:1".into(), String::new()],
            },
        );
        // A batch count that cannot fit the payload is refused, not allocated.
        let mut w = Writer::new();
        w.u32(u32::MAX);
        assert!(Request::decode(21, &w.into_bytes()).is_err());
    }

    #[test]
    fn extra_mounts_and_copies_round_trip() {
        let piece = |segment: &str, addr| Piece {
            segment: segment.into(),
            addr,
            len: 10,
        };
        round_trip(
            Request::MountExtra {
                client: 3,
                id: "3-1".into(),
                segment: SegmentInfo {
                    name: "host:1".into(),
                    base: 1 << 30,
                    size: 1 << 20,
                },
            },
            Response::Done,
        );
        round_trip(
            Request::CopyStart {
                client: 3,
                key: "k".into(),
                source: "a".into(),
                targets: vec!["b".into(), "c".into()],
            },
            Response::CopyStart(CopyPlan {
                ticket: 9,
                size: 10,
                crc32c: 0xABCD,
                source: ReplicaDesc {
                    pieces: vec![piece("a", 64)],
                },
                targets: vec![ReplicaDesc {
                    pieces: vec![piece("b", 128)],
                }],
            }),
        );
        round_trip(
            Request::CopyEnd {
                client: 3,
                ticket: 9,
                done: true,
            },
            Response::Done,
        );
        round_trip(
            Request::ReleaseStaged {
                items: vec![("a".into(), 64), ("b".into(), 4096)],
            },
            Response::Done,
        );
        // A plan must name the replica to read.
        let mut w = Writer::new();
        w.u64(1).u64(10).u32(0);
        encode_replicas(&mut w, &[]);
        encode_replicas(&mut w, &[]);
        assert!(Response::decode(24, &w.into_bytes()).is_err());
    }

    #[test]
    fn metadata_url_round_trips() {
        let req = Request::MetadataUrl;
        let mut w = Writer::new();
        req.encode(&mut w);
        let bytes = w.into_bytes();
        assert_eq!(Request::decode(req.method(), &bytes).unwrap(), req);
        for url in ["", "http://127.0.0.1:8080/metadata"] {
            let resp = Response::MetadataUrl(url.to_owned());
            let mut w = Writer::new();
            resp.encode(&mut w);
            let bytes = w.into_bytes();
            assert_eq!(Response::decode(req.method(), &bytes).unwrap(), resp);
        }
    }
}
