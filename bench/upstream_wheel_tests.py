#!/usr/bin/env python3
"""Runs upstream Mooncake's wheel tests (``mooncake-wheel/tests``) against an installed
``mooncake`` package, one file at a time, and prints a per-file table.

    python3 bench/upstream_wheel_tests.py --tests DIR --python VENV/bin/python [FILE ...]

DIR holds upstream's test files (for example exported from a Mooncake checkout at
3b5a594: ``git archive HEAD mooncake-wheel/tests | tar -x -C /tmp/up``). They are copied
to a scratch folder outside this checkout and run there with pytest from the given
interpreter; that interpreter's bin folder leads PATH, so its console scripts
(``mooncake_master``, ``mooncake_http_metadata_server``, ``mooncake_client``) are the ones
started. Run it once with a venv holding our package and once with one holding the real
wheel, on the same machine, to compare. With ``--netns`` (root) it runs inside a network
namespace of its own, made for the run and removed after it, holding loopback and a veth
pair with a private address (the real wheel's engine refuses to start on a host with
no non-loopback address); upstream's fixed ports then clash with nothing on the host.

Each file gets fresh servers started the way upstream's ``scripts/run_tests.sh`` starts
them: a standalone HTTP metadata server on 8080, a master on 50051 with a 500 ms lease
(and the file's own flags), a real client on 50052 for the dummy-client files, the
engine target for the transfer-engine file. Those ports are upstream's fixed ones, so
nothing else on the host may hold them while this runs. Files that need a GPU, CXL or
SPDK are not in the default list.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

STORE_ENV = {
    "MC_METADATA_SERVER": "http://127.0.0.1:8080/metadata",
    "DEFAULT_KV_LEASE_TTL": "500",
}
LEASE = ["--default_kv_lease_ttl=500"]


class Plan:
    """What one test file needs around it."""

    def __init__(self, master=None, client=False, target=False, env=None, scratch_env=(),
                 peers=()):
        self.master = master  # None: no master; else its extra flags
        self.client = client  # a mooncake_client on 50052
        self.target = target  # transfer_engine_target.py
        self.env = dict(env or {})
        self.scratch_env = scratch_env  # variables set to a fresh scratch folder
        # Run as unittest scripts, one process per argument list, side by side (a test
        # whose instances meet each other); each one's tests count.
        self.peers = peers


STORE = Plan(master=[], env=STORE_ENV)
PLANS = {
    "transfer_engine_initiator_test.py": Plan(
        target=True, env={"MC_METADATA_SERVER": "http://127.0.0.1:8080/metadata",
                          "MC_FORCE_TCP": "true", "CIRCLE": "20"}),
    "test_distributed_object_store.py": STORE,
    "test_replicated_distributed_object_store.py": STORE,
    "test_batch_replica_clear.py": STORE,
    "test_put_get_tensor.py": STORE,
    "test_safetensor_functions.py": STORE,
    "test_dummy_client.py": Plan(master=[], client=True, env=STORE_ENV),
    "test_multi_dummy_clients.py": Plan(master=[], client=True, env=STORE_ENV,
                                        peers=(["--client-id", "client1"],
                                               ["--client-id", "client2"])),
    "test_ssd_offload_in_evict.py": Plan(master=["--root_fs_dir={scratch}"], env=STORE_ENV,
                                         scratch_env=("MOONCAKE_STORAGE_ROOT_DIR",)),
    "test_offload_on_eviction.py": Plan(
        master=["--root_fs_dir={scratch}", "--enable_offload=true", "--offload_on_evict=true"],
        env=STORE_ENV, scratch_env=("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",)),
    "test_promotion_on_hit.py": Plan(
        master=["--root_fs_dir={scratch}", "--enable_offload=true", "--offload_on_evict=true",
                "--promotion_on_hit=true", "--promotion_admission_threshold=1"],
        env=dict(STORE_ENV, MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT="10",
                 MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES="10485760"),
        scratch_env=("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",)),
    "test_cli.py": Plan(),
    "test_mooncake_config.py": Plan(),
    "test_import_structure.py": Plan(),
    "test_fast_copy.py": Plan(),
    "test_release_wheel_tags.py": Plan(),
    "test_http_metadata_server.py": Plan(),
    "test_meta_server.py": STORE,
    "test_dataproto_catalog.py": STORE,
    "test_buffer_pool_native.py": STORE,
    "test_structured_object_store.py": STORE,
    "test_mooncake_store_service_api.py": STORE,
}


def wait_port(port, proc, deadline_s=20.0):
    """True once 127.0.0.1:port accepts, False if ``proc`` died or time ran out."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def port_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


