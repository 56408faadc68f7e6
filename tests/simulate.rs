//! `mooncake simulate` and `mooncake calc`: hit-rate semantics on hand-made traces,
//! output shapes, size parsing, errors, and, when the `kvcache-simulator` package is
//! importable, agreement with it on the shipped trace and on every catalog model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use mooncake::json::{self, Value};

const BIN: &str = env!("CARGO_BIN_EXE_mooncake");
const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/traces/conversation_trace.jsonl"
);
const CHECKER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kvsim_check.py");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("running mooncake")
}

/// Runs `mooncake ARGS`, insists on success, returns stdout.
fn ok(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "mooncake {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `mooncake ARGS`, insists on failure, returns stderr.
fn fails(args: &[&str]) -> String {
    let out = run(args);
    assert!(!out.status.success(), "mooncake {args:?} should fail");
    String::from_utf8(out.stderr).unwrap()
}

fn lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| json::parse(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn f(v: &Value, key: &str) -> f64 {
    v.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no {key} in {v}"))
}

fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// The run of `policy` at `capacity` among JSON lines.
fn pick<'a>(rows: &'a [Value], capacity: u64, policy: &str) -> &'a Value {
    rows.iter()
        .find(|r| f(r, "capacity_blocks") == capacity as f64 && s(r, "policy") == policy)
        .unwrap_or_else(|| panic!("no {policy} at {capacity}"))
}

