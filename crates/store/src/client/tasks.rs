//! Copy and move tasks (Mooncake's `create_copy_task`, `create_move_task` and
//! `query_task`): a replica of an object is added on named segments, or moved from one
//! segment to another, in the background.
//!
//! Creating a task asks the master at once (`CopyStart`: arguments checked, the object
//! leased, room placed on the targets), so a bad request fails then, as Mooncake's does.
//! The client's task thread then runs the tasks in order: it reads the object's replica
//! through a staging buffer, writes it to each placed replica, checks the bytes against
//! the object's CRC32C and ends the copy (`CopyEnd`), which adds the replicas (and for a
//! move drops the source segment's). Tasks are this client's: their ids name them to
//! `query_task` of the same client.

use crate::util::sync::Unpoisoned;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{run_batch, scatter, Client, Fragments, MasterSession, SegmentIds};
use crate::engine::Engine;
use crate::error::{Code, Error, Result};
use crate::protocol::{shown_key, CopyPlan, ReplicaDesc, Request, Response};
use crate::transport::Op;
use crate::util::crc32c::{crc32c, crc32c_combine};

/// A task's id: this client's id and a sequence number (Mooncake's UUID pair).
pub type TaskId = (u64, u64);

/// What a task does (Mooncake's `TaskType` numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// Adds replicas on the target segments.
    Copy = 0,
    /// Moves the source segment's replica to the target segment.
    Move = 1,
}

/// Where a task stands (Mooncake's `TaskStatus` numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskStatus {
    /// Waiting for the task thread.
    Pending = 0,
    /// Moving bytes.
    Processing = 1,
    /// Ended without effect; `message` says why.
    Failed = 2,
    /// Done.
    Success = 3,
}

/// A task as `query_task` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskInfo {
    /// The task's id.
    pub id: TaskId,
    /// Copy or move.
    pub kind: TaskKind,
    /// Where it stands.
    pub status: TaskStatus,
    /// When it was created, in milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// When its status last changed, likewise.
    pub updated_ms: u64,
    /// The client running it (this one: `(0, client id)`).
    pub assigned_client: TaskId,
    /// Why it failed, or that it succeeded.
    pub message: String,
}

/// Finished tasks kept for `query_task` (the oldest go first).
const MAX_FINISHED: usize = 10_000;
/// Attempts at placing a task's replicas when the pool has no room (Mooncake retries
/// only that failure), and the pause before the first retry (it grows linearly).
const PLACE_ATTEMPTS: u32 = 4;
const PLACE_BACKOFF: Duration = Duration::from_millis(50);
/// The staging buffer a copy moves bytes through, at most.
const STAGE_BYTES: u64 = 16 << 20;

struct Task {
    info: TaskInfo,
    key: String,
    source: String,
    targets: Vec<String>,
    /// The master's placement, once it made one.
    plan: Option<CopyPlan>,
}

#[derive(Default)]
struct TaskTable {
    tasks: HashMap<TaskId, Task>,
    queue: VecDeque<TaskId>,
    finished: VecDeque<TaskId>,
    last: u64,
}

/// The tasks of one client and the thread that runs them.
#[derive(Default)]
pub(super) struct Tasks {
    table: Mutex<TaskTable>,
    /// Signalled when a task is queued or the client closes.
    queued: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl Tasks {
    fn lock(&self) -> MutexGuard<'_, TaskTable> {
        self.table.locked()
    }

