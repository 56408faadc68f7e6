#!/usr/bin/env python3
"""Drive the serving engines' own Mooncake integrations, unchanged, against a `mooncake`
package over TCP, and print one table: integration, the class driven, the protocol the
integration asked for by default, and ok / failed with the reason.

  python3 bench/engine_integrations.py --venv DIR [--mooncake-venv DIR] [--only NAME ...]
        [--keep-installed] [--strict-protocol] [--timeout S] [--logs DIR]

DIR is a virtual environment of this script's own, created when missing: the engines'
released wheels (ENGINE_WHEELS) and the pure-Python packages their Mooncake modules
import (IMPORT_DEPS), all installed with `pip install --no-deps`; torch comes from the
test venv (~/.cache/mooncake-test-venv, or $MOONCAKE_TEST_VENV) through a .pth file,
and this checkout's package from `pip install --no-deps python/` (a `cargo build
--release`), reinstalled on every run unless --keep-installed. --mooncake-venv runs
everything (servers and the integrations' `import mooncake`) on the `mooncake`
package of another venv instead, e.g. Mooncake's own wheel, for comparison.

The servers start as the engines' documents start them: `mooncake_http_metadata_server`
and `mooncake_master`, on 127.0.0.1 and on ports from the OS. Each integration is
configured through its engine's own mechanism (vLLM: MOONCAKE_CONFIG_PATH and
VLLM_HOST_IP; SGLang: the MOONCAKE_* variables; LMCache: its YAML config in
LMCACHE_CONFIG_FILE) with the engine's defaults except addresses, so those that
default to protocol "rdma" ask for rdma; --strict-protocol sets MC_STRICT_PROTOCOL=1.

What runs (see CASES): vLLM's MooncakeConnectorWorker (its engine set-up, KV
registration, _send_blocks between a decode and a prefill process) and its
MooncakeStoreConnector in the worker role (register_kv_caches, its sending thread,
start_load_kv, get_finished) on a CPU VllmConfig of a weightless tiny model; SGLang's
HiCache MooncakeStore (its own and on the shared transfer engine) and its
MooncakeKVManager pair (send_kvcache, send_aux) on the shared MooncakeTransferEngine;
LMCache's mooncakestore:// connector in both of its modes (save_chunk_meta false:
zero-copy batch_put_from / batch_get_into; true: put_parts / batch_get_buffer). Every
byte that arrives is compared, and a store case also checks, through a client of its
own, that the object is at this run's master.

Every integration runs against servers of its own, in processes of its own (a P/D
pair in two) that report to this one over a pipe; each process's output goes to a log
file under --logs. A process must also exit with status 0. Exit status 1 when any
integration failed.
"""

import argparse
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The newest releases PyPI served when this was written (`pip index versions NAME`).
ENGINE_WHEELS = ["vllm==0.34.0", "sglang==0.5.23", "lmcache==0.5.6"]

# What the integration modules import beyond torch, found by trial (import them,
# install what the error names with --no-deps, repeat). A few are binary wheels
# (numba, pyzmq, tokenizers, ...); all install without pulling anything else.
IMPORT_DEPS = [
    "aiofile==3.12.3", "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0",
    "annotated-doc==0.0.7", "annotated-types==0.8.0", "anyio==4.16.0",
    "apache-tvm-ffi==0.1.15.post2", "attrs==26.1.0", "cachetools==8.0.2",
    "caio==0.12.10", "cbor2==6.3.0", "certifi==2026.10.19.post1", "cffi==2.1.1",
    "click==8.5.1", "cloudpickle==3.1.3", "compressed-tensors==0.20.1",
    "cryptography==50.0.2", "dill==0.4.1", "einops==0.8.2", "fastapi==0.165.0",
    "frozenlist==1.8.0", "gguf==0.19.0", "h11==0.16.0", "httpcore2==2.17.0",
    "httpx2==2.17.0", "huggingface-hub==2.4.0", "idna==3.20", "ipython==9.18.1",
    "llguidance==1.9.1", "llvmlite==0.50.0", "loguru==0.7.3", "msgspec==0.23.0",
    "multidict==7.2.1", "numba==0.68.1", "opentelemetry-api==1.45.3",
    "orjson==3.13.0", "pillow==13.0.0", "prometheus-client==0.26.0",
    "propcache==0.5.4", "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1",
    "pycparser==3.12", "pydantic==2.14.4", "pydantic-core==2.50.5", "pyyaml==6.0.4",
    "pyzmq==27.3.0", "regex==2026.12.2", "requests==2.34.2", "sentencepiece==0.2.3",
    "sortedcontainers==2.4.0", "starlette==1.10.0", "tokenizers==0.23.3",
    "torchvision==0.29.2", "tqdm==4.70.1", "traitlets==5.16.1",
    "transformers==5.25.0", "truststore==0.10.5", "typing-inspection==0.4.5",
    "urllib3==2.8.0", "uvicorn==0.55.0", "uvloop==0.23.0", "xgrammar==0.2.9",
    "yarl==1.25.1",
]

# The distribution name of this checkout's package (python/_build_backend).
OUR_DIST = "mooncake-transfer-engine"
HOST = "127.0.0.1"
REPORT_FD_VAR = "MC_BENCH_REPORT_FD"
# The servers of this run, for the store cases' witness (expect_at_our_master).
MASTER_VAR, METADATA_VAR = "MC_BENCH_MASTER", "MC_BENCH_METADATA"
START_DEADLINE_S = 60.0
STOP_GRACE_S = 10.0
EXIT_GRACE_S = 60.0     # for a process that reported to end on its own


