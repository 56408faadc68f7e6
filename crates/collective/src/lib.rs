//! Mooncake PG: fault-tolerant collectives over the transfer engine.
//!
//! A [`Group`] is one rank of N. Each rank owns one registered buffer (see
//! [`layout`]): per-peer receive cells that peers fill with one-sided writes, credit
//! words that tell a sender how much of its channel is free, and control slots for
//! membership records. Collectives are sequences of message exchanges over those
//! channels; every wait is bounded by the group's timeout, and an operation that does
//! not hear from a rank in time fails naming it ([`Group::failed_ranks`]).
//!
//! Membership is a view: an epoch number and the set of active ranks. Inactive ranks
//! are holes (rank numbers never change; collectives skip them). A view changes only
//! through [`Group::sync_after_failure`] or a proposal ([`Group::propose`], to
//! activate or deactivate ranks): the lowest live member coordinates, collects the
//! members' reports and, with a majority of the view, publishes the next one to all of
//! them and to the ranks it leaves out (`membership.rs`, README "Mooncake PG"); a rank
//! that deactivates only itself publishes the view without it by itself. Messages
//! carry their epoch, so nothing sent in an older view is ever taken for data in a
//! newer one.
//!
//! User buffers are host memory; the `*_device` methods (`staged.rs`) take device
//! memory (CUDA, HIP, Ascend) by address and stage it through `mooncake_engine::device`.

// The layers below, named as the code in this crate names them (`crate::engine`, ...).
use mooncake_base::{error, sys, util};
use mooncake_engine::{device, engine, transport, Request};

mod channel;
pub mod dtype;
pub mod layout;
mod membership;
mod ops;
pub mod seam;
mod staged;
pub mod view;

use crate::util::sync::Unpoisoned;
use std::sync::Mutex;
use std::time::Duration;

pub use dtype::{DType, ReduceOp};
pub use layout::Mask;
pub use seam::{Clock, Transport};

use crate::engine::{Engine, EngineConfig, SegmentId};
use crate::error::{Error, Result};
use channel::State;
use layout::Layout;
use seam::{EngineTransport, WallClock};

/// How a group is set up; every rank of a group must agree on `world_size`,
/// `cells_per_peer` and `cell_bytes`.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    /// This process's rank.
    pub rank: usize,
    /// Rank numbers are `0..world_size`.
    pub world_size: usize,
    /// A replacement or late rank: starts inactive and calls [`Group::join`].
    pub is_extension: bool,
    /// Ranks active at start (default: all but an extension's own).
    pub active_ranks: Option<Vec<bool>>,
    /// How long an operation waits for a peer before failing.
    pub timeout: Duration,
    /// After a failed operation, propose deactivating the ranks it missed.
    pub auto_deactivate_on_failure: bool,
    /// After a failed operation, reconcile membership at the start of the next one.
    pub auto_sync_on_failure: bool,
    /// A caller's collective that enters a new view at its start (published, or
    /// announced and agreed on there) does not run in it: it fails with
    /// `UnavailableInCurrentStatus` while this rank stays a member, so the caller
    /// (`mooncake.pg`) runs its agreement round (`agree_max`) first, as the others do.
    pub agree_on_new_view: bool,
    /// Messages in flight per channel.
    pub cells_per_peer: usize,
    /// Bytes per cell (large messages are cut into cells).
    pub cell_bytes: usize,
    /// The engine this rank runs (bind address, protocol, workers).
    pub engine: EngineConfig,
    /// Bytes of staging memory (pinned, for device collectives) kept between
    /// operations, and the most all-reduce scratch kept (see [`Group::all_reduce`]);
    /// more is freed when an operation ends.
    pub staging_keep_bytes: usize,
}

impl GroupOptions {
    /// Defaults for `rank` of `world_size`.
    pub fn new(rank: usize, world_size: usize) -> GroupOptions {
        // P2P: peers reach each other by address, no metadata service needed.
        let engine = EngineConfig {
            metadata: "P2PHANDSHAKE".into(),
            ..EngineConfig::default()
        };
        GroupOptions {
            rank,
            world_size,
            is_extension: false,
            active_ranks: None,
            timeout: Duration::from_secs(5),
            auto_deactivate_on_failure: true,
            auto_sync_on_failure: true,
            agree_on_new_view: false,
            cells_per_peer: 4,
            cell_bytes: 1 << 20,
            engine,
            staging_keep_bytes: 256 << 20,
        }
    }

