//! What `mooncake --help` and `mooncake COMMAND --help` print, and the hint an
//! error about a flag gets.

/// Each subcommand's usage: its name (with `bench`'s second word) and its text.
const COMMANDS: &[(&str, &str)] = &[
    (
        "target",
        "\
  mooncake target [--size 64M] [--location cpu:0|cuda:N|hip:N|npu:N] [--metadata URL]
      [--name HOST:PORT] [--bind IP] [--protocol tcp|shm|auto|rdma|efa]
      [--cluster-secret-file PATH]
      Allocate and register a SIZE-byte buffer (host memory, or device memory from the
      location's driver), publish it, print `ready <segment> addr=0x... size=BYTES`,
      serve until killed. Metadata defaults to P2PHANDSHAKE (the name is the address).",
    ),
    (
        "metadata-server",
        "\
  mooncake metadata-server [--port 8080] [--bind 0.0.0.0] [--cluster-secret-file PATH]
      Run Mooncake's HTTP metadata server (REST on /metadata, /health), on all interfaces
      unless --bind (or --host) says otherwise. With a secret, writes must be signed with
      it (docs/security.md); reads stay open.",
    ),
    (
        "bench transfer",
        "\
  mooncake bench transfer [--protocol tcp|shm|auto|rdma|efa] [--fabric-provider P] [--op read|write]
      [--block-size B] [--batch-size N] [--threads N] [--duration S] [--workers N]
      [--segment NAME --metadata URL]
      Measure transfers; prints one JSON object per line with a same-run baseline.",
    ),
    (
        "bench store",
        "\
  mooncake bench store [--op get|put|exists] [--size 4K] [--batch N] [--threads N]
      [--duration S] [--api zero-copy|copy] [--protocol tcp|auto]
      [--verify-checksum true|false] [--no-verify] [--segment-size B]
      [--replica-cache true|false] [--master HOST:PORT --metadata URL]
      Store objects/s and latency against a master and node in child processes.
      --replica-cache false: every get asks the master (no descriptors kept under the lease).",
    ),
    (
        "bench master",
        "\
  mooncake bench master [--threads 1,2] [--duration S] [--keys K] [--batch N]
      Metadata requests/s of an in-process master (put, get_replicas, exists, mix).",
    ),
    (
        "bench first-touch",
        "\
  mooncake bench first-touch [--size 2G] [--protocol shm|auto]
      Open a fresh SIZE-byte segment of a target in a child process and read 4 KiB of it:
      the time, the same read again, and the shared memory the machine gained.",
    ),
    (
        "bench auth",
        "\
  mooncake bench auth [--duration 4] [--control]
      What the cluster secret costs over TCP: 4 KiB latency and 16 MiB bandwidth with the
      secret on and off (the baseline) in the same run, the sides taking turns, S seconds
      each; and a probe RPC on a fresh connection (where the handshake is paid).
      --control runs both sides without the secret: the comparison's noise floor.",
    ),
    (
        "bench alloc",
        "\
  mooncake bench alloc [--ops 2000000] [--batch 1000] [--trace PATH] [--bytes-per-token 128]
      [--capacity 1G] [--slab-size BYTES]
      The store allocator: alloc+free latency next to std::alloc, and how full a segment
      gets on the trace's object sizes.",
    ),
    (
        "bench disk",
        "\
  mooncake bench disk [--dir DIR] [--total 1G] [--object 4M] [--reps 3] [--cached]
      The store's disk tier: put and read-back GB/s next to a plain pwrite/pread loop
      on the same file system (read back from the device, or the page cache).",
    ),
    (
        "bench chaos-load",
        "\
  mooncake bench chaos-load --master HOST:PORT [--metadata URL] [--seconds 60] [--put-rate 25]
      [--gets-per-put 2] [--replicas 1] [--seed 1] [--settle 120] [--stable 30] [--protocol tcp]
      The load side of bench/chaos.py: puts objects whose bytes derive from their key,
      reads random committed ones back checking every byte; then, after a line on stdin,
      reads every committed object again. JSON lines on stdout.",
    ),
    (
        "bench floor",
        "\
  mooncake bench floor [--request 32] [--answer 4K] [--duration 2]
      The latency floor: a loopback TCP ping-pong with both ends busy-polling, and the
      same with blocking sockets.",
    ),
    (
        "info",
        "\
  mooncake info
      Every transport backend: loaded or not and why, library and version, devices found.",
    ),
    (
        "master",
        "\
  mooncake master [--rpc-port 50051] [--metadata-port PORT|off (off)] [--metrics-port 9003|off]
      [--bind 0.0.0.0] [--lease-ttl-ms 10000 (> 0)] [--eviction-high-watermark 1.0 = off]
      [--eviction-ratio 0.05] [--client-ttl 10]
      [--allocation-strategy random|free_ratio_first|local_first]
      [--max-unfinished-put-ratio 0.5] [--cluster-secret-file PATH] [--owner-key-file PATH]
      [--enable-ha --etcd-endpoints H:P[;H:P] [--cluster-id mooncake_cluster] [--ha-lease-ttl 5]]
      The store's control plane. Mooncake's mooncake_master flags are accepted too, in
      gflags syntax (--flagfile=PATH, -v=1, --version; --helpfull lists them). As upstream,
      it listens on all interfaces (--bind; --rpc_address, --rpc_interface NAME,
      --metrics_host, --http_metadata_server_host for one server each) and runs no
      metadata server unless asked: --metadata-port PORT (or --enable_http_metadata_server
      [--http_metadata_server_port 8080]) starts one in-process. The ready line names the
      addresses other hosts reach it at (for all interfaces: the default route's).
      With --enable-ha, masters elect a leader through an etcd lease (key
      mooncake-store/<cluster-id>/master_view); standbys wait, and clients given
      etcd://H:P[;H:P] as the master address follow the leader. A leader that loses
      its lease exits (status 3). A new leader, or a restarted master, gets the
      objects back from the nodes' catalogs when they remount; a put is answered once
      its nodes recorded it (--catalog-ack-timeout-ms 2000; 0: do not wait, faster
      puts, but the last ones before a master crash may be lost). --owner-key-file
      names a secret the cluster's masters share and no node knows: with it, a node
      keeps its segment name across a master's restart even if another took it first.
      [--recovery-window-ms 2000] For this long after it starts, a lookup that misses is
      answered with ask-again (readers wait), not a miss: the node holding the
      key may not have remounted yet. 0: misses at once.
      [--verify-mounts true] [--verify-metadata URL] A segment counts in the pool only
      once the master read its first and last byte (through an engine of its own,
      started at the first mount): one that no process backs is refused. Segments
      are found in --verify-metadata URL (the nodes' metadata service) if given, else
      in the master's own metadata server, and a host:port name (the default) not
      found there is asked at that address. Without either, one that cannot be
      found is taken unchecked, with a warning. false: mounts are taken at their
      word, as Mooncake's master does.
      [--offload-on-evict true] [--promotion-admission-threshold 1] [--promotion-on-hit true]
      Objects evicted from a node with a disk tier (node --ssd-path) go there; a read
      brings one back, kept in memory from its Nth read from disk.
      Nodes and clients that give no --metadata ask it for its metadata server (so
      start it with one, or give them --metadata).
      Only clients that mounted a segment or pinged may put; one host's unfinished puts
      (by connection address, whatever client ids it shows) may hold at most
      --max-unfinished-put-ratio of the pool. Connection caps and
      timeouts: MC_MAX_CONNECTIONS, MC_MAX_CONNECTIONS_PER_PEER, MC_IDLE_TIMEOUT_SECS,
      MC_FRAME_TIMEOUT_SECS (see README).",
    ),
    (
        "node",
        "\
  mooncake node --segment-size BYTES [--master 127.0.0.1:50051] [--metadata URL] [--name HOST:PORT]
      [--bind IP] [--protocol tcp|shm|auto|rdma|efa] [--cluster-secret-file PATH]
      [--ssd-path DIR --ssd-size BYTES] [--prefault-segment true|false]
      Lend SIZE bytes (positive, at most this machine's memory) to the store pool,
      and with --ssd-path a disk tier for what is evicted from it (kept across restarts).
      The lent memory is committed in the background at idle priority while the machine
      keeps a reserve (--prefault-segment false, or MC_STORE_PREFAULT=0: on first use).
      Without --metadata, the master's metadata server is used. With --bind 0.0.0.0,
      the name published is --name, else the address of the default route's interface.",
    ),
    (
        "demo",
        "\
  mooncake demo [--trace FILE] [--requests N] [--block-bytes 64K] [--pool-size 3G]
      [--time-scale X] [--replicas 1] [--protocol auto|tcp] [--json] [--cluster-secret-file PATH]
      [--ssd-size BYTES [--ssd-path DIR]]
      Start a master, two store nodes and a client in this process and replay the
      conversation trace through the store (prefix reads, writes, eviction); print a summary.
      The default protocol, auto, is what a same-host deployment uses: shared memory.
      --ssd-size gives the nodes a disk tier (split between them; a temporary directory
      unless --ssd-path) that evicted blocks go to and are read back from.
      Read leases last the default lease of trace time on the replay's clock (10 s x
      --time-scale), at least 1 s: 1 s when replaying as fast as possible.",
    ),
    (
        "replay",
        "\
  mooncake replay --master HOST:PORT [--metadata URL] [same options as demo, less --pool-size]
      The same replay, as a pure client of a running cluster (metadata: as for node).",
    ),
    (
        "simulate",
        "\
  mooncake simulate [--trace FILE] [--model ID | --config config.json [--precision P]
      [--indexer-precision P] [--draft] [--estimate-tokens N] | --block-bytes N]
      [--capacities 8192,16384,64GiB] [--policies fifo,lru,optimal,store] [--json] [--svg FILE]
      [--block-tokens 512] [--requests N] [--segments 2] [--threads N]
      Replay the trace's block ids (no bytes moved) through caches of each capacity (blocks,
      or sizes through the block bytes) and print prefix hit rates, all requests and the last
      half: fifo/lru/optimal as the kvcache-simulator package computes them, store = the real
      master (allocator, eviction, leases) on a clock following the trace.",
    ),
    (
        "calc",
        "\
  mooncake calc --model ID | --config config.json [--precision bf16|fp8|fp4]
      [--indexer-precision P] [--draft] [--tokens N] [--block-tokens 512] [--pool-size SIZE]
      [--json] | --list
      KV-cache bytes per token, per block and for N tokens (catalog of models, or a Hugging
      Face config); with --pool-size, how many blocks and tokens fit.",
    ),
];

const HEADER: &str = "mooncake — transfer engine and KV store (Mooncake-compatible)";
const FOOTER: &str = "\
Sizes accept K/M/G/T suffixes; on/off values true/false, on/off or 1/0. Logging:
RUST_LOG=info|debug. Authentication: every serving or connecting command takes
--cluster-secret-file PATH (or MC_CLUSTER_SECRET; docs/security.md).
`mooncake COMMAND --help` shows one command; `mooncake --version` the version.";

/// The whole usage text.
pub fn usage() -> String {
    let body: Vec<&str> = COMMANDS.iter().map(|(_, text)| *text).collect();
    format!("{HEADER}\n\nUSAGE:\n{}\n\n{FOOTER}", body.join("\n"))
}

/// The usage of the command `words` start with (`bench` takes a second word), if any.
pub fn usage_of(words: &[String]) -> Option<String> {
    let first = words.first()?.as_str();
    let name = match (first, words.get(1)) {
        ("bench", Some(sub)) if !sub.starts_with('-') => format!("bench {sub}"),
        ("backends", _) => "info".to_owned(),
        _ => first.to_owned(),
    };
    let matching: Vec<&str> = COMMANDS
        .iter()
        .filter(|(n, _)| *n == name || (name == "bench" && n.starts_with("bench ")))
        .map(|(_, text)| *text)
        .collect();
    (!matching.is_empty()).then(|| format!("USAGE:\n{}", matching.join("\n")))
}

/// Whether `raw` (after the command words) asks for help.
pub fn wants_help(raw: &[String]) -> bool {
    raw.iter().any(|a| a == "--help" || a == "-h")
}

/// An error about the command line gets a pointer to the command's usage.
pub fn with_hint(e: String, words: &[String]) -> String {
    let about_flags = [
        "unknown option",
        "unexpected argument",
        "needs a value",
        "--",
    ]
    .iter()
    .any(|p| e.starts_with(p) || e.contains(&format!(": {p}")));
    let command = match words.first().map(String::as_str) {
        Some("bench") => match words.get(1) {
            Some(sub) if !sub.starts_with('-') => format!("bench {sub}"),
            _ => "bench".to_owned(),
        },
        Some(c) => c.to_owned(),
        None => return e,
    };
    if about_flags && usage_of(words).is_some() {
        format!("{e}\n(`mooncake {command} --help` lists the options)")
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn every_command_has_its_own_usage() {
        for cmd in [
            "target",
            "metadata-server",
            "info",
            "master",
            "node",
            "demo",
            "replay",
            "simulate",
            "calc",
        ] {
            let text = usage_of(&words(&[cmd])).unwrap();
            assert!(text.contains(&format!("mooncake {cmd}")), "{text}");
        }
        let text = usage_of(&words(&["bench", "store"])).unwrap();
        assert!(text.contains("bench store") && !text.contains("bench master"));
        let text = usage_of(&words(&["bench", "--help"])).unwrap();
        assert!(text.contains("bench store") && text.contains("bench master"));
        assert!(usage_of(&words(&["frobnicate"])).is_none());
        assert!(usage().contains("mooncake replay"));
    }

    #[test]
    fn flag_errors_point_at_the_usage() {
        let e = with_hint("unknown option(s): --sise".into(), &words(&["node"]));
        assert!(
            e.ends_with("(`mooncake node --help` lists the options)"),
            "{e}"
        );
        let e = with_hint(
            "--size: cannot parse \"x\"".into(),
            &words(&["bench", "store"]),
        );
        assert!(e.contains("`mooncake bench store --help`"), "{e}");
        let e = with_hint("connection refused".into(), &words(&["node"]));
        assert_eq!(e, "connection refused");
    }
}