# ----------------------------------------------------------------------------------
# The venv
# ----------------------------------------------------------------------------------

def run_checked(argv, **kw):
    print("+ " + " ".join(str(a) for a in argv), file=sys.stderr, flush=True)
    subprocess.run([str(a) for a in argv], check=True, **kw)


def site_packages(python):
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def installed_versions(python, dists):
    """{distribution: installed version or None} as `python` sees them."""
    probe = ("import importlib.metadata as m, json, sys\n"
             "def version(d):\n"
             "    try: return m.version(d)\n"
             "    except m.PackageNotFoundError: return None\n"
             "print(json.dumps({d: version(d) for d in sys.argv[1:]}))\n")
    out = subprocess.run([str(python), "-c", probe] + list(dists), check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def ensure_venv(venv, reinstall_ours):
    """Creates `venv` if missing (torch borrowed from the test venv by a .pth file) and
    installs what is missing: the engine wheels, IMPORT_DEPS, and our package."""
    test_venv = Path(os.environ.get("MOONCAKE_TEST_VENV",
                                    Path.home() / ".cache/mooncake-test-venv"))
    python = venv / "bin/python"
    if not python.exists():
        run_checked([test_venv / "bin/python", "-m", "venv", venv])
        (site_packages(python) / "mooncake_test_venv_torch.pth").write_text(
            "%s\n" % site_packages(test_venv / "bin/python"))
    pip = [python, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q"]
    wanted = dict(req.split("==") for req in ENGINE_WHEELS + IMPORT_DEPS)
    have = installed_versions(python, list(wanted) + [OUR_DIST])
    missing = ["%s==%s" % (d, v) for d, v in wanted.items() if have[d] != v]
    if missing:
        run_checked(pip + missing)
    if reinstall_ours or have[OUR_DIST] is None:
        run_checked(pip + ["--force-reinstall", REPO / "python"])
    return python


def mooncake_overlay(other_venv, workdir):
    """A directory that, first on PYTHONPATH, makes `import mooncake` load the
    `mooncake` package of `other_venv` (its modules, bundled libraries, metadata)."""
    overlay = workdir / "mooncake-overlay"
    overlay.mkdir(exist_ok=True)
    source = site_packages(other_venv / "bin/python")
    for entry in source.iterdir():
        if entry.name.startswith("mooncake"):
            link = overlay / entry.name
            if not link.exists():
                link.symlink_to(entry)
    return overlay


# ----------------------------------------------------------------------------------
# Processes: servers and integration children
# ----------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def stop_group(proc):
    """Stops `proc` and everything it started (its own session): SIGTERM, then SIGKILL
    after a grace period."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_listening(proc, port, what, log):
    """Polls until something accepts on HOST:port, the process exits, or the deadline."""
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((HOST, port)) == 0:
                return
        try:
            proc.wait(0.05)  # also the pause between tries
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError("%s exited with status %s (see %s)" % (what, proc.returncode, log))
    raise RuntimeError("%s did not listen on %s:%d within %ds (see %s)"
                       % (what, HOST, port, START_DEADLINE_S, log))


@dataclass
class Servers:
    metadata_url: str
    master: str
    metrics_port: int


@contextlib.contextmanager
def start_servers(bin_dir, env, logs, prefix):
    """The metadata server and the master, as the engines' documents start them."""
    meta_port, rpc_port, metrics_port = free_port(), free_port(), free_port()
    commands = [
        ("metadata server", meta_port,
         [bin_dir / "mooncake_http_metadata_server", "--host", HOST, "--port", meta_port]),
        ("master", rpc_port,
         [bin_dir / "mooncake_master", "--rpc_address=%s" % HOST, "--rpc_port=%d" % rpc_port,
          "--metrics_host=%s" % HOST, "--metrics_port=%d" % metrics_port]),
    ]
    with contextlib.ExitStack() as stack:
        for what, port, argv in commands:
            log = logs / ("%s-%s.log" % (prefix, what.replace(" ", "-")))
            with open(log, "wb") as out:
                proc = subprocess.Popen([str(a) for a in argv], env=env, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            stack.callback(stop_group, proc)
            wait_listening(proc, port, what, log)
        yield Servers("http://%s:%d/metadata" % (HOST, meta_port),
                      "%s:%d" % (HOST, rpc_port), metrics_port)


class Child:
    """One integration process: its output goes to `log`; it reports JSON lines on a
    pipe of its own (engines print to stdout too), and reads commands from stdin."""

    def __init__(self, argv, env, log):
        self.log = log
        read_end, write_end = os.pipe()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(a) for a in argv], env={**env, REPORT_FD_VAR: str(write_end)},
                pass_fds=(write_end,), stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        os.close(write_end)
        self.reports = read_end
        self.pending = b""

    def next_report(self, deadline):
        """The next report, or a failure report when the child exits without one or
        the deadline passes."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.reports, selectors.EVENT_READ)
            while b"\n" not in self.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": False, "reason": "no report within the time limit"}
                if not sel.select(left):
                    continue
                chunk = os.read(self.reports, 65536)
                if not chunk:
                    return {"ok": False, "reason": self.death_note()}
                self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def death_note(self):
        try:
            status = self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            status = "?"
        return "exited with status %s without a report; last log line: %s" % (
            status, last_log_line(self.log))

    def send(self, command):
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write((command + "\n").encode())
            self.proc.stdin.flush()

    def exit_status(self, limit_s):
        """Its exit status once it ends on its own (stdin closed), or None after
        `limit_s` seconds."""
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            return self.proc.wait(max(limit_s, 0))
        except subprocess.TimeoutExpired:
            return None

    def stop(self):
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        stop_group(self.proc)
        os.close(self.reports)


def last_log_line(log):
    lines = [l for l in Path(log).read_text(errors="replace").splitlines() if l.strip()]
    return lines[-1].strip()[:300] if lines else "(empty log)"


# Log lines (ours or another package's) on what became of a requested hardware protocol.
PROTOCOL_NOTE = re.compile(
    r"(?i)(warn|error|^w\d|^e\d).*(rdma|protocol).*(tcp|fall|unavailable|device)")


def protocol_notes(logs):
    notes = []
    for log in logs:
        for line in Path(log).read_text(errors="replace").splitlines():
            if PROTOCOL_NOTE.search(line) and line.strip() not in notes:
                notes.append(line.strip()[:400])
    return notes[:3]


# ----------------------------------------------------------------------------------
# The integrations: how each is configured, and what its processes do
# ----------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    integration: str
    driven: str          # the class (and methods) driven
    protocol: str        # what the integration asks for with its defaults
    roles: tuple         # ("store",) or ("decode", "prefill")
    configure: object    # (servers, workdir) -> extra environment


# A model small enough to describe without weights or a tokenizer: vLLM's and SGLang's
# configs need one (they read its config.json); 2 layers, 2 KV heads of 16.
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
}
MODEL_DIR_VAR = "MC_BENCH_MODEL_DIR"


def tiny_model(workdir):
    model = workdir / "tiny-model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return {MODEL_DIR_VAR: str(model)}


def configure_vllm_pd(servers, workdir):
    return {"VLLM_HOST_IP": HOST}


def configure_vllm_store(servers, workdir):
    path = workdir / "vllm-mooncake.json"
    path.write_text(json.dumps({"metadata_server": servers.metadata_url,
                                "master_server_address": servers.master}))
    return {"VLLM_HOST_IP": HOST, "MOONCAKE_CONFIG_PATH": str(path), **tiny_model(workdir)}


def configure_sglang_store(shared_engine):
    """SGLang's MOONCAKE_* variables: the metadata server the docs start, or (with
    `shared_engine`) SGLang's default P2PHANDSHAKE plus MC_FORCE_TCP=1, its way to run
    Mooncake over TCP, which also lets MooncakeStore reuse the shared transfer engine
    (SGLang reuses it for P2PHANDSHAKE, protocol rdma and equal device names, and
    MC_FORCE_TCP makes the engine's device name "")."""
    def configure(servers, workdir):
        env = {"SGLANG_HOST_IP": HOST, "MOONCAKE_MASTER": servers.master,
               "MOONCAKE_LOCAL_HOSTNAME": HOST,
               "MOONCAKE_MASTER_METRICS_PORT": str(servers.metrics_port)}
        if shared_engine:
            env["MC_FORCE_TCP"] = "1"
        else:
            env["MOONCAKE_TE_META_DATA_SERVER"] = servers.metadata_url
        return env
    return configure


def configure_sglang_pd(servers, workdir):
    return {"SGLANG_HOST_IP": HOST, **tiny_model(workdir)}


def configure_lmcache(save_chunk_meta):
    def configure(servers, workdir):
        path = workdir / ("lmcache-%s.yaml" % ("chunk-meta" if save_chunk_meta else "zero-copy"))
        path.write_text(
            "remote_url: \"mooncakestore://%s/\"\n"
            "extra_config:\n"
            "  local_hostname: \"%s\"\n"
            "  metadata_server: \"%s\"\n"
            "  master_server_address: \"%s\"\n"
            "  save_chunk_meta: %s\n"
            % (servers.master, HOST, servers.metadata_url, servers.master,
               "true" if save_chunk_meta else "false"))
        return {"LMCACHE_CONFIG_FILE": str(path)}
    return configure


CASES = [
    Case("vllm-pd", "vLLM MooncakeConnector (P/D)",
         "MooncakeConnectorWorker: restore_kv_caches, _send_blocks, unregister_kv_caches",
         "rdma", ("decode", "prefill"), configure_vllm_pd),
    Case("vllm-store", "vLLM MooncakeStoreConnector",
         "MooncakeStoreConnector (worker role): register_kv_caches, its sending thread, "
         "start_load_kv, get_finished",
         "rdma", ("store",), configure_vllm_store),
    Case("sglang-store", "SGLang HiCache MooncakeStore",
         "MooncakeStore: batch_set, batch_exists, exists, batch_get",
         "rdma", ("store",), configure_sglang_store(False)),
    Case("sglang-store-shared-te", "SGLang HiCache MooncakeStore, P2PHANDSHAKE",
         "MooncakeStore set up on the shared MooncakeTransferEngine (same calls)",
         "rdma, MC_FORCE_TCP=1", ("store",), configure_sglang_store(True)),
    Case("sglang-pd", "SGLang disaggregation (mooncake)",
         "MooncakeKVManager (prefill, decode) on the shared MooncakeTransferEngine: "
         "send_kvcache, send_aux",
         "rdma", ("decode", "prefill"), configure_sglang_pd),
    Case("lmcache-zero-copy", "LMCache mooncakestore:// (save_chunk_meta false)",
         "MooncakestoreConnector: batched_put (batch_put_from), batched_get (batch_get_into)",
         "tcp", ("store",), configure_lmcache(False)),
    Case("lmcache-chunk-meta", "LMCache mooncakestore:// (save_chunk_meta true)",
         "MooncakestoreConnector: batched_put (put_parts), batched_get (batch_get_buffer)",
         "tcp", ("store",), configure_lmcache(True)),
]


# ---- inside a child process ------------------------------------------------------

def report(**fields):
    os.write(int(os.environ[REPORT_FD_VAR]), (json.dumps(fields) + "\n").encode())


def wait_command(expected):
    line = sys.stdin.readline().strip()
    if line != expected:
        raise RuntimeError("expected %r from the driver, got %r" % (expected, line))


def kv_bytes(seed, nbytes):
    """A deterministic block of KV bytes (both sides of a transfer can rebuild it)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def same_bytes(got, want):
    import torch
    got = got.contiguous().view(torch.uint8).reshape(-1)
    want = want.contiguous().view(torch.uint8).reshape(-1)
    if got.numel() != want.numel():
        return "got %d bytes, expected %d" % (got.numel(), want.numel())
    diff = (got != want).nonzero()
    if diff.numel():
        return "%d of %d bytes differ, the first at offset %d" % (
            diff.numel(), want.numel(), int(diff[0]))
    return None


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


def expect_at_our_master(key):
    """Checks that `key` is stored at the master this run started, through a client of
    its own set up with explicit addresses: an integration that reached some other
    master (a default 127.0.0.1:50051, say) does not pass. Call it while the
    integration's client, whose segment holds the object, is still up."""
    from mooncake.store import MooncakeDistributedStore
    witness = MooncakeDistributedStore()
    rc = witness.setup(HOST, os.environ[METADATA_VAR], 0, 16 << 20, "tcp", "",
                       os.environ[MASTER_VAR])
    expect(rc == 0, "the witness client's setup returned %s" % rc)
    try:
        found = witness.is_exist(key)
    finally:
        witness.close()
    expect(found == 1, "%s is not at this run's master (is_exist: %s)" % (key, found))


# A P/D pair: KV blocks of one layer (K and V), prefill block i lands in decode block
# BLOCK_MAP[i] (a non-identity map, as the schedulers' block ids are).
PD_BLOCK_BYTES = 2 * 16 * 8 * 128 * 2      # K+V, 16 tokens, 8 heads, head dim 128, fp16
PD_BLOCKS = 8
PD_BLOCK_MAP = [5, 2, 7, 0, 3, 6, 1, 4]
PD_SEED = 27


def pd_expected_decode_bytes():
    """What the decode side's KV buffer holds after the transfer."""
    import torch
    src = kv_bytes(PD_SEED, PD_BLOCKS * PD_BLOCK_BYTES).view(PD_BLOCKS, PD_BLOCK_BYTES)
    want = torch.empty_like(src)
    for i, j in enumerate(PD_BLOCK_MAP):
        want[j] = src[i]
    return want.view(-1)


def vllm_pd_worker(kv):
    """A vLLM MooncakeConnectorWorker holding `kv` as its KV cache, its engine set up
    as the worker's __init__ does with the connector's default extra config. The rest
    of __init__ cannot run without a GPU (torch.accelerator.current_device_index(),
    current_platform.set_device) and a model's attention backends, so the worker is
    made without it and given what its transfer methods use."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import (
        MooncakeKVConnectorStats)
    from vllm.utils.network_utils import get_ip

    extra = KVTransferConfig(kv_connector="MooncakeConnector",
                             kv_role="kv_both").kv_connector_extra_config
    worker = mc.MooncakeConnectorWorker.__new__(mc.MooncakeConnectorWorker)
    worker.engine = mc.TransferEngine()
    worker.hostname = get_ip()
    rc = worker.engine.initialize(worker.hostname, "P2PHANDSHAKE",
                                  extra.get("mooncake_protocol", "rdma"),
                                  extra.get("device_name", ""))
    expect(rc == 0, "TransferEngine.initialize returned %s" % rc)
    worker.rpc_port = worker.engine.get_rpc_port()
    worker.xfer_stats = MooncakeKVConnectorStats()
    # register_kv_caches ends in batch_register_memory of these two lists; the worker's
    # restore path (after a sleep) makes the same call from them.
    worker.seen_base_addresses = [kv.data_ptr()]
    worker._kv_data_lens = [kv.numel() * kv.element_size()]
    worker._kv_unregistered = True
    worker.restore_kv_caches()
    return worker


def child_vllm_pd(role, peer):
    import torch
    if role == "decode":
        kv = torch.zeros(PD_BLOCKS * PD_BLOCK_BYTES, dtype=torch.uint8)
        worker = vllm_pd_worker(kv)
        report(ready=True, session="%s:%d" % (worker.hostname, worker.rpc_port),
               addr=kv.data_ptr())
        wait_command("verify")
        bad = same_bytes(kv, pd_expected_decode_bytes())
        worker.unregister_kv_caches()
        expect(bad is None, "decode KV after the transfer: %s" % bad)
        return "%d blocks arrived byte-exact" % PD_BLOCKS
    kv = kv_bytes(PD_SEED, PD_BLOCKS * PD_BLOCK_BYTES)
    worker = vllm_pd_worker(kv)
    src = [kv.data_ptr() + i * PD_BLOCK_BYTES for i in range(PD_BLOCKS)]
    dst = [peer["addr"] + j * PD_BLOCK_BYTES for j in PD_BLOCK_MAP]
    rc = worker._send_blocks(peer["session"], src, dst, [PD_BLOCK_BYTES] * PD_BLOCKS)
    expect(rc == 0, "_send_blocks returned %s" % rc)
    sent = worker.xfer_stats.data["bytes_transferred"]
    expect(sent == [PD_BLOCKS * PD_BLOCK_BYTES], "xfer_stats recorded %s" % sent)
    worker.unregister_kv_caches()
    return "sent %d blocks" % PD_BLOCKS


def sglang_shared_transfer_engine():
    """SGLang's shared MooncakeTransferEngine, made as parallel_state makes it when the
    disaggregation or the HiCache backend is mooncake (GPU 0, no IB device given)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine)
    from sglang.srt.utils.network import get_local_ip_auto
    return init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=0,
                                         ib_device=None)