    /// Wakes the task thread to see the client closing, and waits for it.
    pub(super) fn stop(&self) {
        drop(self.lock());
        self.queued.notify_all();
        let worker = self.worker.locked().take();
        if let Some(w) = worker {
            let _ = w.join();
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Client {
    /// Starts a task adding a replica of `key` on each segment named in `targets` (a
    /// target holding one already is left as it is); its id. Fails at once, creating
    /// no task, on a bad argument (`INVALID_PARAMS`: no target, one named twice or not
    /// mounted), a missing object (`OBJECT_NOT_FOUND`), or a target taking no new
    /// objects (`UNAVAILABLE_IN_CURRENT_STATUS`).
    pub fn create_copy_task(&self, key: &str, targets: &[&str]) -> Result<TaskId> {
        self.create_task(TaskKind::Copy, key, "", targets)
    }

    /// Starts a task moving `key`'s replica on segment `source` to segment `target`;
    /// its id. Fails at once as `create_copy_task` does, and when `source` holds no
    /// replica or is `target` (`INVALID_PARAMS`).
    pub fn create_move_task(&self, key: &str, source: &str, target: &str) -> Result<TaskId> {
        if source.is_empty() {
            return Err(Error::invalid("a move needs a source segment"));
        }
        self.create_task(TaskKind::Move, key, source, &[target])
    }

    fn create_task(
        &self,
        kind: TaskKind,
        key: &str,
        source: &str,
        targets: &[&str],
    ) -> Result<TaskId> {
        self.start_task_thread()?;
        let targets: Vec<String> = targets.iter().map(|t| (*t).to_owned()).collect();
        let plan = match self.shared.copy_start(key, source, &targets) {
            Ok(plan) => Some(plan),
            // No room now: the task thread tries again, as Mooncake's executor does.
            Err(e) if e.code() == Code::NoAvailableHandle => None,
            Err(e) => return Err(e),
        };
        let now = now_ms();
        let id = {
            let mut table = self.shared.tasks.lock();
            table.last += 1;
            let id = (self.shared.id, table.last);
            let task = Task {
                info: TaskInfo {
                    id,
                    kind,
                    status: TaskStatus::Pending,
                    created_ms: now,
                    updated_ms: now,
                    assigned_client: (0, self.shared.id),
                    message: String::new(),
                },
                key: key.to_owned(),
                source: source.to_owned(),
                targets,
                plan,
            };
            table.tasks.insert(id, task);
            table.queue.push_back(id);
            id
        };
        self.shared.tasks.queued.notify_all();
        Ok(id)
    }

    /// Starts the task thread unless it runs.
    fn start_task_thread(&self) -> Result<()> {
        let mut worker = self.shared.tasks.worker.locked();
        if worker.is_none() {
            let s = self.shared.clone();
            *worker = Some(
                std::thread::Builder::new()
                    .name("mc-store-tasks".into())
                    .spawn(move || s.task_loop())
                    .map_err(|e| Error::io("spawning the task thread", e))?,
            );
        }
        Ok(())
    }

    /// Where task `id` of this client stands; None for an id it does not know (never
    /// created here, or finished long enough ago to be forgotten).
    pub fn query_task(&self, id: TaskId) -> Option<TaskInfo> {
        self.shared
            .tasks
            .lock()
            .tasks
            .get(&id)
            .map(|t| t.info.clone())
    }
}

impl MasterSession {
    fn copy_start(&self, key: &str, source: &str, targets: &[String]) -> Result<CopyPlan> {
        let req = Request::CopyStart {
            client: self.id,
            key: key.to_owned(),
            source: source.to_owned(),
            targets: targets.to_vec(),
        };
        match self.call_with_touches(&req)? {
            Response::CopyStart(plan) => Ok(plan),
            other => Err(Error::protocol(format!(
                "unexpected CopyStart answer {other:?}"
            ))),
        }
    }

    /// Runs queued tasks, in order, until the client closes.
    fn task_loop(self: Arc<Self>) {
        loop {
            let (id, key, source, targets, plan) = {
                let mut table = self.tasks.lock();
                let id = loop {
                    if self.stop.is_raised() {
                        return;
                    }
                    if let Some(id) = table.queue.pop_front() {
                        break id;
                    }
                    table = self
                        .tasks
                        .queued
                        .wait(table)
                        .unwrap_or_else(|e| e.into_inner());
                };
                let Some(task) = table.tasks.get_mut(&id) else {
                    continue;
                };
                task.info.status = TaskStatus::Processing;
                task.info.updated_ms = now_ms();
                (
                    id,
                    task.key.clone(),
                    task.source.clone(),
                    task.targets.clone(),
                    task.plan.take(),
                )
            };
            let outcome = self.run_task(&key, &source, &targets, plan);
            let mut table = self.tasks.lock();
            if let Some(task) = table.tasks.get_mut(&id) {
                task.info.updated_ms = now_ms();
                (task.info.status, task.info.message) = match &outcome {
                    Ok(()) => (TaskStatus::Success, "Task completed successfully".into()),
                    Err(e) => {
                        log::warn!("task {id:?} on {} failed: {e}", shown_key(&key));
                        (TaskStatus::Failed, e.to_string())
                    }
                };
            }
            table.finished.push_back(id);
            while table.finished.len() > MAX_FINISHED {
                if let Some(old) = table.finished.pop_front() {
                    table.tasks.remove(&old);
                }
            }
        }
    }

    /// Copies `key` as planned (placing it first when creation found no room), then
    /// ends the copy with the master.
    fn run_task(
        &self,
        key: &str,
        source: &str,
        targets: &[String],
        plan: Option<CopyPlan>,
    ) -> Result<()> {
        let plan = match plan {
            Some(p) => p,
            None => self.place_retrying(key, source, targets)?,
        };
        // The lease taken at creation may have run out while the task waited: a
        // lookup renews it (and finds an object that went away meanwhile).
        let renewed = self
            .call_with_touches(&Request::GetReplicas {
                keys: vec![key.to_owned()],
            })
            .and_then(|r| match r {
                Response::GetReplicas(mut v) if v.len() == 1 => v
                    .pop()
                    .unwrap_or(Err(Code::Internal))
                    .map(drop)
                    .map_err(|c| Error::new(c, format!("copying {}", shown_key(key)))),
                other => Err(Error::protocol(format!("unexpected answer {other:?}"))),
            });
        let copied = renewed.and_then(|()| copy_bytes(&self.engine, &plan));
        let ended = self.call_with_touches(&Request::CopyEnd {
            client: self.id,
            ticket: plan.ticket,
            done: copied.is_ok(),
        });
        copied?;
        ended.map(drop)
    }

    /// `copy_start`, tried again a few times while the pool has no room.
    fn place_retrying(&self, key: &str, source: &str, targets: &[String]) -> Result<CopyPlan> {
        let mut attempt = 1;
        loop {
            match self.copy_start(key, source, targets) {
                Err(e) if e.code() == Code::NoAvailableHandle && attempt < PLACE_ATTEMPTS => {
                    self.pause(PLACE_BACKOFF * attempt);
                    if self.stop.is_raised() {
                        return Err(e);
                    }
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}

/// Engine requests moving `frags` (object offset, local address, length) to or from
/// the matching bytes of `replica`.
fn replica_requests(
    engine: &Engine,
    op: Op,
    frags: &Fragments,
    replica: &ReplicaDesc,
) -> Result<Vec<crate::engine::Request>> {
    let mut reqs = Vec::new();
    let mut off = 0;
    let mut segments = SegmentIds::default();
    for piece in &replica.pieces {
        scatter(&mut segments, engine, op, frags, off, piece, &mut reqs)?;
        off += piece.len;
    }
    Ok(reqs)
}

/// Runs `reqs` as one batch; the first failure, if any.
fn run_all(engine: &Engine, reqs: &[crate::engine::Request]) -> Result<()> {
    run_batch(engine, reqs).into_iter().collect()
}

/// Reads the plan's source replica through a staging buffer and writes it to every
/// target replica, checking the bytes read against the object's CRC32C.
fn copy_bytes(engine: &Engine, plan: &CopyPlan) -> Result<()> {
    if plan.targets.is_empty() {
        return Ok(()); // every target held a replica already
    }
    let mut stage = vec![0u8; plan.size.min(STAGE_BYTES) as usize];
    let mut crc = 0;
    let mut off = 0;
    while off < plan.size {
        let len = (plan.size - off).min(STAGE_BYTES);
        let frags: Fragments = vec![(off, stage.as_mut_ptr() as u64, len)];
        run_all(
            engine,
            &replica_requests(engine, Op::Read, &frags, &plan.source)?,
        )?;
        crc = crc32c_combine(crc, crc32c(&stage[..len as usize]), len);
        let mut writes = Vec::new();
        for target in &plan.targets {
            writes.extend(replica_requests(engine, Op::Write, &frags, target)?);
        }
        run_all(engine, &writes)?;
        off += len;
    }
    if crc != plan.crc32c {
        return Err(Error::new(
            Code::ChecksumMismatch,
            format!("copy read crc32c {crc:#010x}, stored {:#010x}", plan.crc32c),
        ));
    }
    Ok(())
}
