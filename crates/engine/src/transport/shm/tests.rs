//! The owner's authority over what same-host peers touch, and lazy mapping, checked
//! in one process: the copier attaches to its own pid through `/proc`, exactly as it
//! would to another engine's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::metadata::BufferDesc;
use crate::registry::{Access, LocalMemory};
use crate::transport::{Endpoints, Peer};

/// An engine's shared-memory side: its transport, registry and registered buffers.
struct Owner {
    shm: ShmTransport,
    memory: LocalMemory,
}

impl Owner {
    fn new() -> Owner {
        Owner {
            shm: ShmTransport::new().unwrap(),
            memory: LocalMemory::new(),
        }
    }

    fn register(&self, addr: u64, len: u64, fd: Option<i32>) -> BufferDesc {
        self.register_as(addr, len, fd, Access::ReadWrite)
    }

    fn register_as(&self, addr: u64, len: u64, fd: Option<i32>, access: Access) -> BufferDesc {
        let region = (self.memory)
            .register_with(addr, len, "cpu:0", fd, access)
            .unwrap();
        self.shm.register(&region).unwrap();
        buffer(addr, len, fd)
    }

    /// A fresh 64 KiB memfd buffer, registered read-write: the memory and its
    /// descriptor.
    fn shared_buffer(&self) -> (SharedMemory, BufferDesc) {
        let mem = SharedMemory::create("mooncake-buffer", 1 << 16, Sharing::PeersWrite).unwrap();
        let desc = self.register(mem.ptr() as u64, 1 << 16, Some(mem.fd()));
        (mem, desc)
    }

    /// The descriptor this owner would publish for `buffers`.
    fn desc(&self, name: &str, buffers: Vec<BufferDesc>) -> SegmentDesc {
        let mut d = SegmentDesc::new(name);
        self.shm.describe(&mut d);
        d.buffers = buffers;
        d
    }
}

fn buffer(addr: u64, length: u64, shm_fd: Option<i32>) -> BufferDesc {
    BufferDesc {
        name: "cpu:0".into(),
        addr,
        length,
        rkey: vec![],
        lkey: vec![],
        shm_fd,
        ipc: None,
        access: Access::ReadWrite,
    }
}

fn peer(id: u64, desc: SegmentDesc) -> Arc<Peer> {
    let endpoints = Endpoints {
        data: "127.0.0.1:1".parse().unwrap(),
        rpc: "127.0.0.1:1".into(),
    };
    Arc::new(Peer::new(id, desc, endpoints))
}

/// Another engine's worker, copying to and from peers.
struct Copier {
    _shm: ShmTransport,
    worker: Box<dyn TransportWorker>,
}

impl Copier {
    fn new() -> Copier {
        let shm = ShmTransport::new().unwrap();
        let worker = shm.new_worker().unwrap();
        Copier { _shm: shm, worker }
    }

    fn copy(&mut self, peer: &Arc<Peer>, op: Op, local: &mut [u8], remote: u64) -> Outcome {
        self.copy_checksummed(peer, op, local, remote, false)
            .outcome
    }

    fn copy_checksummed(
        &mut self,
        peer: &Arc<Peer>,
        op: Op,
        local: &mut [u8],
        remote: u64,
        checksum: bool,
    ) -> Finished {
        let slice = Slice {
            id: 1,
            op,
            local: local.as_mut_ptr() as u64,
            local_kind: MemoryKind::Host,
            remote,
            len: local.len() as u64,
            peer: peer.clone(),
            deadline: Instant::now() + Duration::from_secs(5),
            checksum,
        };
        let mut done = Vec::new();
        self.worker.post(slice, &mut done);
        done.pop().unwrap()
    }
}

/// One slice through a fresh copier.
fn copy(peer: &Arc<Peer>, op: Op, local: &mut [u8], remote: u64) -> Outcome {
    Copier::new().copy(peer, op, local, remote)
}