# SGLang's P/D pair: K and V buffers of each layer (SGLang's MHA layout: all K, then
# all V), pages of SG_PAGE_BYTES; prefill pages SG_SRC_PAGES land in decode pages
# SG_DST_PAGES, and aux slot SG_AUX_SRC in slot SG_AUX_DST.
SG_LAYERS, SG_PAGES = 2, 8
SG_PAGE_BYTES = 16 * 2 * 16 * 2             # 16 tokens, 2 heads, head dim 16, fp16
SG_SRC_PAGES, SG_DST_PAGES = [1, 2, 3, 6], [4, 5, 6, 0]
SG_AUX_SLOTS, SG_AUX_BYTES, SG_AUX_SRC, SG_AUX_DST = 4, 64, 2, 1


def sglang_kv_manager(role, kv_buffers, aux_buffer):
    """SGLang's MooncakeKVManager for `role`, as a scheduler process of a P/D server
    makes it: server args (the tiny model on CPU, mooncake transfer backend) published
    to SGLang's runtime context, this process's ranks in a TP-1 topology, the shared
    transfer engine, and for prefill the bootstrap server its registration talks to."""
    from sglang.srt import runtime_context
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import (MooncakeKVBootstrapServer,
                                                         MooncakeKVManager)
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.server_args import ServerArgs

    bootstrap_port = free_port()
    server_args = ServerArgs(
        model_path=os.environ[MODEL_DIR_VAR], skip_tokenizer_init=True, device="cpu",
        host=HOST, disaggregation_mode=role, disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port)
    runtime_context._CONTEXT.set_server_args(server_args)
    # What building the (single-rank) process groups would write.
    runtime_context.get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0,
        attn_dcp_rank=0, moe_ep_rank=0, pp_group=None)
    bootstrap = MooncakeKVBootstrapServer(HOST, bootstrap_port) if role == "prefill" else None
    sglang_shared_transfer_engine()
    args = KVArgs()
    args.engine_rank, args.gpu_id, args.ib_device = 0, 0, ""
    args.kv_data_ptrs = [b.data_ptr() for b in kv_buffers]
    args.kv_data_lens = [b.numel() for b in kv_buffers]
    args.kv_item_lens = [SG_PAGE_BYTES] * len(kv_buffers)
    args.kv_layer_ids = list(range(SG_LAYERS)) * 2
    args.kv_cache_dtype_str = "float16"
    args.aux_data_ptrs, args.aux_data_lens = [aux_buffer.data_ptr()], [aux_buffer.numel()]
    args.aux_item_lens = [SG_AUX_BYTES]
    args.state_types, args.state_data_ptrs, args.state_data_lens = [], [], []
    args.state_item_lens, args.state_layer_ids, args.state_dim_per_tensor = [], [], []
    args.state_slice_outer_counts, args.state_conv_shard_groups = [], []
    args.is_hybrid_mla_backend, args.swa_kv_cache_layout = False, None
    model = TINY_MODEL_CONFIG
    args.kv_head_num = args.total_kv_head_num = model["num_key_value_heads"]
    args.page_size, args.system_dp_rank, args.rust_http_port = 16, 0, None
    args.pp_rank, args.prefill_start_layer, args.prefill_end_layer = 0, 0, SG_LAYERS
    args.mla_compression_ratios, args.kv_buf_groups = None, 1
    args.hidden_kv_layers = SG_LAYERS
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return MooncakeKVManager(args, mode, server_args, is_mla_backend=False), bootstrap


