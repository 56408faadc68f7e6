//! The wire form of the store's messages: each request's and answer's payload, field
//! by field, over `codec`'s reader and writer (the method numbers are `rpc_methods!`).

use super::*;
use crate::codec::{Collection, Reader, Writer};

impl Request {
    /// The method number this request travels under (see `rpc_methods!`).
    pub fn method(&self) -> u16 {
        self.kind() as u16
    }

    /// The request's payload, encoded.
    pub fn payload(&self) -> Vec<u8> {
        let mut w = Writer::new();
        self.encode(&mut w);
        w.into_bytes()
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
            Request::PutStartNoted {
                client,
                items,
                config,
                upsert,
            } => {
                w.u64(*client).list(items, |w, (k, s, c)| {
                    w.str(k).u64(*s).u32(*c);
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
            Request::GetReplicas { keys } | Request::GetReplicasKeepable { keys } => {
                Lookup::encode(keys, w);
            }
            Request::Exists { keys } | Request::Describe { keys } => {
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
                ring,
            } => {
                w.u64(*client).str(segment).u64(*instance).u64(*acked);
                w.u64(*disk_capacity);
                w.list(lost, |w, k| {
                    w.str(k);
                });
                if ring.slots > 0 {
                    w.u64(ring.addr).u32(ring.slots);
                }
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
            Method::PutStartNoted => Request::PutStartNoted {
                client: r.u64()?,
                items: r.list(16, |r| Ok((r.string()?, r.u64()?, r.u32()?)))?,
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
                keys: Lookup::keys(&mut r)?,
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
                ring: if r.finish().is_ok() {
                    NoteRing::default()
                } else {
                    let ring = NoteRing {
                        addr: r.u64()?,
                        slots: r.u32()?,
                    };
                    // No ring travels as nothing: anything else would not re-encode
                    // as it came.
                    if ring.slots == 0 {
                        return Err(Error::protocol("a note ring has slots"));
                    }
                    ring
                },
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
                keys: Lookup::keys(&mut r)?,
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

pub(super) fn encode_entry(w: &mut Writer, e: &CatalogEntry) {
    w.str(&e.key)
        .u64(e.version)
        .u64(e.size)
        .u32(e.crc32c)
        .bool(e.hard_pin);
    encode_replicas(w, std::slice::from_ref(&e.replica));
    w.u32(e.index);
}

pub(super) fn decode_entry(r: &mut Reader) -> Result<CatalogEntry> {
    let key = r.string()?;
    let (version, size, crc32c, hard_pin) = (r.u64()?, r.u64()?, r.u32()?, r.bool()?);
    let mut replicas: Vec<ReplicaDesc> = decode_replicas(r)?;
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

/// A lookup (`GetReplicas`, or `GetReplicasKeepable` when `keepable`) with its keys
/// borrowed: how a batch read sends one, and how the master reads one, with no
/// `String` made per key. Its payload is the request's, declared here once.
pub struct Lookup<'a> {
    /// The keys looked up, in order.
    pub keys: Vec<&'a str>,
    /// Whether the reader keeps descriptors (`GetReplicasKeepable`).
    pub keepable: bool,
}

impl<'a> Lookup<'a> {
    /// The method a lookup travels as.
    pub fn method(keepable: bool) -> u16 {
        if keepable {
            Method::GetReplicasKeepable as u16
        } else {
            Method::GetReplicas as u16
        }
    }

    /// Writes the payload of a lookup of `keys`.
    pub fn encode<K: AsRef<str>>(keys: &[K], w: &mut Writer) {
        // The count, then each key's length and bytes.
        w.reserve(4 + keys.iter().map(|k| 4 + k.as_ref().len()).sum::<usize>());
        w.list(keys, |w, k| {
            w.str(k.as_ref());
        });
    }

    /// The lookup `payload` carries, when `method` is a lookup's; None for another
    /// method.
    pub fn decode(method: u16, payload: &'a [u8]) -> Option<Result<Lookup<'a>>> {
        let keepable = match Method::from_wire(method)? {
            Method::GetReplicas => false,
            Method::GetReplicasKeepable => true,
            _ => return None,
        };
        let mut r = Reader::new(payload);
        let keys = Self::read_keys(&mut r).and_then(|keys| r.finish().map(|()| keys));
        Some(keys.map(|keys| Lookup { keys, keepable }))
    }

    fn read_keys(r: &mut Reader<'a>) -> Result<Vec<&'a str>> {
        r.list(4, |r| r.str())
    }

    /// The keys of a lookup's payload, owned (for a `Request`).
    fn keys(r: &mut Reader) -> Result<Vec<String>> {
        Ok(Lookup::read_keys(r)?
            .into_iter()
            .map(str::to_owned)
            .collect())
    }
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
    encode_replicas_of(w, replicas, |p: &Piece| (&p.segment, p.addr, p.len));
}

/// Writes a replica list from any replicas whose pieces `piece` names as (segment,
/// address, length): what `ReplicaDesc`s and the master's own records both encode to.
pub fn encode_replicas_of<R: AsRef<[P]>, P>(
    w: &mut Writer,
    replicas: &[R],
    piece: impl Fn(&P) -> (&str, u64, u64),
) {
    w.list(replicas, |w, rep| {
        w.list(rep.as_ref(), |w, p| {
            let (segment, addr, len) = piece(p);
            w.str(segment).u64(addr).u64(len);
        });
    });
}

/// The start of one key's answer for an object found: its status, size, checksum and
/// lease. Its replica list follows (`encode_replicas_of`).
pub fn encode_found(w: &mut Writer, size: u64, crc32c: u32, lease_ms: u64) {
    w.i32(0).u64(size).u32(crc32c).u64(lease_ms);
}

/// One key's answer that failed: its status alone.
pub fn encode_failed(w: &mut Writer, code: Code) {
    w.i32(code as i32);
}

/// One key's whole answer, from a descriptor or its failure.
pub fn encode_desc(w: &mut Writer, r: &KeyResult<ObjectDesc>) {
    match r {
        Ok(o) => {
            encode_found(w, o.size, o.crc32c, o.lease_ms);
            encode_replicas(w, &o.replicas);
        }
        Err(code) => encode_failed(w, *code),
    }
}

/// A batch's per-key answers, each written when its key is handled, in any order (the
/// master handles a batch tail first), and sent as the wire's list in key order.
pub struct KeyedAnswers {
    scratch: Writer,
    /// Where each key's answer lies in `scratch`.
    spans: Vec<std::ops::Range<usize>>,
}

impl KeyedAnswers {
    /// Room for the answers of `keys` keys (a typical answer takes ~60 bytes; the
    /// scratch grows past what a few thousand take, rather than reserve ahead for a
    /// forged list of millions).
    pub fn new(keys: usize) -> KeyedAnswers {
        KeyedAnswers {
            scratch: Writer::with_buffer(Vec::with_capacity(keys.min(4096) * 64)),
            spans: vec![0..0; keys],
        }
    }

    /// Writes key `i`'s answer with `write`, replacing any written before.
    pub fn answer(&mut self, i: usize, write: impl FnOnce(&mut Writer)) {
        let start = self.scratch.len();
        write(&mut self.scratch);
        self.spans[i] = start..self.scratch.len();
    }

    /// Appends the answers as a list, in key order.
    pub fn finish(&self, w: &mut Writer) {
        w.list(&self.spans, |w, span| {
            debug_assert!(!span.is_empty(), "a key left unanswered");
            w.raw(self.scratch.written(span.clone()));
        });
    }
}

fn decode_replicas<C: Collection<ReplicaDesc>>(r: &mut Reader) -> Result<C> {
    r.list_of(4, |r| {
        Ok(ReplicaDesc {
            pieces: r.list_of(20, |r| {
                Ok(Piece {
                    segment: r.shared_str()?,
                    addr: r.u64()?,
                    len: r.u64()?,
                })
            })?,
        })
    })
}

fn encode_descs(w: &mut Writer, items: &[KeyResult<ObjectDesc>]) {
    w.list(items, encode_desc);
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
            Response::PutStartNoted(items) => {
                w.list(items, |w, r| {
                    encode_result(w, r, |w, (reps, notes)| {
                        encode_replicas(w, reps);
                        w.list(notes, |w, n| {
                            w.str(&n.segment).u64(n.addr).bytes(&n.bytes);
                        });
                    })
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
                    CatalogEvent::Unnote { slot, lend } => {
                        w.u8(8).u32(*slot).u64(*lend);
                    }
                });
                if let Some(key) = &ev.note_key {
                    w.bytes(key);
                }
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
            M::PutStartNoted => Response::PutStartNoted(r.list(4, |r| {
                decode_result(r, |r| {
                    let reps = decode_replicas(r)?;
                    let notes = r.list(16, |r| {
                        Ok(NoteWrite {
                            segment: r.string()?,
                            addr: r.u64()?,
                            bytes: r.bytes()?.to_vec(),
                        })
                    })?;
                    Ok((reps, notes))
                })
            })?),
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
                let mut sources: Vec<ReplicaDesc> = decode_replicas(&mut r)?;
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
                    8 => Ok(CatalogEvent::Unnote {
                        slot: r.u32()?,
                        lend: r.u64()?,
                    }),
                    t => Err(Error::protocol(format!("catalog event type {t}"))),
                })?,
                note_key: match r.finish() {
                    Ok(()) => None,
                    Err(_) => Some(r.bytes()?.try_into().map_err(|_| {
                        Error::protocol(format!("a note key is {} bytes", note::NOTE_KEY_LEN))
                    })?),
                },
            }),
        };
        r.finish()?;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_number_names_one_method_and_back() {
        let named: Vec<Method> = (0..=u16::MAX).filter_map(Method::from_wire).collect();
        assert_eq!(named.len(), 28);
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
                ]
                .into(),
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
                ring: NoteRing::default(),
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
                    CatalogEvent::Unnote { slot: 3, lend: 9 },
                ],
                note_key: None,
            }),
        );
        // A node with a note ring says where it is; a reset answers it with a key.
        let first_poll = |ring| Request::SegmentEvents {
            client: 9,
            segment: "b".into(),
            instance: 0,
            acked: 0,
            disk_capacity: 0,
            lost: Vec::new(),
            ring,
        };
        round_trip(
            first_poll(NoteRing {
                addr: 1 << 40,
                slots: 64,
            }),
            Response::SegmentEvents(SegmentEvents {
                instance: 4,
                reset: true,
                snapshot_end: 20,
                draining: false,
                last: 14,
                events: Vec::new(),
                note_key: Some([9; note::NOTE_KEY_LEN]),
            }),
        );
        // A ring of no slots travels as none; sent as one, it is refused.
        let mut w = Writer::new();
        first_poll(NoteRing::default()).encode(&mut w);
        w.u64(1 << 40).u32(0);
        assert!(Request::decode(17, &w.into_bytes()).is_err());
        round_trip(
            Request::PutStartNoted {
                client: 9,
                items: vec![("k".into(), 4096, 77)],
                config: ReplicateConfig::default(),
                upsert: true,
            },
            Response::PutStartNoted(vec![
                Ok((
                    vec![ReplicaDesc {
                        pieces: vec![Piece {
                            segment: "b".into(),
                            addr: 4096,
                            len: 4096,
                        }]
                        .into(),
                    }],
                    vec![NoteWrite {
                        segment: "b".into(),
                        addr: 1 << 40,
                        bytes: vec![1, 2, 3],
                    }],
                )),
                Err(Code::ObjectAlreadyExists),
            ]),
        );
        // The shortest events (a one-byte key) decode too, however many there are.
        let keeps = Response::SegmentEvents(SegmentEvents {
            instance: 1,
            reset: false,
            snapshot_end: 0,
            draining: false,
            last: 3,
            events: vec![CatalogEvent::Keep("a".into()); 3],
            note_key: None,
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
    fn a_lookup_written_from_its_keys_reads_as_its_request() {
        let keys = ["a", "", "ключ", "a"];
        for keepable in [false, true] {
            let mut w = Writer::new();
            Lookup::encode(&keys, &mut w);
            let payload = w.into_bytes();
            let owned: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
            let req = if keepable {
                Request::GetReplicasKeepable { keys: owned }
            } else {
                Request::GetReplicas { keys: owned }
            };
            let method = Lookup::method(keepable);
            assert_eq!(method, req.method());
            let mut w = Writer::new();
            req.encode(&mut w);
            assert_eq!(w.into_bytes(), payload);
            assert_eq!(Request::decode(method, &payload).unwrap(), req);
            let lookup = Lookup::decode(method, &payload).unwrap().unwrap();
            assert_eq!((lookup.keys, lookup.keepable), (keys.to_vec(), keepable));
            // Cut, or with a byte left over: refused, as the request's decode refuses it.
            for bad in [
                &payload[..payload.len() - 1],
                &[&payload[..], &[0]].concat(),
            ] {
                assert!(Lookup::decode(method, bad).unwrap().is_err());
                assert!(Request::decode(method, bad).is_err());
            }
        }
        let exists = Request::Exists {
            keys: vec!["a".into()],
        };
        assert!(
            Lookup::decode(exists.method(), &[]).is_none(),
            "not a lookup"
        );
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
                }]
                .into(),
            }]
            .into(),
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
                    pieces: vec![piece("a", 64)].into(),
                },
                targets: vec![ReplicaDesc {
                    pieces: vec![piece("b", 128)].into(),
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