    /// Sets one option from its name as the C ABI and Python spell it.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let bad = || Error::invalid(format!("option {key}={value:?}"));
        let flag = || match value {
            "1" | "true" | "True" => Ok(true),
            "0" | "false" | "False" => Ok(false),
            _ => Err(bad()),
        };
        let num = || value.parse::<usize>().map_err(|_| bad());
        match key {
            "is_extension" => self.is_extension = flag()?,
            "auto_deactivate_on_failure" => self.auto_deactivate_on_failure = flag()?,
            "auto_sync_on_failure" => self.auto_sync_on_failure = flag()?,
            "agree_on_new_view" => self.agree_on_new_view = flag()?,
            "timeout_ms" => {
                // At most a day: deadlines are computed as now + timeout.
                let ms = num()? as u64;
                if ms == 0 || ms > 86_400_000 {
                    return Err(Error::invalid(format!(
                        "option timeout_ms={value}: 1..=86400000"
                    )));
                }
                self.timeout = Duration::from_millis(ms);
            }
            "cells_per_peer" => self.cells_per_peer = num()?,
            "cell_bytes" => self.cell_bytes = num()?,
            "staging_keep_bytes" => self.staging_keep_bytes = num()?,
            // Capacity is the world size here; a larger one is accepted and means nothing.
            "max_group_size" => {
                num()?;
            }
            "active_ranks" => {
                self.active_ranks = Some(
                    value
                        .chars()
                        .map(|c| match c {
                            '1' => Ok(true),
                            '0' => Ok(false),
                            _ => Err(bad()),
                        })
                        .collect::<Result<_>>()?,
                )
            }
            _ => self.engine.set(key, value)?,
        }
        Ok(())
    }

    fn check(&self) -> Result<Layout> {
        if self.world_size == 0 || self.world_size > layout::MAX_RANKS {
            return Err(Error::invalid(format!(
                "world_size {} (1..={})",
                self.world_size,
                layout::MAX_RANKS
            )));
        }
        if self.rank >= self.world_size {
            return Err(Error::invalid(format!(
                "rank {} of world_size {}",
                self.rank, self.world_size
            )));
        }
        if !(1..=64).contains(&self.cells_per_peer) {
            return Err(Error::invalid("cells_per_peer must be 1..=64"));
        }
        if !(4096..=(64 << 20)).contains(&self.cell_bytes) {
            return Err(Error::invalid("cell_bytes must be 4096..=64 MiB"));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid("timeout must be positive"));
        }
        if let Some(a) = &self.active_ranks {
            if a.len() != self.world_size {
                return Err(Error::invalid(format!(
                    "active_ranks has {} entries for world_size {}",
                    a.len(),
                    self.world_size
                )));
            }
        }
        Ok(Layout {
            ranks: self.world_size,
            cells: self.cells_per_peer,
            cell_bytes: self.cell_bytes,
        })
    }
}

/// What a membership proposal came to (numbered as upstream's `ProposalStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProposalStatus {
    /// Not applied; see the reason.
    Rejected = 0,
    /// Applied as asked.
    Applied = 1,
    /// Applied, and members that did not answer the coordinator in time were left out.
    AppliedWithDroppedRanks = 2,
}

/// The answer to a proposal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProposalResponse {
    /// What happened.
    pub status: ProposalStatus,
    /// The epoch in force afterwards, counted as [`Group::epoch`] counts it.
    pub new_epoch: u64,
    /// Members left out for not answering.
    pub dropped_ranks: Vec<usize>,
    /// Why it was rejected (empty otherwise).
    pub reject_reason: String,
}