def sglang_pd_buffers(fill):
    """The KV buffers and the aux buffer of one side: random bytes for prefill (the
    seed is the buffer's index), zeros for decode."""
    import torch
    make = kv_bytes if fill else (lambda _seed, n: torch.zeros(n, dtype=torch.uint8))
    kv = [make(i, SG_PAGES * SG_PAGE_BYTES) for i in range(2 * SG_LAYERS)]
    return kv, make(99, SG_AUX_SLOTS * SG_AUX_BYTES)


def child_sglang_pd(role, peer):
    import numpy as np
    import torch
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    kv, aux = sglang_pd_buffers(fill=role == "prefill")
    manager, _bootstrap = sglang_kv_manager(role, kv, aux)
    try:
        if role == "decode":
            report(ready=True, session=manager.get_session_id(),
                   kv=[b.data_ptr() for b in kv], aux=[aux.data_ptr()])
            wait_command("verify")
            want_kv, want_aux = sglang_pd_buffers(fill=True)
            for i, (got, want) in enumerate(zip(kv, want_kv)):
                got, want = got.view(SG_PAGES, -1), want.view(SG_PAGES, -1)
                for src, dst in zip(SG_SRC_PAGES, SG_DST_PAGES):
                    bad = same_bytes(got[dst], want[src])
                    expect(bad is None, "buffer %d page %d (from %d): %s" % (i, dst, src, bad))
            bad = same_bytes(aux.view(SG_AUX_SLOTS, -1)[SG_AUX_DST],
                             want_aux.view(SG_AUX_SLOTS, -1)[SG_AUX_SRC])
            expect(bad is None, "aux slot: %s" % bad)
            return "%d pages x %d buffers and the aux slot arrived byte-exact" % (
                len(SG_DST_PAGES), len(kv))
        rc = manager.send_kvcache(peer["session"], np.array(SG_SRC_PAGES, dtype=np.int32),
                                  peer["kv"], np.array(SG_DST_PAGES, dtype=np.int32),
                                  manager.executors[0])
        expect(rc == 0, "send_kvcache returned %s" % rc)
        transfer = TransferInfo(
            room=1, endpoint=HOST, dst_port=0, mooncake_session_id=peer["session"],
            dst_kv_indices=np.array(SG_DST_PAGES, dtype=np.int32), dst_aux_index=SG_AUX_DST,
            dst_state_indices=[], required_dst_info_num=1, is_dummy=False)
        rc = manager.send_aux(transfer, SG_AUX_SRC, peer["aux"])
        expect(rc == 0, "send_aux returned %s" % rc)
        return "sent %d pages x %d buffers and an aux slot" % (len(SG_SRC_PAGES), len(kv))
    finally:
        # As a server shutting down (teardown() is for a role switch, and races its
        # own zmq threads): the buffers leave the engine, the daemon threads end
        # with the process.
        manager.deregister_buffer_to_engine()