fn refused(outcome: Outcome, what: &str) -> String {
    match outcome {
        Outcome::Rejected(why) => why,
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_forged_descriptor_reaches_nothing_its_owner_did_not_register() {
    let owner = Owner::new();
    let (mem, shared) = owner.shared_buffer();
    let mut plain_mem = vec![0u8; 1 << 12];
    let plain = owner.register(plain_mem.as_mut_ptr() as u64, 1 << 12, None);
    // The victim's memory nobody registered: its "heap".
    let heap = vec![0xab_u8; 1 << 13];
    let heap_addr = heap.as_ptr() as u64;

    // Honest descriptors work, for both kinds of buffer.
    let honest = peer(1, owner.desc("victim", vec![shared.clone(), plain.clone()]));
    let mut data = vec![7u8; 4096];
    assert_eq!(
        copy(&honest, Op::Write, &mut data, shared.addr),
        Outcome::Done
    );
    assert_eq!(
        copy(&honest, Op::Write, &mut data, plain.addr),
        Outcome::Done
    );
    // SAFETY: `mem` is 64 KiB, alive; nothing writes it concurrently.
    let written = unsafe { std::slice::from_raw_parts(mem.ptr(), 4096) };
    assert_eq!(written, &data[..]);
    assert_eq!(&plain_mem[..], &data[..]);

    // Renamed copies whose buffers point at the heap: plain, or claiming the
    // registered buffer's memfd.
    let forged = [
        buffer(heap_addr, 1 << 13, None),
        buffer(heap_addr, 1 << 13, Some(mem.fd())),
    ];
    for (i, b) in forged.into_iter().enumerate() {
        let evil = peer(10 + i as u64, owner.desc("evil", vec![b]));
        let why = refused(
            copy(&evil, Op::Write, &mut [0x66; 4096], heap_addr),
            "write",
        );
        assert!(why.contains("is not memory process"), "{why}");
        let mut back = vec![1u8; 4096];
        refused(copy(&evil, Op::Read, &mut back, heap_addr), "read");
        assert!(back.iter().all(|&b| b == 1), "nothing was read");
    }
    // A registered buffer claimed longer than it is: the tail is refused.
    let longer = peer(
        20,
        owner.desc("evil", vec![buffer(shared.addr, 1 << 20, Some(mem.fd()))]),
    );
    refused(
        copy(&longer, Op::Write, &mut data, shared.addr + (1 << 16)),
        "past the end",
    );
    // The memfd entry the owner lists is the only file mapped: a descriptor naming the
    // guard page's fd as a buffer's changes nothing (the owner's table is used).
    let mut guard_as_buffer = shared.clone();
    guard_as_buffer.shm_fd = Some(owner.shm.guard.fd());
    let renamed = peer(21, owner.desc("evil", vec![guard_as_buffer]));
    assert_eq!(
        copy(&renamed, Op::Read, &mut data, shared.addr),
        Outcome::Done
    );
    assert!(
        heap.iter().all(|&b| b == 0xab),
        "the victim's heap is unharmed"
    );
}

/// A checksummed read out of a mapped buffer comes back with the CRC32C of its bytes,
/// folded by the copy itself; a read that did not ask, and a write, carry none.
#[test]
fn a_checksummed_read_is_folded_by_the_copy() {
    let owner = Owner::new();
    let (_mem, shared) = owner.shared_buffer();
    let victim = peer(1, owner.desc("owner", vec![shared.clone()]));
    let mut copier = Copier::new();
    let mut data: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
    let wrote = copier.copy_checksummed(&victim, Op::Write, &mut data, shared.addr + 3, true);
    assert_eq!((wrote.outcome, wrote.crc), (Outcome::Done, None));
    let mut back = vec![0u8; 5000];
    let read = copier.copy_checksummed(&victim, Op::Read, &mut back, shared.addr + 3, true);
    assert_eq!(read.outcome, Outcome::Done);
    assert_eq!(back, data);
    assert_eq!(read.crc, Some(crate::util::crc32c::crc32c(&data)));
    let plain = copier.copy_checksummed(&victim, Op::Read, &mut back, shared.addr + 3, false);
    assert_eq!((plain.outcome, plain.crc), (Outcome::Done, None));
}

#[test]
fn a_buffer_memfd_is_never_taken_for_a_guard_page_or_a_range_table() {
    let owner = Owner::new();
    let (mem, shared) = owner.shared_buffer();
    let token = owner.shm.page().token.load(Ordering::SeqCst);
    // Anyone may write a registered buffer, so one can carry the (public) token.
    // SAFETY: the buffer is 64 KiB, alive; nothing else touches it now.
    unsafe { (mem.ptr() as *mut u64).write(token) };
    for (guard, ranges) in [
        (mem.fd(), owner.shm.table.fd()),
        (owner.shm.guard.fd(), mem.fd()),
    ] {
        let mut d = owner.desc("evil", vec![shared.clone()]);
        let host = d.host.as_mut().unwrap();
        (host.guard_fd, host.ranges_fd) = (guard, ranges);
        let evil = peer(1, d);
        match copy(&evil, Op::Read, &mut [0; 64], shared.addr) {
            Outcome::PathFailed(why) => assert!(why.contains("is not a"), "{why}"),
            other => panic!("expected no shared-memory path, got {other:?}"),
        }
        assert!(evil.is_disabled(Kind::Shm));
    }
}

#[test]
fn what_the_owner_lists_as_read_only_or_local_stays_so_whatever_the_descriptor_says() {
    let owner = Owner::new();
    let ro_mem = SharedMemory::create("mooncake-buffer", 1 << 16, Sharing::PeersWrite).unwrap();
    let ro = owner.register_as(
        ro_mem.ptr() as u64,
        1 << 16,
        Some(ro_mem.fd()),
        Access::ReadOnly,
    );
    let mut local_mem = vec![5u8; 4096];
    let local_addr = local_mem.as_mut_ptr() as u64;
    let local = owner.register_as(local_addr, 4096, None, Access::LocalOnly);
    // Published as read-write (a forged or an old descriptor).
    let p = peer(1, owner.desc("victim", vec![ro.clone(), local.clone()]));
    let mut data = vec![9u8; 4096];
    let why = refused(
        copy(&p, Op::Write, &mut data, ro.addr),
        "write to read-only",
    );
    assert!(why.contains("read-only"), "{why}");
    assert_eq!(copy(&p, Op::Read, &mut data, ro.addr), Outcome::Done);
    assert!(data.iter().all(|&b| b == 0), "read the owner's zeroes");
    for op in [Op::Read, Op::Write] {
        let why = refused(copy(&p, op, &mut data, local.addr), "local-only");
        assert!(why.contains("to itself"), "{why}");
    }
    assert!(
        local_mem.iter().all(|&b| b == 5),
        "local-only memory is untouched"
    );
    // A memfd sealed so that only its owner writes maps read-only here, whatever the
    // listing says.
    let sealed_mem =
        SharedMemory::create("mooncake-buffer", 1 << 16, Sharing::OwnerWrites).unwrap();
    let sealed = owner.register(sealed_mem.ptr() as u64, 1 << 16, Some(sealed_mem.fd()));
    let p = peer(2, owner.desc("victim", vec![sealed.clone()]));
    let why = refused(
        copy(&p, Op::Write, &mut data, sealed.addr),
        "write to sealed",
    );
    assert!(why.contains("read-only"), "{why}");
    assert_eq!(copy(&p, Op::Read, &mut data, sealed.addr), Outcome::Done);
}

#[test]
fn a_memfd_its_owner_could_shrink_under_us_is_not_mapped() {
    let owner = Owner::new();
    // SAFETY: a valid C string; the result is checked and owned below.
    let fd = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fresh descriptor, owned from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on our descriptor.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 16) }, 0);
    let map = Mapping::map(fd.as_raw_fd(), 1 << 16, true).unwrap();
    let seg = owner.register(map.ptr() as u64, 1 << 16, Some(fd.as_raw_fd()));
    let p = peer(1, owner.desc("shrinker", vec![seg.clone()]));
    let why = refused(copy(&p, Op::Read, &mut [0; 64], seg.addr), "unsealed");
    assert!(why.contains("not the sealed memfd"), "{why}");
}