/// What `sync_after_failure` did (numbered as upstream's `SyncAfterFailureStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncStatus {
    /// The members agreed on a new view.
    Reconciled = 0,
    /// Nothing was pending: no failure seen and no change announced.
    NoPending = 1,
    /// This rank is not a member (deactivated): it must join again.
    Rejected = 2,
}

/// One rank of a collective group.
pub struct Group {
    /// How this rank's writes reach its peers (the engine, but for the simulation).
    transport: Box<dyn Transport>,
    /// Every deadline and pause (the wall clock, but for the simulation).
    clock: Box<dyn Clock>,
    /// Address of this rank's buffer (owned by the transport, freed with it).
    base: usize,
    layout: Layout,
    options: GroupOptions,
    state: Mutex<State>,
    /// The current and previous views, kept apart from `state` so `epoch` and
    /// `active_ranks` answer while a view change holds `state`; written only with
    /// `state` held.
    views: Mutex<membership::ViewHistory>,
    /// Host copies of device buffers, kept between operations (`staged.rs`).
    staging: Mutex<Vec<crate::device::Staging>>,
}

impl Drop for Group {
    fn drop(&mut self) {
        // An operation returns once its messages are posted; they must land before
        // the engine (and its queues) goes, or a peer would wait for them in vain.
        let mut st = self.lock();
        self.drain(&mut st);
    }
}