# One KV page of a store: K and V of each layer, as the store connectors lay it out.
STORE_LAYERS = 2
STORE_PART_BYTES = 16 * 8 * 128 * 2          # 16 tokens, 8 heads, head dim 128, fp16


VLLM_BLOCKS = 8


def vllm_store_connector():
    """vLLM's MooncakeStoreConnector in the worker role, on a CPU VllmConfig of the tiny
    model (TP 1 over gloo), with the connector's default extra config."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector)
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized,
                                                 init_distributed_environment)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = TINY_MODEL_CONFIG
    config = VllmConfig(
        model_config=ModelConfig(model=os.environ[MODEL_DIR_VAR], skip_tokenizer_init=True,
                                 dtype="float16"),
        device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(kv_connector="MooncakeStoreConnector",
                                            kv_role="kv_both"))
    layers = ["model.layers.%d.self_attn" % i for i in range(model["num_hidden_layers"])]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=model["num_key_value_heads"],
                             head_size=model["head_dim"], dtype=torch.float16)
    kv_config = KVCacheConfig(num_blocks=VLLM_BLOCKS, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://%s:%d" % (HOST, free_port()))
        ensure_model_parallel_initialized(1, 1)
        connector = MooncakeStoreConnector(config, KVConnectorRole.WORKER, kv_config)
    # One KV cache tensor per layer, blocks first: (blocks, K/V, tokens, heads, head dim).
    caches = {name: torch.zeros(VLLM_BLOCKS, 2, 16, spec.num_kv_heads, spec.head_size,
                                dtype=torch.float16) for name in layers}
    return connector, caches


def wait_until(what, poll, limit_s=60.0):
    """Polls `poll` (a bounded wait between tries) until it returns something true."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        result = poll()
        if result:
            return result
        time.sleep(0.02)  # the pause between polls of another thread's progress
    raise AssertionError("%s: not within %ds" % (what, limit_s))


