//! Pieces every benchmark uses: a child process of our own binary that reports
//! `ready ...`. Percentiles are `mooncake::util::percentile`.

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
