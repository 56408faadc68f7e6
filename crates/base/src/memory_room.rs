//! How much more memory this process may commit before the machine, or the container
//! it runs in, runs short: the kernel's `MemAvailable`, and what every memory cgroup
//! above the process still allows (v2 `memory.max`, and `memory.high`, past which the
//! kernel throttles the whole group; v1 `memory.limit_in_bytes`). A
//! process that commits memory on its own initiative (not because a caller wrote to
//! it) asks this first, so it never wakes the OOM killer by itself.

use std::path::{Path, PathBuf};

/// Memory this process may still commit, and the smallest limit that applies to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRoom {
    /// Bytes that may be committed before some limit is reached.
    pub free: u64,
    /// The tightest limit: the machine's memory or a cgroup's, bytes.
    pub limit: u64,
}

impl MemoryRoom {
    /// The tighter of two rooms.
    fn min(self, other: MemoryRoom) -> MemoryRoom {
        MemoryRoom {
            free: self.free.min(other.free),
            limit: self.limit.min(other.limit),
        }
    }
}

/// The room now; `None` when the kernel does not say (no `/proc/meminfo`).
pub fn memory_room() -> Option<MemoryRoom> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let machine = MemoryRoom {
        free: meminfo_bytes(&meminfo, "MemAvailable")?,
        limit: meminfo_bytes(&meminfo, "MemTotal")?,
    };
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    Some(
        cgroup_limits(&cgroups)
            .into_iter()
            .fold(machine, MemoryRoom::min),
    )
}

/// A `/proc/meminfo` field ("MemAvailable:  123 kB") in bytes.
fn meminfo_bytes(text: &str, field: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The memory limits of this process's cgroup and every cgroup above it.
fn cgroup_limits(proc_self_cgroup: &str) -> Vec<MemoryRoom> {
    let mut out = Vec::new();
    for (root, path, files) in cgroup_dirs(proc_self_cgroup) {
        let mut dir = root.join(path.trim_start_matches('/'));
        loop {
            let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
            if let Some(used) = read(files.usage) {
                let limits = files.limits.iter().filter_map(|f| read(f));
                out.extend(limits.filter_map(|limit| limit_room(&limit, &used)));
            }
            if dir == root || !dir.pop() {
                break;
            }
        }
    }
    out
}

/// The files of a memory cgroup that say how much it may hold and holds.
#[derive(Debug, PartialEq, Eq)]
struct CgroupFiles {
    limits: &'static [&'static str],
    usage: &'static str,
}

const V2: CgroupFiles = CgroupFiles {
    limits: &["memory.max", "memory.high"],
    usage: "memory.current",
};
const V1: CgroupFiles = CgroupFiles {
    limits: &["memory.limit_in_bytes"],
    usage: "memory.usage_in_bytes",
};

/// The memory cgroup directories `/proc/self/cgroup` names: (mount root, path inside
/// it, its files) for cgroup v2 and for v1's memory controller.
fn cgroup_dirs(text: &str) -> Vec<(PathBuf, String, CgroupFiles)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            let root = Path::new("/sys/fs/cgroup").to_path_buf();
            out.push((root, path.to_owned(), V2));
        } else if controllers.split(',').any(|c| c == "memory") {
            let root = Path::new("/sys/fs/cgroup/memory").to_path_buf();
            out.push((root, path.to_owned(), V1));
        }
    }
    out
}

/// A cgroup's room from its limit and usage files; `None` without a limit ("max", or
/// v1's page-rounded "unlimited") or when a file does not parse.
fn limit_room(max: &str, used: &str) -> Option<MemoryRoom> {
    const UNLIMITED: u64 = 1 << 62;
    let limit: u64 = max.trim().parse().ok().filter(|&l| l < UNLIMITED)?;
    let used: u64 = used.trim().parse().ok()?;
    Some(MemoryRoom {
        free: limit.saturating_sub(used),
        limit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(meminfo_bytes(text, "MemTotal"), Some(24_000_000 * 1024));
        assert_eq!(meminfo_bytes(text, "MemAvailable"), Some(2_048_000));
        assert_eq!(meminfo_bytes(text, "Mem"), None, "a prefix is not a field");
        assert_eq!(meminfo_bytes("MemAvailable: lots kB", "MemAvailable"), None);
    }

    #[test]
    fn cgroup_lines_name_v2_and_v1_memory_directories() {
        let text = "12:cpu,cpuacct:/a\n4:memory:/kubepods/pod1\n0::/user.slice/x.scope\nbad\n";
        let dirs = cgroup_dirs(text);
        assert_eq!(dirs.len(), 2);
        assert_eq!(dirs[0].0, Path::new("/sys/fs/cgroup/memory"));
        assert_eq!(dirs[0].1, "/kubepods/pod1");
        assert_eq!(dirs[0].2, V1);
        assert_eq!(dirs[1].0, Path::new("/sys/fs/cgroup"));
        assert_eq!(dirs[1].1, "/user.slice/x.scope");
        assert_eq!(dirs[1].2, V2);
    }

    #[test]
    fn a_limit_leaves_what_is_not_used_and_no_limit_leaves_nothing_to_say() {
        assert_eq!(
            limit_room("1073741824\n", "268435456\n"),
            Some(MemoryRoom {
                free: 768 << 20,
                limit: 1 << 30
            })
        );
        assert_eq!(limit_room("100\n", "300\n").map(|r| r.free), Some(0));
        assert_eq!(limit_room("max\n", "5\n"), None);
        assert_eq!(
            limit_room("9223372036854771712\n", "5\n"),
            None,
            "v1 unlimited"
        );
        assert_eq!(limit_room("10\n", "x\n"), None);
    }

    #[test]
    fn this_machine_has_some_room() {
        let room = memory_room().expect("Linux has /proc/meminfo");
        assert!(room.limit > 0 && room.free <= room.limit);
    }
}