def child_vllm_store(role, peer):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        LoadSpec, MooncakeStoreConnectorMetadata, ReqMeta)
    from vllm.v1.core.kv_cache_utils import BlockHash

    connector, caches = vllm_store_connector()
    worker = connector.connector_worker
    saved_blocks, loaded_blocks = [3, 5], [6, 1]
    for i, cache in enumerate(caches.values()):
        rows = cache.view(torch.uint8).view(VLLM_BLOCKS, -1)
        for block in saved_blocks:
            rows[block].copy_(kv_bytes(100 * i + block, rows.shape[1]))
    connector.register_kv_caches(caches)
    tokens = 16 * len(saved_blocks)
    hashes = [BlockHash(os.urandom(32)) for _ in saved_blocks]
    # wait_for_save() records a CUDA event, then hands each savable request to the
    # worker's sending thread; with no GPU here, the request goes there directly.
    worker.kv_send_thread.add_request(ReqMeta(
        req_id="save", token_len_chunk=tokens, block_ids=(saved_blocks,),
        block_hashes=hashes, can_save=True, store_job_id=1))
    done = wait_until("the sending thread's save", worker.kv_send_thread.take_completed_saves)
    expect(done == {1: 1}, "completed saves: %s" % done)
    expect(worker.kv_send_thread._saved_offset.get("save") == tokens,
           "the save stopped at %s of %d tokens"
           % (worker.kv_send_thread._saved_offset.get("save"), tokens))
    load = MooncakeStoreConnectorMetadata({"load"}, set())
    load.add_request(ReqMeta(
        req_id="load", token_len_chunk=tokens, block_ids=(loaded_blocks,),
        block_hashes=hashes,
        load_spec=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=tokens, can_load=True)))
    connector.bind_connector_metadata(load)
    connector.start_load_kv(None)
    wait_until("the load", lambda: "load" in (connector.get_finished(set())[1] or ()))
    errors = worker.get_block_ids_with_load_errors()
    expect(not errors, "blocks with load errors: %s" % errors)
    connector.clear_connector_metadata()
    for name, cache in caches.items():
        for src, dst in zip(saved_blocks, loaded_blocks):
            bad = same_bytes(cache[dst], cache[src])
            expect(bad is None, "%s block %d loaded into %d: %s" % (name, src, dst, bad))
    layout = worker.token_dbs[0].store_layout
    expect_at_our_master(layout.key_for(layout.local_shard_ids[0], hashes[0]))
    connector.shutdown()
    return "%d blocks x %d layers saved and loaded byte-exact" % (len(saved_blocks), len(caches))


