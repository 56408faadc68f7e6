//! Pieces every benchmark uses: a child process of our own binary that reports
//! `ready ...`. Percentiles are `mooncake_base::util::percentile`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A `mooncake master` or `mooncake node` we started; killed and reaped on drop.
pub struct ChildProc {
    child: Child,
    /// Its `ready ...` line, less the `ready `.
    pub ready: String,
}

impl ChildProc {
    pub fn spawn(what: &str, args: &[String]) -> Result<ChildProc, String> {
        let exe = std::env::current_exe().map_err(|e| format!("locating own binary: {e}"))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {what}: {e}"))?;
        let stdout = child.stdout.take().ok_or("child has no stdout")?;
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        match (read, line.trim().strip_prefix("ready ")) {
            (Ok(_), Some(ready)) => Ok(ChildProc {
                ready: ready.to_owned(),
                child,
            }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("{what} did not report ready (got {line:?})"))
            }
        }
    }

    /// A `mooncake target` on loopback with P2P metadata lending `size` bytes, with
    /// `extra` arguments; stopped when dropped (its stdin closes).
    pub fn target(size: u64, extra: &[String]) -> Result<ChildProc, String> {
        let mut args: Vec<String> = [
            "target",
            "--metadata",
            "P2PHANDSHAKE",
            "--bind",
            "127.0.0.1",
            "--until-stdin-eof",
            "--size",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(size.to_string());
        args.extend_from_slice(extra);
        ChildProc::spawn("target", &args)
    }

    /// The segment name: the first word of the ready line.
    pub fn name(&self) -> &str {
        self.ready.split_whitespace().next().unwrap_or_default()
    }

    /// `KEY=VALUE` from the ready line.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.ready
            .split_whitespace()
            .find_map(|t| t.strip_prefix(key)?.strip_prefix('='))
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