#[test]
fn a_withdrawn_buffer_is_refused_even_with_the_old_descriptor() {
    let owner = Owner::new();
    let (_mem, shared) = owner.shared_buffer();
    let old = peer(1, owner.desc("victim", vec![shared.clone()]));
    let region = owner.memory.unregister(shared.addr).unwrap();
    owner.shm.unregister(&region);
    refused(
        copy(&old, Op::Write, &mut [1; 64], shared.addr),
        "withdrawn",
    );
}

/// Resident KiB of each of this process's mappings of `len` bytes of a memfd named
/// `name` (from `/proc/self/smaps`, so other tests' memory does not count).
fn resident_kib_of_mappings(name: &str, len: u64) -> Vec<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let link = memfd::memfd_link(name);
    let mut out = Vec::new();
    let mut ours = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.ends_with(':') {
            // A field of the mapping above: `Rss:   4 kB`.
            if let (true, "Rss:") = (ours, first) {
                let kib = line[4..].trim().trim_end_matches("kB").trim();
                out.push(kib.parse().unwrap());
            }
            continue;
        }
        // A mapping: `start-end perms offset dev inode path`.
        let bounds: Vec<u64> = first
            .split('-')
            .filter_map(|x| u64::from_str_radix(x, 16).ok())
            .collect();
        ours = line.ends_with(&link) && bounds.len() == 2 && bounds[1] - bounds[0] == len;
    }
    out
}

#[test]
fn mapping_an_untouched_64_gib_segment_costs_no_memory() {
    const SIZE: usize = 64 << 30;
    const NAME: &str = "mooncake-test-64g";
    let owner = Owner::new();
    // memfds live on the kernel's internal shm mount: /dev/shm's size does not apply,
    // and the size stays virtual until touched.
    let mem = SharedMemory::create(NAME, SIZE, Sharing::PeersWrite).unwrap();
    let seg = owner.register(mem.ptr() as u64, SIZE as u64, Some(mem.fd()));
    assert_eq!(
        resident_kib_of_mappings(NAME, SIZE as u64),
        [0],
        "the owner's, untouched"
    );
    let node = peer(1, owner.desc("node", vec![seg.clone()]));
    let mut back = vec![1u8; 4096];
    // The copier maps all 64 GiB and reads one page from the middle.
    let middle = seg.addr + SIZE as u64 / 2;
    let mut copier = Copier::new();
    assert_eq!(
        copier.copy(&node, Op::Read, &mut back, middle),
        Outcome::Done
    );
    assert!(back.iter().all(|&b| b == 0));
    let resident = resident_kib_of_mappings(NAME, SIZE as u64);
    assert_eq!(
        resident.len(),
        2,
        "owner's and copier's mappings: {resident:?}"
    );
    assert!(
        resident.iter().sum::<u64>() <= 64,
        "only what was read: {resident:?}"
    );
}