def child_sglang_store(role, peer):
    import uuid

    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    shared = sglang_shared_transfer_engine()
    storage = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=None)
    # Set up from the MOONCAKE_* variables, on the shared engine when SGLang's rules
    # let it (P2PHANDSHAKE, rdma, same device), then a warmup put and get.
    store = MooncakeStore(storage)
    # A store on the shared engine is that engine's segment: the same session name.
    reuse = os.environ.get("MOONCAKE_TE_META_DATA_SERVER") is None
    expect(reuse == (store.store.get_hostname() == shared.get_session_id()),
           "the store %s the shared transfer engine (store %s, engine %s)"
           % ("does not use" if reuse else "uses", store.store.get_hostname(),
              shared.get_session_id()))
    # The host KV pool: the page to back up (K, V), then room for the prefetched one.
    host = torch.zeros(4, STORE_LAYERS * STORE_PART_BYTES, dtype=torch.uint8)
    store.register_buffer(host)
    page = kv_bytes(11, 2 * STORE_LAYERS * STORE_PART_BYTES).view(2, -1)
    host[0:2].copy_(page)
    key = "sglang-integration-%s" % uuid.uuid4().hex
    keys = ["%s_0_k" % key, "%s_0_v" % key]         # the MHA keys of tp rank 0
    size = STORE_LAYERS * STORE_PART_BYTES
    expect(store.batch_set(keys, target_locations=[host[0].data_ptr(), host[1].data_ptr()],
                           target_sizes=[size, size]) is True, "batch_set failed")
    expect(store.batch_exists([key]) == 1, "batch_exists does not find the page")
    expect(store.exists(keys[1]), "exists does not find %s" % keys[1])
    got = store.batch_get(keys, target_locations=[host[2].data_ptr(), host[3].data_ptr()],
                          target_sizes=[size, size])
    expect(got == 1, "batch_get returned %s pages" % got)
    bad = same_bytes(host[2:4], page)
    expect(bad is None, "page read back: %s" % bad)
    expect_at_our_master(keys[0])
    store.close()
    return "page of %d bytes stored and read back byte-exact" % (2 * size)


def child_lmcache(role, peer):
    import asyncio

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import load_engine_config_with_overrides
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    config = load_engine_config_with_overrides()     # LMCACHE_CONFIG_FILE
    heads, head_dim = 8, 128
    metadata = LMCacheMetadata(
        model_name="integration-check", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.float16,
        kv_shape=(STORE_LAYERS, 2, config.chunk_size, heads, head_dim))
    loop = asyncio.new_event_loop()
    backend = LocalCPUBackend(config, metadata)
    connector = CreateConnector(config.remote_url, loop, backend, config, metadata)
    fmt = MemoryFormat.KV_2LTD
    chunk = backend.allocate(metadata.get_shapes(), metadata.get_dtypes(), fmt)
    expect(chunk is not None, "LocalCPUBackend.allocate returned None")
    want = kv_bytes(13, chunk.get_size())
    chunk.raw_tensor.view(torch.uint8)[: want.numel()].copy_(want)
    key = CacheEngineKey(model_name="integration-check", world_size=1, worker_id=0,
                         chunk_hash=int.from_bytes(os.urandom(7), "little"),
                         dtype=torch.float16)
    loop.run_until_complete(connector.batched_put([key], [chunk]))
    expect(connector.exists_sync(key), "exists_sync does not find the chunk")
    got = loop.run_until_complete(connector.batched_get([key]))
    expect(got and got[0] is not None, "batched_get returned %s" % got)
    bad = same_bytes(got[0].raw_tensor.view(torch.uint8)[: want.numel()], want)
    expect(bad is None, "chunk read back: %s" % bad)
    expect_at_our_master(key.to_string())
    for obj in (chunk, got[0]):
        obj.ref_count_down()
    loop.run_until_complete(connector.close())
    loop.close()
    return "chunk of %d bytes stored and read back byte-exact" % want.numel()


CHILDREN = {
    "vllm-pd": child_vllm_pd,
    "vllm-store": child_vllm_store,
    "sglang-store": child_sglang_store,
    "sglang-store-shared-te": child_sglang_store,
    "sglang-pd": child_sglang_pd,
    "lmcache-zero-copy": child_lmcache,
    "lmcache-chunk-meta": child_lmcache,
}


