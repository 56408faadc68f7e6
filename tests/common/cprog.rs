//! Building and running C and C++ test programs against `c_include/mooncake.h` and the
//! static library.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Upper bound for any child process step; generous for loaded CI machines.
pub const LIMIT: Duration = Duration::from_secs(120);

/// Routes the library's log output through the test harness's capture.
pub fn quiet_logs() {
    let _ = env_logger::builder().is_test(true).try_init();
}

pub fn header_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("c_include")
}

/// A child process with its stdout read line by line on a thread; killed and reaped
/// on drop, whatever happened.
pub struct Proc {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    reaped: bool,
    lines: Receiver<String>,
    pub stderr: Option<JoinHandle<String>>,
}

pub struct Outcome {
    pub status: ExitStatus,
    pub stdout: Vec<String>,
    pub stderr: String,
}

impl Proc {
    pub fn spawn(what: &str, cmd: &mut Command) -> Proc {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what}: {e}"));
        let stdin = child.stdin.take();
        let out = child.stdout.take().expect("piped stdout");
        let mut err = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Proc {
            what: what.to_owned(),
            child,
            stdin,
            reaped: false,
            lines,
            stderr: Some(stderr),
        }
    }

    /// The next stdout line; `None` at EOF or after `limit`.
    pub fn line(&self, limit: Duration) -> Option<String> {
        self.lines.recv_timeout(limit).ok()
    }

    /// The first stdout line, which must start with "ready "; panics (with the
    /// child's stderr) on EOF or after `LIMIT`.
    pub fn ready(&mut self) -> String {
        match self.lines.recv_timeout(LIMIT) {
            Ok(l) if l.starts_with("ready ") => l,
            other => {
                let out = self.finish(LIMIT);
                panic!(
                    "{}: no ready line ({other:?}), {:?}\nstdout: {:?}\nstderr:\n{}",
                    self.what, out.status, out.stdout, out.stderr
                );
            }
        }
    }

    /// Kills the child at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }

    /// Closes stdin, collects stdout to EOF (killing the child if that takes longer
    /// than `limit`) and reaps the child.
    pub fn finish(&mut self, limit: Duration) -> Outcome {
        drop(self.stdin.take());
        let deadline = Instant::now() + limit;
        let mut stdout = Vec::new();
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(l) => stdout.push(l),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    stdout.push(format!("<{} killed after {limit:?}>", self.what));
                    break;
                }
            }
        }
        let status = self.child.wait().expect("reaping child");
        self.reaped = true;
        let stderr = self
            .stderr
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        Outcome {
            status,
            stdout,
            stderr,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The static library cargo built along with the rlib this test links: `cargo test`
/// leaves it in `target/<profile>/deps/libmooncake-<hash>.a` (it is copied up to
/// `target/<profile>/libmooncake.a` only by `cargo build`), so take the newest of those.
pub fn static_lib() -> Option<PathBuf> {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let profile = deps.parent().expect("target/<profile>");
    let mut found = Vec::new();
    for dir in [deps, profile] {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("libmooncake") && name.ends_with(".a") {
                if let Ok(modified) = entry.metadata().and_then(|m| m.modified()) {
                    found.push((modified, entry.path()));
                }
            }
        }
    }
    found.into_iter().max().map(|(_, path)| path)
}

pub fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// What a C or C++ source becomes.
pub enum Output<'a> {
    /// An executable linked with the static library at this path.
    Program(&'a Path),
    /// A shared object (`-shared -fPIC`), loaded by path.
    SharedObject,
}

/// Where built test programs and libraries go: `target/<profile>/cbuild/`, next to the
/// test binaries, so each target directory (and profile) has its own.
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    profile.join("cbuild")
}

fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Every C or C++ build of the tests goes through here: `tests/<source>` compiled by
/// `compiler` with `flags` into [`build_dir`]`/<name>`. The build is skipped when that
/// output was made by the same command and is newer than every input (the source,
/// the headers beside it and in `c_include/`, the library linked). Written under a
/// temporary name and renamed, so a process that has the old one loaded keeps it.
/// `Err` carries the compiler's complaint.
pub fn build(
    compiler: &str,
    source: &str,
    name: &str,
    flags: &[&str],
    output: Output,
) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("tests").join(source);
    let dir = build_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let out = dir.join(name);
    let mut cmd = Command::new(compiler);
    cmd.args(flags).arg("-I").arg(header_path()).arg(&src);
    let mut inputs = vec![src.clone()];
    match output {
        Output::Program(lib) => {
            cmd.arg(lib).args(LINK_LIBS);
            inputs.push(lib.to_owned());
        }
        Output::SharedObject => {
            cmd.args(["-shared", "-fPIC", "-lpthread"]);
        }
    }
    for headers in [src.parent(), Some(header_path().as_path())]
        .into_iter()
        .flatten()
    {
        for entry in std::fs::read_dir(headers).into_iter().flatten().flatten() {
            if entry.path().extension().is_some_and(|e| e == "h") {
                inputs.push(entry.path());
            }
        }
    }
    let recipe = format!("{cmd:?}");
    let stamp = dir.join(format!("{name}.cmd"));
    let fresh = modified(&out).is_some_and(|built| {
        inputs
            .iter()
            .all(|i| modified(i).is_some_and(|m| m <= built))
    }) && std::fs::read_to_string(&stamp).is_ok_and(|s| s == recipe);
    if fresh {
        return Ok(out);
    }
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let result = cmd
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("running {compiler}: {e}"))?;
    if !result.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "{compiler} {source} failed:\n{}",
            String::from_utf8_lossy(&result.stderr)
        ));
    }
    std::fs::rename(&tmp, &out).map_err(|e| format!("renaming to {}: {e}", out.display()))?;
    std::fs::write(&stamp, recipe).map_err(|e| format!("writing {}: {e}", stamp.display()))?;
    Ok(out)
}

/// What the static library needs from the system when linked into a program.
const LINK_LIBS: &[&str] = &[
    "-lgcc_s",
    "-lutil",
    "-lrt",
    "-lpthread",
    "-lm",
    "-ldl",
    "-lc",
];

/// A test program from `tests/c/<source>` (C or C++ by `compiler`), strictly warned,
/// linked with the static library; panics if it does not build. Named after the
/// source (`transfer.cpp` → `transfer_cpp`).
pub fn program(compiler: &str, std_flag: &str, source: &str, lib: &Path) -> PathBuf {
    let name = source.replace('.', "_");
    let flags = [std_flag, "-Wall", "-Wextra", "-Werror", "-pedantic"];
    build(
        compiler,
        &format!("c/{source}"),
        &name,
        &flags,
        Output::Program(lib),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}
