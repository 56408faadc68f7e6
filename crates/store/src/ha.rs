//! Master leader election through etcd, with Mooncake's key and value: the leader
//! holds `mooncake-store/<cluster_id>/master_view` (value: its RPC address) under a
//! lease it keeps alive; standbys wait for the key to go and race to create it.
//!
//! Fencing: the key's create revision is the leader's **epoch**. etcd hands out
//! revisions in order, so every later leader has a larger epoch, and a leader knows it
//! still leads only while its keep-alives succeed: [`Leadership::is_current`] turns
//! false the moment a keep-alive fails or reports the lease gone, before etcd can
//! have let anyone else in (the keep-alive period is a third of the TTL).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use crate::util::sync::StopSignal;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Code, Error, Result};
use crate::etcd::EtcdClient;

/// Mooncake's default cluster id.
pub const DEFAULT_CLUSTER_ID: &str = "mooncake_cluster";
/// Mooncake's lease TTL for the master view.
pub const DEFAULT_LEASE_TTL_S: i64 = 5;

/// The cluster id to use: `explicit` if given, else `MC_STORE_CLUSTER_ID` (Mooncake's
/// variable), else [`DEFAULT_CLUSTER_ID`].
pub fn cluster_id(explicit: Option<String>) -> String {
    explicit
        .or_else(|| std::env::var("MC_STORE_CLUSTER_ID").ok())
        .filter(|c| !c.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_CLUSTER_ID.to_owned())
}

/// The etcd key holding the leader's address.
pub fn view_key(cluster_id: &str) -> String {
    format!("mooncake-store/{cluster_id}/master_view")
}

/// Who leads, as etcd says now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterView {
    /// The leader's RPC address (`host:port`).
    pub address: String,
    /// The leader's epoch: the create revision of its view key.
    pub epoch: i64,
}

/// The current leader, if any.
pub fn read_view(etcd: &EtcdClient, cluster_id: &str) -> Result<Option<MasterView>> {
    let Some(kv) = etcd.get(view_key(cluster_id).as_bytes())? else {
        return Ok(None);
    };
    let address = String::from_utf8(kv.value)
        .map_err(|_| Error::new(Code::EtcdOperationError, "master view is not UTF-8"))?
        .trim()
        .to_owned();
    Ok(Some(MasterView {
        address,
        epoch: kv.create_revision,
    }))
}