class Services:
    """The processes one file runs beside; stopped (TERM, then KILL) on exit."""

    def __init__(self, env, log):
        self.env, self.log, self.procs = env, log, []

    def start(self, argv, port=None, cwd=None, ready_text=None):
        """Starts ``argv``; waits until it listens on ``port`` or prints ``ready_text``."""
        out = subprocess.PIPE if ready_text else self.log
        proc = subprocess.Popen(argv, env=self.env, cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                text=bool(ready_text), bufsize=1 if ready_text else -1)
        self.procs.append(proc)
        if port is not None and not wait_port(port, proc):
            raise RuntimeError(f"{argv[0]} did not listen on {port}")
        if ready_text and not self._wait_text(proc, ready_text):
            raise RuntimeError(f"{' '.join(argv)} never printed {ready_text!r}")
        return proc

    def _wait_text(self, proc, text, deadline_s=30.0):
        """Copies ``proc``'s output to the log (on a thread); True once ``text`` shows."""
        seen = threading.Event()

        def pump():
            for line in proc.stdout:
                self.log.write(line)
                if text in line:
                    seen.set()
            seen.set()

        threading.Thread(target=pump, daemon=True).start()
        return seen.wait(deadline_s) and proc.poll() is None

    def stop(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def counts(junit_path):
    """(passed, failed, skipped) from a pytest junit file; errors count as failed."""
    try:
        root = ET.parse(junit_path).getroot()
    except (OSError, ET.ParseError):
        return None
    passed = failed = skipped = 0
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            failed += 1
        elif "skipped" in tags:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def unittest_counts(output):
    """(passed, failed, skipped) from unittest's closing lines, or None."""
    ran = re.search(r"^Ran (\d+) tests?", output, re.M)
    if not ran:
        return None
    total = int(ran.group(1))
    status = re.search(r"^(OK|FAILED)(?: \((.*)\))?\s*$", output, re.M)
    fields = dict(re.findall(r"(\w+)=(\d+)", status.group(2) or "")) if status else {}
    failed = int(fields.get("failures", 0)) + int(fields.get("errors", 0))
    skipped = int(fields.get("skipped", 0))
    if not status:
        failed = total
    return total - failed - skipped, failed, skipped


def run_peers(name, peers, python, workdir, env, log, timeout_s):
    procs = [subprocess.Popen([python, name, *args], cwd=workdir, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for args in peers]
    total, state = [0, 0, 0], "ran"
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            state = "timeout"
        log.write(out)
        got = unittest_counts(out) or (0, 1, 0)
        total = [a + b for a, b in zip(total, got)]
    return state, tuple(total)


def run_file(name, plan, workdir, python, timeout_s, logdir):
    bindir = os.path.dirname(os.path.abspath(python))
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    env.update(plan.env)
    scratch = tempfile.mkdtemp(prefix="mc-upstream-scratch-")
    for var in plan.scratch_env:
        env[var] = scratch
    for port in (8080, 50051, 50052, 9003):
        if not port_free(port):
            return ("port-busy", f"port {port} is in use")
    log = open(os.path.join(logdir, name + ".log"), "w")
    services = Services(env, log)
    try:
        if plan.master is not None or plan.target:
            services.start(["mooncake_http_metadata_server", "--port", "8080"], port=8080)
        if plan.master is not None:
            flags = [f.format(scratch=scratch) for f in LEASE + plan.master]
            services.start(["mooncake_master", *flags], port=50051)
        if plan.client:
            services.start(["mooncake_client", "--master_server_address=127.0.0.1:50051",
                            "--port=50052", "--global_segment_size=4GB"], port=50052)
        if plan.target:
            services.start([python, "-u", "transfer_engine_target.py"], cwd=workdir,
                           ready_text="Target server ready")
        junit = os.path.join(logdir, name + ".xml")
        log.flush()
        if plan.peers:
            return run_peers(name, plan.peers, python, workdir, env, log, timeout_s)
        try:
            subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"--junitxml={junit}", name], cwd=workdir, env=env, stdout=log,
                           stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            c = counts(junit)
            return ("timeout", c)
        return ("ran", counts(junit))
    except RuntimeError as e:
        return ("setup-failed", str(e))
    finally:
        services.stop()
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)


def in_own_netns(argv):
    """Re-runs this script inside a fresh network namespace; returns its exit status."""
    name = f"mc-upstream-{os.getpid()}"
    setup = [["ip", "netns", "add", name],
             ["ip", "-n", name, "link", "set", "lo", "up"],
             ["ip", "-n", name, "link", "add", "lan0", "type", "veth", "peer", "name", "lan1"],
             ["ip", "-n", name, "addr", "add", "10.214.0.1/24", "dev", "lan0"],
             ["ip", "-n", name, "link", "set", "lan1", "up"],
             ["ip", "-n", name, "link", "set", "lan0", "up"]]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True)
        rest = [a for a in argv if a != "--netns"]
        return subprocess.run(["ip", "netns", "exec", name, sys.executable,
                               os.path.abspath(__file__), *rest]).returncode
    finally:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", name], check=False)


def main():
    if "--netns" in sys.argv[1:]:
        return in_own_netns(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", required=True, help="folder holding upstream's test files")
    ap.add_argument("--python", required=True, help="interpreter with the package installed")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per file")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--logs", help="keep each file's log here (default: a scratch folder)")
    ap.add_argument("--netns", action="store_true",
                    help="run inside a network namespace of its own (needs root)")
    ap.add_argument("files", nargs="*", help="files to run (default: all that need no GPU)")
    args = ap.parse_args()
    files = args.files or list(PLANS)
    workdir = tempfile.mkdtemp(prefix="mc-upstream-tests-")
    src = os.path.abspath(args.tests)
    for entry in os.listdir(src):
        if entry.endswith(".py"):
            shutil.copy(os.path.join(src, entry), workdir)
    logdir = args.logs or tempfile.mkdtemp(prefix="mc-upstream-logs-")
    os.makedirs(logdir, exist_ok=True)
    results = {}
    total = [0, 0, 0]
    print(f"{'file':48} {'pass':>5} {'fail':>5} {'skip':>5}", flush=True)
    for name in files:
        plan = PLANS.get(name, STORE)
        state, detail = run_file(name, plan, workdir, args.python, args.timeout, logdir)
        if isinstance(detail, tuple):
            for i, n in enumerate(detail):
                total[i] += n
            row = f"{detail[0]:>5} {detail[1]:>5} {detail[2]:>5}"
        else:
            row = f"{'-':>5} {'-':>5} {'-':>5}"
        note = "" if state == "ran" else f"  ({state}: {detail})"
        print(f"{name:48} {row}{note}", flush=True)
        results[name] = {"state": state, "counts": detail}
    print(f"{'total':48} {total[0]:>5} {total[1]:>5} {total[2]:>5}")
    print(f"logs: {logdir}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