/// A scratch directory of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mc-simulate-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A trace of one request per id list, each block one token.
fn write_trace(dir: &Path, requests: &[&[u64]]) -> String {
    let text: String = requests
        .iter()
        .enumerate()
        .map(|(i, ids)| {
            let list: Vec<String> = ids.iter().map(u64::to_string).collect();
            format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"hash_ids\": [{}]}}\n",
                i * 1000,
                ids.len(),
                list.join(", ")
            )
        })
        .collect();
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn known_answers_on_a_hand_made_trace() {
    let dir = scratch("known");
    // Request 3 shares block 1 with request 1 but misses block 2: only 1 counts.
    let trace = write_trace(&dir, &[&[1, 2, 3], &[1, 9], &[1, 2, 3]]);
    let rows = lines(&ok(&[
        "simulate",
        "--trace",
        &trace,
        "--block-tokens",
        "1",
        "--capacities",
        "2,100",
        "--policies",
        "fifo,lru,optimal",
        "--json",
    ]));
    assert_eq!(rows.len(), 6);
    // Room for two (answers checked against the package): FIFO keeps the newest two
    // blocks, LRU a prefix subtree, optimal what is used again.
    for (policy, hits) in [("fifo", 1.0), ("lru", 2.0), ("optimal", 3.0)] {
        let r = pick(&rows, 2, policy);
        assert_eq!(f(r, "hit_tokens"), hits, "{policy}: {r}");
        assert_eq!(f(r, "input_tokens"), 8.0);
        // Room for everything: block 1 twice and all of request 3.
        let r = pick(&rows, 100, policy);
        assert_eq!(f(r, "hit_tokens"), 4.0, "{policy}: {r}");
        assert_eq!(f(r, "hit_rate"), 0.5);
        // The last half is requests 1 and 2: 4 of 5 tokens.
        assert_eq!(f(r, "hit_rate_last_half"), 0.8);
        assert_eq!(r.get("underfilled").and_then(Value::as_bool), Some(true));
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn json_has_one_object_per_capacity_and_policy() {
    let out = ok(&[
        "simulate",
        "--requests",
        "600",
        "--capacities",
        "1024,4096",
        "--policies",
        "lru,fifo,store,optimal",
        "--json",
    ]);
    let rows = lines(&out);
    assert_eq!(rows.len(), 8, "{out}");
    for r in &rows {
        for key in [
            "capacity_blocks",
            "policy",
            "hit_rate",
            "hit_rate_last_half",
            "hit_tokens",
            "input_tokens",
            "underfilled",
            "ceiling_last_half",
        ] {
            assert!(r.get(key).is_some(), "no {key} in {r}");
        }
        let rate = f(r, "hit_rate_last_half");
        assert!((0.0..=f(r, "ceiling_last_half")).contains(&rate), "{r}");
    }
    // Sorted by capacity, then in the order the policies were named.
    let order: Vec<&str> = rows[..4].iter().map(|r| s(r, "policy")).collect();
    assert_eq!(order, ["lru", "fifo", "store", "optimal"]);
    let store = pick(&rows, 4096, "store");
    assert_eq!(f(store, "pool_bytes"), (4096u64 * 65536) as f64, "{store}");
    assert_eq!(f(store, "segments"), 2.0);
}

#[test]
fn optimal_bounds_lru_fifo_and_the_real_store() {
    let rows = lines(&ok(&[
        "simulate",
        "--requests",
        "2500",
        "--capacities",
        "1024,4096",
        "--policies",
        "fifo,lru,optimal",
        "--json",
    ]));
    for cap in [1024, 4096] {
        let opt = pick(&rows, cap, "optimal");
        for other in ["fifo", "lru"] {
            let r = pick(&rows, cap, other);
            for key in ["hit_rate", "hit_rate_last_half"] {
                assert!(
                    f(r, key) <= f(opt, key),
                    "{other} above optimal at {cap}: {r}"
                );
            }
            assert!(f(r, "hit_rate_last_half") > 0.0, "{r}");
        }
    }
    // A bigger cache never hurts LRU.
    assert!(
        f(pick(&rows, 4096, "lru"), "hit_rate_last_half")
            >= f(pick(&rows, 1024, "lru"), "hit_rate_last_half")
    );
    // The real master: hits, never above optimal (that would mean broken accounting).
    // Few requests: the master is slow in a debug build.
    let rows = lines(&ok(&[
        "simulate",
        "--requests",
        "700",
        "--capacities",
        "1024",
        "--policies",
        "optimal,store",
        "--json",
    ]));
    let (opt, store) = (pick(&rows, 1024, "optimal"), pick(&rows, 1024, "store"));
    for key in ["hit_rate", "hit_rate_last_half"] {
        assert!(
            f(store, key) > 0.0 && f(store, key) <= f(opt, key),
            "{store} vs {opt}"
        );
    }
}

#[test]
fn capacities_take_sizes_through_the_block_bytes() {
    let rows = lines(&ok(&[
        "simulate",
        "--requests",
        "500",
        "--block-bytes",
        "64K",
        "--capacities",
        "512M,100,1GiB",
        "--policies",
        "lru",
        "--json",
    ]));
    let caps: Vec<f64> = rows.iter().map(|r| f(r, "capacity_blocks")).collect();
    assert_eq!(caps, [100.0, 8192.0, 16384.0]);
    assert_eq!(f(&rows[1], "capacity_bytes"), (512u64 << 20) as f64);
    // Llama 3.1 8B in BF16: 128 KiB per token, 64 MiB per 512-token block.
    let rows = lines(&ok(&[
        "simulate",
        "--requests",
        "500",
        "--model",
        "llama-3.1-8b",
        "--precision",
        "bf16",
        "--capacities",
        "64GiB",
        "--policies",
        "fifo",
        "--json",
    ]));
    assert_eq!(f(&rows[0], "capacity_blocks"), 1024.0);
    assert_eq!(f(&rows[0], "block_bytes"), (64u64 << 20) as f64);
}

#[test]
fn table_and_svg() {
    let dir = scratch("svg");
    let svg = dir.join("chart.svg");
    let out = ok(&[
        "simulate",
        "--requests",
        "1000",
        "--capacities",
        "256,1024,8192",
        "--policies",
        "fifo,lru,optimal",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(
        out.contains("last half") && out.contains("optimal"),
        "{out}"
    );
    assert_eq!(
        out.lines().filter(|l| l.contains(" lru ")).count(),
        3,
        "{out}"
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
        "{text}"
    );
    assert!(text.trim_end().ends_with("</svg>"));
    assert_eq!(text.matches("<polyline").count(), 3);
    // Well-formed enough: every element opened is closed or self-closing.
    let opened = text.matches("<circle").count();
    assert_eq!(opened, 9);
    assert_eq!(text.matches("</circle>").count(), opened);
    assert_eq!(
        text.matches("<text").count(),
        text.matches("</text>").count()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    let dir = scratch("bad");
    let broken = dir.join("broken.jsonl");
    std::fs::write(
        &broken,
        "{\"input_length\": 5, \"hash_ids\": [1]}\n{\"input_length\": 5, \"hash_ids\": [1,\n",
    )
    .unwrap();
    let broken = broken.to_str().unwrap();
    for (args, want) in [
        (vec!["--capacities", "64GiB"], "--block-bytes"),
        (vec!["--capacities", "0"], "at least one block"),
        (vec!["--capacities", "12Q"], "unknown unit"),
        (vec!["--policies", "lfu"], "unknown policy"),
        (vec!["--trace", "/nonexistent/trace.jsonl"], "reading trace"),
        (
            vec!["--trace", broken, "--capacities", "4"],
            "broken.jsonl:2",
        ),
        (vec!["--model", "no-such-model"], "unknown model"),
        (
            vec!["--model", "llama-3.1-8b", "--block-bytes", "64K"],
            "not both",
        ),
        (
            vec!["--model", "llama-3.1-8b", "--precision", "fp3"],
            "unknown precision",
        ),
        (vec!["--capacitys", "4"], "unknown option"),
    ] {
        let err = fails(&[&["simulate"], &args[..]].concat());
        assert!(err.contains(want), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn calc_sizes_models_and_pools() {
    let v = &lines(&ok(&[
        "calc",
        "--model",
        "llama-3.1-8b",
        "--precision",
        "fp8",
        "--tokens",
        "1000",
        "--pool-size",
        "1GiB",
        "--json",
    ]))[0];
    assert_eq!(f(v, "bytes_per_token"), 65536.0);
    assert_eq!(f(v, "bytes_per_block"), 65536.0 * 512.0);
    assert_eq!(f(v, "total_bytes"), 65536.0 * 1000.0);
    assert_eq!(f(v, "blocks_fit"), 32.0);
    assert_eq!(f(v, "tokens_fit"), 32.0 * 512.0);
    // An indexer cache at its own precision (DeepSeek V3.2: DSA over MLA).
    let v = &lines(&ok(&[
        "calc",
        "--model",
        "deepseek-v3.2",
        "--precision",
        "fp8",
        "--indexer-precision",
        "fp4",
        "--tokens",
        "10",
        "--json",
    ]))[0];
    assert_eq!(f(v, "kv_bytes"), 61.0 * 576.0 * 10.0);
    assert_eq!(f(v, "indexer_bytes"), 61.0 * 128.0 * 0.5 * 10.0);
    // Draft layers add the MTP layer's cache.
    let no_draft = f(
        &lines(&ok(&["calc", "--model", "deepseek-v3", "--json"]))[0],
        "bytes_per_token",
    );
    let draft = f(
        &lines(&ok(&[
            "calc",
            "--model",
            "deepseek-v3",
            "--draft",
            "--json",
        ]))[0],
        "bytes_per_token",
    );
    assert_eq!(draft / no_draft, 62.0 / 61.0);
    // A Hugging Face config.
    let dir = scratch("calc");
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_size": 1024}"#,
    )
    .unwrap();
    let v = &lines(&ok(&[
        "calc",
        "--config",
        config.to_str().unwrap(),
        "--json",
    ]))[0];
    assert_eq!(f(v, "bytes_per_token"), 28.0 * 2.0 * 8.0 * 128.0 * 2.0);
    let table = ok(&["calc", "--model", "qwen3.5-9b", "--tokens", "4096"]);
    assert!(
        table.contains("per token") && table.contains("state"),
        "{table}"
    );
    assert!(fails(&["calc"]).contains("--model"));
    assert!(fails(&["calc", "--model", "x"]).contains("unknown model"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A Python that can import the package: `MC_KVSIM_PYTHON`, or the test venv `.ci/run`
/// installs it into (`MC_PY_VENV`, else `${XDG_CACHE_HOME:-$HOME/.cache}/mooncake-test-venv`).
fn package_python() -> Option<String> {
    let venv = std::env::var("MC_PY_VENV")
        .map(PathBuf::from)
        .or_else(|_| {
            std::env::var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|_| std::env::var("HOME").map(|h| Path::new(&h).join(".cache")))
                .map(|c| c.join("mooncake-test-venv"))
        })
        .map(|v| v.join("bin/python"))
        .ok();
    let candidates = std::env::var("MC_KVSIM_PYTHON")
        .ok()
        .into_iter()
        .chain(venv.and_then(|p| p.to_str().map(str::to_owned)));
    candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import kvcache_sim"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

#[test]
fn agrees_with_the_kvcache_simulator_package() {
    let Some(py) = package_python() else {
        eprintln!(
            "SKIPPED agrees_with_the_kvcache_simulator_package: no Python imports kvcache_sim \
             (pip install kvcache-simulator; set MC_KVSIM_PYTHON, or run .ci/run, which \
             installs it into the test venv)"
        );
        return;
    };
    // Hit rates, last half, at capacities that fill before the measured half.
    let caps = "1000,8192,16384,49152";
    let theirs = Command::new(&py)
        .args([CHECKER, "sim", TRACE, "512", caps, "fifo,lru,optimal"])
        .output()
        .unwrap();
    assert!(
        theirs.status.success(),
        "{}",
        String::from_utf8_lossy(&theirs.stderr)
    );
    let theirs = lines(&String::from_utf8(theirs.stdout).unwrap());
    let ours = lines(&ok(&[
        "simulate",
        "--trace",
        TRACE,
        "--capacities",
        caps,
        "--policies",
        "fifo,lru,optimal",
        "--json",
    ]));
    assert_eq!(theirs.len(), ours.len());
    for t in &theirs {
        let cap = f(t, "capacity_blocks") as u64;
        let o = pick(&ours, cap, s(t, "policy"));
        let (a, b) = (f(o, "hit_rate_last_half"), f(t, "hit_rate_last_half"));
        assert!((a - b).abs() < 0.001, "ours {o}\npackage {t}");
        assert_eq!(s(t, "mode"), "fixed_window");
        assert_eq!(o.get("underfilled").and_then(Value::as_bool), Some(false));
    }
    // Bytes per token (and totals, and linear-attention state) for every model of our
    // catalog, every precision, indexer precision and draft setting, at several token
    // counts; and no model the package can size is missing from ours.
    for tokens in ["1", "1000", "12035", "200000"] {
        let rows = ok(&["calc", "--list", "--json", "--tokens", tokens]);
        let mut child = Command::new(&py)
            .args([CHECKER, "calc"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(rows.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "calc disagrees at {tokens} tokens:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