/// Held while this process leads; dropping it resigns.
pub struct Leadership {
    etcd: Arc<EtcdClient>,
    key: String,
    lease: i64,
    epoch: i64,
    current: Arc<AtomicBool>,
    stop: Arc<StopSignal>,
    keeper: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("key", &self.key)
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl Leadership {
    /// This leader's epoch.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Whether this process still leads (every keep-alive so far succeeded). Check it
    /// before acting as leader; once false it never turns true again.
    pub fn is_current(&self) -> bool {
        self.current.load(Ordering::SeqCst)
    }

    /// Replaces the address in the view (the leader learnt its own, e.g. a port the
    /// OS picked, only after winning); fails once leadership is lost.
    pub fn announce(&self, address: &str) -> Result<()> {
        if !self.is_current() {
            return Err(Error::new(
                Code::UnavailableInCurrentStatus,
                "no longer the leader",
            ));
        }
        let kv = self.etcd.get(self.key.as_bytes())?;
        match kv {
            Some(kv) if kv.lease == self.lease => {
                if self.etcd.put_if(
                    self.key.as_bytes(),
                    kv.mod_revision,
                    address.as_bytes(),
                    self.lease,
                )? {
                    return Ok(());
                }
                Err(Error::new(
                    Code::UnavailableInCurrentStatus,
                    "the master view changed under the leader",
                ))
            }
            _ => Err(Error::new(
                Code::UnavailableInCurrentStatus,
                "the master view is no longer this leader's",
            )),
        }
    }

    /// A flag that turns false when leadership is lost, for code that must stop then.
    pub fn current_flag(&self) -> Arc<AtomicBool> {
        self.current.clone()
    }

    /// Steps down: stops the keep-alives and revokes the lease, which removes the view
    /// key so a standby takes over at once.
    pub fn resign(mut self) {
        self.stop_keeper();
        if let Err(e) = self.etcd.lease_revoke(self.lease) {
            log::warn!("resigning: revoking lease {:#x}: {e}", self.lease);
        }
    }

    fn stop_keeper(&mut self) {
        self.current.store(false, Ordering::SeqCst);
        self.stop.raise();
        if let Some(k) = self.keeper.take() {
            let _ = k.join();
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if self.keeper.is_some() {
            self.stop_keeper();
            let _ = self.etcd.lease_revoke(self.lease);
        }
    }
}

fn keep_alive(etcd: &EtcdClient, lease: i64, ttl_s: i64, current: &AtomicBool, stop: &StopSignal) {
    let period = Duration::from_millis((ttl_s.max(1) as u64 * 1000) / 3);
    let mut last_ok = Instant::now();
    while !stop.wait(period) {
        match etcd.lease_keepalive(lease) {
            Ok(ttl) if ttl > 0 => last_ok = Instant::now(),
            Ok(_) => {
                log::error!("master lease {lease:#x} expired: no longer the leader");
                current.store(false, Ordering::SeqCst);
                return;
            }
            Err(e) => {
                // etcd may still count the lease as alive; we cannot know, so stop
                // leading once a whole TTL passed without a confirmed renewal.
                log::warn!("master lease keep-alive failed: {e}");
                if last_ok.elapsed() >= Duration::from_secs(ttl_s.max(1) as u64) * 2 / 3 {
                    log::error!(
                        "master lease {lease:#x} not renewed in time: no longer the leader"
                    );
                    current.store(false, Ordering::SeqCst);
                    return;
                }
            }
        }
    }
}

/// Blocks until this process leads `cluster_id` with `address` as the view, or `stop`
/// is raised (then `Code::UnavailableInCurrentStatus`). Standbys look again every
/// third of the TTL.
pub fn campaign(
    etcd: Arc<EtcdClient>,
    cluster_id: &str,
    address: &str,
    ttl_s: i64,
    stop: &StopSignal,
) -> Result<Leadership> {
    let key = view_key(cluster_id);
    let poll = Duration::from_millis((ttl_s.max(1) as u64 * 1000) / 3);
    let mut announced = None;
    loop {
        if stop.is_raised() {
            return Err(Error::new(
                Code::UnavailableInCurrentStatus,
                "stopped while standing by for leadership",
            ));
        }
        // While someone leads, only look: no lease is granted just to be thrown away.
        if let Some(view) = read_view(&etcd, cluster_id)? {
            if announced.as_ref() != Some(&view) {
                log::info!("standing by: {} leads (epoch {})", view.address, view.epoch);
            }
            // Woken by the view's change (the leader's lease running out deletes it),
            // else look again after `poll`.
            if let Err(e) = etcd.watch_change(key.as_bytes(), view.epoch + 1, poll) {
                log::debug!("watching the master view: {e}; polling");
                stop.wait(poll);
            }
            announced = Some(view);
            continue;
        }
        let lease = etcd.lease_grant(ttl_s)?;
        if etcd.put_if(key.as_bytes(), 0, address.as_bytes(), lease)? {
            let epoch = match etcd.get(key.as_bytes())? {
                Some(kv) if kv.lease == lease => kv.create_revision,
                _ => {
                    // Lost between the two calls (the lease expired already): retry.
                    let _ = etcd.lease_revoke(lease);
                    continue;
                }
            };
            let current = Arc::new(AtomicBool::new(true));
            let keeper_stop = StopSignal::new();
            let (e, c, s) = (etcd.clone(), current.clone(), keeper_stop.clone());
            let keeper = std::thread::Builder::new()
                .name("mc-ha-lease".into())
                .spawn(move || keep_alive(&e, lease, ttl_s, &c, &s))
                .map_err(|e| Error::io("spawning the lease keeper", e))?;
            log::info!("leading cluster {cluster_id} as {address} (epoch {epoch})");
            return Ok(Leadership {
                etcd,
                key,
                lease,
                epoch,
                current,
                stop: keeper_stop,
                keeper: Some(keeper),
            });
        }
        // Someone else got in between the look and the put: look again.
        let _ = etcd.lease_revoke(lease);
    }
}