/// Whether a connection to `segment`'s address (a peer-to-peer segment is named by the
/// address its engine answers handshakes on) is refused. A rank publishes its address
/// only once it listens there, so a refusal means the process is gone: waiting out the
/// timeout for it at start would make this rank late for its live peers' first
/// operation. A name that is not an address is never taken for refusing.
fn refuses_connections(segment: &str) -> bool {
    use std::net::{TcpStream, ToSocketAddrs};
    let Some(addr) = segment.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return false;
    };
    matches!(
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// A peer's address as exchanged at rendezvous: `segment#buffer#layout`.
fn parse_address(s: &str) -> Result<(String, u64, String)> {
    let mut parts = s.rsplitn(3, '#');
    let (Some(layout), Some(addr), Some(segment)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(Error::invalid(format!("group address {s:?}")));
    };
    let addr = u64::from_str_radix(addr, 16)
        .map_err(|_| Error::invalid(format!("group address {s:?}: buffer")))?;
    Ok((segment.to_owned(), addr, layout.to_owned()))
}

impl Group {
    /// Starts this rank: an engine and its buffer. Peers are reached after
    /// [`connect`](Self::connect) with everyone's [`address`](Self::address).
    pub fn new(options: GroupOptions) -> Result<Group> {
        options.check()?;
        let mut cfg = options.engine.clone();
        // A stuck write must end within an operation's wait, so its failure is seen.
        cfg.transfer_timeout = options.timeout;
        let engine = Engine::new(cfg)?;
        Group::with_seams(
            options,
            Box::new(EngineTransport(engine)),
            Box::new(WallClock),
        )
    }

    /// [`new`](Self::new) over another transport and clock: for the simulation,
    /// which runs ranks on virtual time and moves their writes itself.
    pub fn with_seams(
        options: GroupOptions,
        transport: Box<dyn Transport>,
        clock: Box<dyn Clock>,
    ) -> Result<Group> {
        let layout = options.check()?;
        let base = transport.allocate_buffer(layout.total())? as usize;
        let state = State::new(&options, layout);
        let views = membership::ViewHistory::starting(state.epoch, state.mask);
        Ok(Group {
            transport,
            clock,
            base,
            layout,
            options,
            state: Mutex::new(state),
            views: Mutex::new(views),
            staging: Mutex::new(Vec::new()),
        })
    }

    /// This rank's address for the rendezvous (segment, buffer and layout).
    pub fn address(&self) -> String {
        format!(
            "{}#{:x}#{}",
            self.transport.segment_name(),
            self.base,
            self.layout_tag()
        )
    }

    fn layout_tag(&self) -> String {
        format!(
            "{}-{}-{}",
            self.layout.ranks, self.layout.cells, self.layout.cell_bytes
        )
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.options.rank
    }

    /// Rank numbers are `0..size()`.
    pub fn size(&self) -> usize {
        self.options.world_size
    }

    /// The configured operation timeout.
    pub fn timeout(&self) -> Duration {
        self.options.timeout
    }

    /// Reaches the peers: `addresses[r]` is rank r's [`address`](Self::address), empty
    /// for a rank not running. A peer that cannot be reached within the timeout is
    /// left unreached (operations with it fail naming it). An extension rank then
    /// calls [`join`](Self::join).
    pub fn connect(&self, addresses: &[String]) -> Result<()> {
        if addresses.len() != self.size() {
            return Err(Error::invalid(format!(
                "{} addresses for world_size {}",
                addresses.len(),
                self.size()
            )));
        }
        let mut parsed = Vec::with_capacity(addresses.len());
        for (r, a) in addresses.iter().enumerate() {
            if a.is_empty() || r == self.rank() {
                parsed.push(None);
                continue;
            }
            let (segment, addr, layout) = parse_address(a)?;
            if layout != self.layout_tag() {
                return Err(Error::invalid(format!(
                    "rank {r} has layout {layout}, this rank {} (world_size, cells_per_peer and \
                     cell_bytes must agree)",
                    self.layout_tag()
                )));
            }
            parsed.push(Some((segment, addr)));
        }
        let mut st = self.lock();
        let deadline = self.clock.now() + self.options.timeout;
        for (r, p) in parsed.into_iter().enumerate() {
            if let Some((segment, addr)) = p {
                match self.open_peer(&segment, deadline) {
                    Ok(seg) => st.set_peer(r, seg, addr, 0),
                    Err(e) => log::warn!("group rank {}: rank {r} unreachable: {e}", self.rank()),
                }
            }
        }
        Ok(())
    }

    /// Opens a peer's segment, retrying until `deadline` while the peer may still be
    /// coming up; at once when nothing listens at its address any more.
    fn open_peer(&self, segment: &str, deadline: std::time::Instant) -> Result<SegmentId> {
        loop {
            match self.transport.open_segment(segment) {
                Ok(s) => return Ok(s),
                Err(e)
                    if self.clock.now() >= deadline
                        || self.transport.refuses_connections(segment) =>
                {
                    return Err(e)
                }
                Err(_) => self.clock.sleep(Duration::from_millis(20)),
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    fn views(&self) -> std::sync::MutexGuard<'_, membership::ViewHistory> {
        self.views.locked()
    }

    /// The current active ranks (answers at once, even during a view change).
    pub fn active_ranks(&self) -> Vec<bool> {
        let mask = self.views().mask;
        (0..self.size()).map(|r| mask.has(r)).collect()
    }

    /// The current membership epoch as users count it: 1 at start, one more per
    /// membership change, 0 before an extension is admitted (see
    /// [`view::public_epoch`]). Answers at once, even during a view change.
    pub fn epoch(&self) -> u64 {
        view::public_epoch(self.views().epoch)
    }

    /// Ranks the last failed operation did not hear from in time (empty after success);
    /// once a view is adopted, only those it left out (a member answered its coordinator).
    pub fn failed_ranks(&self) -> Vec<usize> {
        self.lock().last_failed.clone()
    }

    /// Whether each rank is active or ready to be activated (a process has claimed it
    /// with `join`); false for a rank that failed and has no replacement yet.
    pub fn peer_state(&self, ranks: &[usize]) -> Vec<bool> {
        let st = self.lock();
        ranks
            .iter()
            .map(|&r| r < self.size() && (st.mask.has(r) || self.fresh_join(&st, r).is_some()))
            .collect()
    }

    fn buf(&self, off: usize) -> *mut u8 {
        (self.base + off) as *mut u8
    }

    /// A copy of the control slot at `off` of our buffer.
    fn read_slot(&self, off: usize) -> [u8; layout::RECORD] {
        let mut slot = [0u8; layout::RECORD];
        // SAFETY: control slots lie inside our buffer (Layout), which lives as long as
        // the engine; peers may be writing it, which the record's CRC detects.
        unsafe { std::ptr::copy_nonoverlapping(self.buf(off), slot.as_mut_ptr(), layout::RECORD) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        slot
    }
}