def child_main(case, role, peer):
    try:
        detail = CHILDREN[case](role, json.loads(peer) if peer else None)
    except BaseException as e:  # the driver wants a reason, whatever the failure
        import traceback
        traceback.print_exc()
        report(ok=False, reason="%s: %s" % (type(e).__name__, e))
        return 1
    report(ok=True, detail=detail)
    return 0


# ---- in the driver -------------------------------------------------------------------

def drive_store(start, deadline):
    """One process does the whole round trip."""
    result = start("store").next_report(deadline)
    return result["ok"], result.get("reason") or result.get("detail")


def drive_pair(start, deadline):
    """Decode registers its KV buffers and says where they are; prefill, started with
    that, moves its blocks there; decode then checks what arrived."""
    decode = start("decode")
    ready = decode.next_report(deadline)
    if not ready.get("ready"):
        return False, "decode: %s" % ready.get("reason")
    sent = start("prefill", ready).next_report(deadline)
    if not sent["ok"]:
        return False, "prefill: %s" % sent["reason"]
    decode.send("verify")
    got = decode.next_report(deadline)
    if not got["ok"]:
        return False, "decode: %s" % got["reason"]
    return True, "%s; %s" % (sent["detail"], got["detail"])


def run_case(case, python, env, logs, deadline):
    """Runs one integration's processes; returns (ok, reason or detail, log files). A
    process that reported success must also exit with status 0 (a crash while closing
    is a failure too)."""
    children = []

    def start(role, peer=None):
        argv = [python, __file__, "--child", case.name, "--role", role]
        child = Child(argv + (["--peer", json.dumps(peer)] if peer else []), env,
                      logs / ("%s-%s.log" % (case.name, role)))
        children.append(child)
        return child

    try:
        drive = drive_store if case.roles == ("store",) else drive_pair
        ok, text = drive(start, deadline)
        for child in children if ok else []:
            status = child.exit_status(min(EXIT_GRACE_S, deadline - time.monotonic()))
            if status != 0:
                ok, text = False, "%s reported success, then %s; last log line: %s" % (
                    child.log.name, "exited with status %s" % status if status is not None
                    else "did not exit", last_log_line(child.log))
                break
        return ok, text, [child.log for child in children]
    finally:
        for child in children:
            child.stop()


def print_table(rows):
    headers = ("integration", "class driven", "asks", "result")
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(3)]
    fmt = "| %%-%ds | %%-%ds | %%-%ds | %%s |" % tuple(widths)
    print(fmt % headers)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|---|")
    for row in rows:
        print(fmt % row)


def driver_main(args):
    # A SIGTERM unwinds like an exception, so every process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    venv = Path(args.venv).resolve()
    python = ensure_venv(venv, reinstall_ours=not args.keep_installed)
    workdir = Path(tempfile.mkdtemp(prefix="engine-integrations-"))
    try:
        logs = Path(args.logs).resolve() if args.logs else workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return run_cases(args, python, venv, workdir, logs)
    finally:
        if args.logs:   # else the logs live in workdir, which stays
            shutil.rmtree(workdir, ignore_errors=True)


def run_cases(args, python, venv, workdir, logs):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MOONCAKE_", "MC_", "VLLM_", "SGLANG_", "LMCACHE_"))}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if args.strict_protocol:
        env["MC_STRICT_PROTOCOL"] = "1"
    if args.mooncake_venv:
        other = Path(args.mooncake_venv).resolve()
        env["PYTHONPATH"] = str(mooncake_overlay(other, workdir))
        bin_dir, package = other / "bin", "the mooncake package of %s" % other
    else:
        bin_dir, package = venv / "bin", "this checkout's mooncake package"
    cases = [c for c in CASES if not args.only or c.name in args.only]
    print("engines: %s; %s; logs in %s" % (", ".join(ENGINE_WHEELS), package, logs),
          file=sys.stderr, flush=True)
    rows, notes, failed = [], [], 0
    for case in cases:
        # Servers of its own: a client an earlier case left mounted (SGLang never closes
        # its store) would hold segments the master places objects on until it expires.
        with start_servers(bin_dir, env, logs, case.name) as servers:
            case_env = {**env, MASTER_VAR: servers.master, METADATA_VAR: servers.metadata_url,
                        **case.configure(servers, workdir)}
            print("running %s ..." % case.name, file=sys.stderr, flush=True)
            ok, text, case_logs = run_case(case, python, case_env, logs,
                                           time.monotonic() + args.timeout)
            failed += not ok
            rows.append((case.integration, case.driven, case.protocol,
                         ("ok: " if ok else "FAILED: ") + str(text)))
            notes += ["%s: %s" % (case.name, n) for n in protocol_notes(case_logs)]
    print_table(rows)
    if notes:
        print("\nwhat the logs say about the protocol:")
        for note in notes:
            print("  " + note)
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", help="this script's own venv (created when missing)")
    parser.add_argument("--mooncake-venv",
                        help="run on the mooncake package (and servers) of this venv")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CASES],
                        help="run only these integrations")
    parser.add_argument("--keep-installed", action="store_true",
                        help="do not reinstall this checkout's package into --venv")
    parser.add_argument("--strict-protocol", action="store_true",
                        help="set MC_STRICT_PROTOCOL=1 (refuse instead of falling back)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each integration may take (300)")
    parser.add_argument("--logs", help="directory for the processes' logs")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, args.role, args.peer)
    if not args.venv:
        parser.error("--venv is required")
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
