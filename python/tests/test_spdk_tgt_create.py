"""mooncake.spdk_tgt_create without SSH or SPDK: its flags, the remote commands it would
run for a configuration (the SSH runner ``_spdk_nof.SpdkShell._run`` replaced by a
recorder), how it stops on a failing one, and its shell scripts run by a local shell
against a fake sysfs / SPDK tree with fake system tools on PATH."""

import logging
import os
import shlex
import stat
import subprocess
import sys
import textwrap

import pytest

from mooncake import _spdk_nof as nof
from mooncake import spdk_tgt_create as tgt
from mooncake.spdk_tgt_create import SPDKTgtCreator, main, parse_arguments

TRANSPORT_DEFAULTS = "-t RDMA -q 128 -m 127 -c 4096 -i 131072 -u 131072 -a 128 -n 4096 -b 32"
NQN = "nqn.2016-06.io.spdk:cnode1"


class Remote:
    """Stands in for every host: records (ip, command, timeout) and answers like a host
    where everything works, unless a rule (a substring of the command -> (rc, output) or
    an exception) says otherwise. Unready PCI devices are listed in ``unready``."""

    def __init__(self, rules=None, unready=(), discovered=""):
        self.calls = []
        self.rules = dict(rules or {})
        self.unready = set(unready)
        self.discovered = discovered

    def __call__(self, shell, ip, command, timeout):
        self.calls.append((ip, command, timeout))
        for needle, answer in self.rules.items():
            if needle in command:
                if isinstance(answer, Exception):
                    raise answer
                return answer
        kind = step(command)
        if kind == "discover":
            return 0, self.discovered
        if kind.startswith("ready "):
            return 0, "".join(
                f"unready {b} nvme\n" if b in self.unready else f"ready {b} vfio-pci\n"
                for b in kind.split()[1:])
        if kind == "stop":
            return 0, "idle\n"
        if "bdev_nvme_attach_controller" in command:
            return 0, shlex.split(command)[shlex.split(command).index("-b") + 1] + "n1\n"
        return 0, ""

    def steps(self, ip=None):
        return [step(c) for i, c, _ in self.calls if ip is None or i == ip]


def step(command):
    """A short name for the scripts, the command itself for everything else."""
    if command.endswith("&& test -f scripts/rpc.py"):
        return "root? " + shlex.split(command)[1]
    if "/sys/bus/pci/devices/*" in command:
        return "discover"
    if command.startswith("for bdf in"):
        return "ready " + " ".join(shlex.split(command.split(";")[0])[3:])
    if "pkill -x nvmf_tgt" in command:
        return "stop"
    if "nohup ./build/bin/nvmf_tgt" in command:
        return "start"
    return command


@pytest.fixture
def remote(monkeypatch):
    fake = Remote()
    monkeypatch.setattr(nof.SpdkShell, "_run",
                        lambda shell, ip, command, timeout: fake(shell, ip, command, timeout))
    return fake


def rpc(root, args):
    return f"cd {root} && ./scripts/rpc.py {args}"


def full_deploy(ip, root, pcis, bdevs=None, setup_prefix="env", trtype="RDMA",
                transport=TRANSPORT_DEFAULTS, extra_listen=""):
    bdevs = bdevs or [f"Nvme{i}n1" for i in range(len(pcis))]
    return ([f"cd {root} && {setup_prefix} PCI_ALLOWED={shlex.quote(' '.join(pcis))} "
             f"./scripts/setup.sh",
             "ready " + " ".join(pcis), "stop", "start",
             rpc(root, f"nvmf_create_transport {transport}")]
            + [rpc(root, f"bdev_nvme_attach_controller -b Nvme{i} -t PCIe -a {p}")
               for i, p in enumerate(pcis)]
            + [rpc(root, f"nvmf_create_subsystem {NQN} -a -s SPDK00000000000001 -m "
                         f"{max(12, len(bdevs))}")]
            + [rpc(root, f"nvmf_subsystem_add_ns {NQN} {b}") for b in bdevs]
            + [rpc(root, f"nvmf_subsystem_add_listener {NQN} -t {trtype} -a {ip} -s 4420"
                         f"{extra_listen}")])


# ------------------------------------------------------------------ flags


def test_flags_and_defaults_match_upstream():
    args = parse_arguments(["--spdk_target_info", "ip:10.0.0.1 path:/home/spdk"])
    assert vars(args) == {
        "spdk_target_info": ["ip:10.0.0.1 path:/home/spdk"], "core_mask": "0xff",
        "transport_type": "RDMA", "max_queue_depth": 128, "max_io_qpairs_per_ctrlr": 127,
        "max_io_size": 4096, "in_capsule_data_size": 131072, "io_unit_size": 131072,
        "max_aq_depth": 128, "num_shared_buffers": 4096, "buf_cache_size": 32,
        "username": "root", "port": 22, "password": None, "key_file": None}
    args = parse_arguments([
        "--spdk_target_info=ip:10.0.0.1 path:/a", "--spdk_target_info=ip:10.0.0.2 path:/b",
        "--core-mask", "[0-3]", "--transport-type", "TCP", "--max-queue-depth", "64",
        "--max-io-qpairs-per-ctrlr", "8", "--max-io-size", "8192",
        "--in-capsule-data-size", "4096", "--io-unit-size", "8192", "--max-aq-depth", "32",
        "--num-shared-buffers", "1024", "--buf-cache-size", "16", "--username", "admin",
        "--port", "2222", "--password", "pw", "--key-file", "/k"])
    assert args.spdk_target_info == ["ip:10.0.0.1 path:/a", "ip:10.0.0.2 path:/b"]
    assert (args.core_mask, args.transport_type, args.max_queue_depth,
            args.max_io_qpairs_per_ctrlr, args.max_io_size, args.in_capsule_data_size,
            args.io_unit_size, args.max_aq_depth, args.num_shared_buffers,
            args.buf_cache_size, args.username, args.port, args.password,
            args.key_file) == ("[0-3]", "TCP", 64, 8, 8192, 4096, 8192, 32, 1024, 16,
                               "admin", 2222, "pw", "/k")


@pytest.mark.parametrize("argv, complaint", [
    ([], "--spdk_target_info"),
    (["--spdk_target_info", "ip:1.2.3.4 path:/x", "--max-io-size", "4k"], "not an integer"),
    (["--spdk_target_info", "ip:1.2.3.4 path:/x", "--max-queue-depth", "0"], "not positive"),
    (["--spdk_target_info", "ip:1.2.3.4 path:/x", "--port", "70000"], "not a port"),
    (["--spdk_target_info", "ip:1.2.3.4 path:/x", "--core-mask", "0xff;reboot"],
     "malformed core mask"),
    (["--spdk_target_info", "ip:1.2.3.4 path:/x", "--core-mask", "0x0"], "malformed core"),
    (["--spdk_target_info", "ip:1.2.3.4 path:/x", "--transport-type", "RDMA -x"],
     "malformed transport type"),
])
def test_bad_flags_exit_2_with_a_message(argv, complaint, capsys, remote):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert complaint in capsys.readouterr().err
    assert remote.calls == []


# ------------------------------------------------------------------ target descriptions


@pytest.mark.parametrize("text, expected", [
    ("ip:192.168.65.56 path:/home/spdk", ("192.168.65.56", "/home/spdk", [])),
    ("ip:192.168.65.56 path:/home/spdk pci:0000:01:00.0,0000:02:00.0",
     ("192.168.65.56", "/home/spdk", ["0000:01:00.0", "0000:02:00.0"])),
    # space-separated continuation, short and upper-case forms, a repeat dropped
    ("pci:01:00.0 ABCD:02:00.1, 0000:01:00.0 path:/s ip:10.0.0.1",
     ("10.0.0.1", "/s", ["0000:01:00.0", "abcd:02:00.1"])),
    ("ip:10.0.0.1 path:/opt/my spdk dir pci:0000:01:00.0",
     ("10.0.0.1", "/opt/my spdk dir", ["0000:01:00.0"])),
    ("ip:fe80::1 path:~/spdk", ("fe80::1", "~/spdk", [])),
])
def test_target_descriptions(text, expected, remote):
    creator = SPDKTgtCreator([text])
    config = creator.target_configs[0]
    assert (config["ip"], config["path"], config["pci_devices"]) == expected
    assert remote.calls == []  # parsing asks no host


@pytest.mark.parametrize("text, complaint", [
    ("path:/home/spdk", "needs an ip: field"),
    ("ip:10.0.0.1", "needs a path: field"),
    ("ip:10.0.0.1 path:/x pci:0000:01:00", "malformed PCI address '0000:01:00'"),
    ("ip:10.0.0.1 path:/x pci:01:00.0;reboot", "malformed PCI address"),
    ("ip:10.0.0.1 path:/x nsid:1", "unknown field 'nsid'"),
    ("stray ip:10.0.0.1 path:/x", "unexpected 'stray'"),
    ("ip:10.0.0.1 ip:10.0.0.2 path:/x", "ip: given twice"),
    ("ip:-oProxyCommand=x path:/x", "not an IP address"),
    ("ip:host.example path:/x", "not an IP address"),
])
def test_bad_target_descriptions(text, complaint, remote):
    with pytest.raises(ValueError, match="spdk_target_info") as e:
        SPDKTgtCreator([text])
    assert complaint in str(e.value)
    assert remote.calls == []


def test_constructor_defaults_and_checks():
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/x"])
    assert creator.spdk_targets == ["ip:10.0.0.1 path:/x"]
    assert (creator.core_mask, creator.port) == ("0xff", 22)
    assert creator.transport_options == SPDKTgtCreator.DEFAULT_TRANSPORT_OPTIONS
    assert creator.transport_options is not SPDKTgtCreator.DEFAULT_TRANSPORT_OPTIONS
    assert list(SPDKTgtCreator.TRANSPORT_RPC_FLAGS) == list(
        SPDKTgtCreator.DEFAULT_TRANSPORT_OPTIONS)
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/x"], {"trtype": "TCP", "max_io_size": "8192"},
                             "0x3", 2222)
    assert creator.transport_options["trtype"] == "TCP"
    assert creator.transport_options["max_io_size"] == 8192
    assert creator.transport_options["max_queue_depth"] == 128
    for kwargs, complaint in [
            ({"spdk_targets": []}, "no SPDK target"),
            ({"transport_options": {"max_qd": 1}}, "unknown transport option 'max_qd'"),
            ({"transport_options": {"max_io_size": -1}}, "positive integer"),
            ({"transport_options": {"max_io_size": 1.5}}, "positive integer"),
            ({"transport_options": {"trtype": "RDMA; reboot"}}, "malformed transport type"),
            ({"core_mask": "ff ff"}, "malformed core mask"),
            ({"port": 0}, "not a port number"),
            ({"port": "ssh"}, "not a port number")]:
        kwargs.setdefault("spdk_targets", ["ip:10.0.0.1 path:/x"])
        with pytest.raises(ValueError, match=complaint):
            SPDKTgtCreator(**kwargs)


# ------------------------------------------------------------------ remote commands


def test_explicit_devices_run_upstreams_steps_in_order(remote):
    creator = SPDKTgtCreator(
        ["ip:192.168.65.56 path:/home/spdk pci:0000:01:00.0,0000:02:00.0"])
    assert creator.deploy_all_targets() is True
    assert {ip for ip, _, _ in remote.calls} == {"192.168.65.56"}
    assert remote.steps() == ["root? /home/spdk"] + full_deploy(
        "192.168.65.56", "/home/spdk", ["0000:01:00.0", "0000:02:00.0"])
    start = next(c for _, c, _ in remote.calls if step(c) == "start")
    assert "nohup ./build/bin/nvmf_tgt -m 0xff > tgt.log" in start
    assert start.startswith("cd /home/spdk ||")


def test_discovered_devices_and_unready_ones_skipped(remote, caplog):
    remote.discovered = ("use 0000:01:00.0\nskip 0000:02:00.0 in_use\n"
                         "use 0000:03:00.0 vfio-pci\ngarbage line\nuse not-a-bdf\n")
    remote.unready = {"0000:01:00.0"}
    creator = SPDKTgtCreator(["ip:10.0.0.7 path:/spdk"], core_mask="[0-3]")
    with caplog.at_level(logging.INFO, logger="mooncake"):
        assert creator.deploy_all_targets() is True
    steps = remote.steps()
    assert steps[:4] == [
        "root? /spdk", "discover",
        "cd /spdk && env PCI_ALLOWED='0000:01:00.0 0000:03:00.0' ./scripts/setup.sh",
        "ready 0000:01:00.0 0000:03:00.0"]
    # only the device SPDK got is attached
    assert rpc("/spdk", "bdev_nvme_attach_controller -b Nvme0 -t PCIe -a 0000:03:00.0") in steps
    assert not any("0000:01:00.0" in s for s in steps[4:])
    start = next(c for _, c, _ in remote.calls if step(c) == "start")
    assert "-m '[0-3]'" in start
    assert "leaving NVMe controller 0000:02:00.0 alone (in_use)" in caplog.text
    assert "0000:01:00.0 (driver nvme)" in caplog.text


def test_no_device_found_stops_before_setup(remote, caplog):
    remote.discovered = "skip 0000:02:00.0 in_use\n"
    creator = SPDKTgtCreator(["ip:10.0.0.7 path:/spdk"])
    assert creator.deploy_all_targets() is False
    assert remote.steps() == ["root? /spdk", "discover"]
    assert "no NVMe controller" in caplog.text


def test_named_device_not_given_to_spdk_is_an_error(remote, caplog):
    remote.unready = {"0000:02:00.0"}
    creator = SPDKTgtCreator(["ip:10.0.0.7 path:/spdk pci:0000:01:00.0,0000:02:00.0"])
    assert creator.deploy_all_targets() is False
    assert remote.steps()[-1] == "ready 0000:01:00.0 0000:02:00.0"  # nothing started
    assert ("not bound to a user-space driver after setup.sh: 0000:02:00.0 (driver nvme)"
            in caplog.text)


def test_failing_rpc_stops_that_target_with_its_output(remote, caplog):
    remote.rules["nvmf_create_subsystem"] = (1, "error: Invalid parameters\n")
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/spdk pci:0000:01:00.0"])
    assert creator.deploy_all_targets() is False
    steps = remote.steps()
    assert steps[-1].startswith(rpc("/spdk", "nvmf_create_subsystem"))
    assert not any("add_ns" in s or "add_listener" in s for s in steps)
    assert (f"failed to deploy the SPDK target on 10.0.0.1: 10.0.0.1: rpc.py "
            f"nvmf_create_subsystem {NQN} -a -s SPDK00000000000001 -m 12 failed (exit "
            f"status 1): error: Invalid parameters") in caplog.text


def test_one_failing_target_does_not_stop_the_next(remote, caplog):
    remote.rules["PCI_ALLOWED=0000:01:00.0 "] = (1, "")
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/a pci:01:00.0",
                              "ip:10.0.0.2 path:/b pci:0000:02:00.0"])
    assert creator.deploy_all_targets() is False
    assert remote.steps("10.0.0.1")[-1].endswith("./scripts/setup.sh")
    assert remote.steps("10.0.0.2") == ["root? /b"] + full_deploy(
        "10.0.0.2", "/b", ["0000:02:00.0"])
    assert "scripts/setup.sh failed (exit status 1): no output" in caplog.text
    assert "deployed 1 of 2 SPDK target(s), 1 failed" in caplog.text


@pytest.mark.parametrize("failure", [OSError("Connection refused"),
                                     RuntimeError("10.0.0.1: SSH failed: auth")])
def test_unreachable_host_is_reported(remote, caplog, failure):
    remote.rules["test -f"] = failure
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/spdk"])
    assert creator.deploy_target(creator.target_configs[0]) is False
    assert str(failure) in caplog.text


def test_stop_failure_and_already_running_target(remote, caplog):
    remote.rules["pkill"] = (0, "stopped\n")
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/spdk pci:0000:01:00.0"])
    with caplog.at_level(logging.INFO, logger="mooncake"):
        assert creator.deploy_all_targets() is True
    assert "stopped the nvmf_tgt that was running" in caplog.text
    remote.calls.clear()
    remote.rules["pkill"] = (1, "nvmf_tgt still runs 15 s after SIGTERM\n")
    assert creator.deploy_all_targets() is False
    assert remote.steps()[-1] == "stop"
    assert "stopping nvmf_tgt failed (exit status 1): nvmf_tgt still runs" in caplog.text


def test_spdk_tree_found_under_path_or_reported_missing(remote, caplog):
    remote.rules["cd /opt/ && test -f"] = (1, "")
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/opt/ pci:0000:01:00.0"])
    assert creator.deploy_all_targets() is True
    steps = remote.steps()
    assert steps[:2] == ["root? /opt/", "root? /opt/spdk"]
    assert steps[-1] == rpc("/opt/spdk",
                            f"nvmf_subsystem_add_listener {NQN} -t RDMA -a 10.0.0.1 -s 4420")
    remote.calls.clear()
    remote.rules["test -f"] = (1, "")
    assert creator.deploy_all_targets() is False
    assert len(remote.calls) == 2
    assert "no scripts/rpc.py under /opt/ or /opt/spdk" in caplog.text


def test_every_namespace_is_exported(remote):
    names = " ".join(f"Nvme0n{i}" for i in range(1, 14))
    remote.rules["bdev_nvme_attach_controller"] = (0, names + "\n")
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/s pci:0000:01:00.0"])
    assert creator.deploy_all_targets() is True
    assert remote.steps()[1:] == full_deploy("10.0.0.1", "/s", ["0000:01:00.0"],
                                             bdevs=names.split())


def test_values_are_quoted_for_the_remote_shell(remote):
    path = "/opt/my spdk;touch /tmp/x"
    creator = SPDKTgtCreator([f"ip:10.0.0.1 path:{path} pci:0000:01:00.0"])
    assert creator.deploy_all_targets() is True
    for _, command, _ in remote.calls:
        if step(command) in ("stop",) or step(command).startswith("ready"):
            continue
        if step(command) == "start":
            assert command.startswith(f"cd {shlex.quote(path)} ||")
            continue
        words = shlex.split(command)
        assert words[:2] == ["cd", path], command
    # a home-relative tree keeps its ~ unquoted so the remote shell expands it
    remote.calls.clear()
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:~/spdk 2 pci:0000:01:00.0"])
    assert creator.deploy_all_targets() is True
    assert remote.calls[0][1] == "cd ~/'spdk 2' && test -f scripts/rpc.py"


def test_rpc_arguments_are_quoted_one_by_one(remote):
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/s"])
    creator._rpc("10.0.0.1", "/s p", "nvmf_subsystem_add_ns", "a b", "$(reboot)", 12)
    command = remote.calls[-1][1]
    assert command == "cd '/s p' && ./scripts/rpc.py nvmf_subsystem_add_ns 'a b' '$(reboot)' 12"
    assert shlex.split(command)[-3:] == ["a b", "$(reboot)", "12"]


def test_options_user_and_ipv6_reach_the_commands(remote):
    assert main(["--spdk_target_info", "ip:fd00::5 path:/s pci:0000:01:00.0",
                 "--transport-type", "TCP", "--max-io-size", "8192", "--buf-cache-size", "8",
                 "--username", "admin", "--core-mask", "0x3"]) == 0
    transport = TRANSPORT_DEFAULTS.replace("RDMA", "TCP").replace("-c 4096", "-c 8192") \
        .replace("-b 32", "-b 8")
    assert remote.steps()[1:] == full_deploy(
        "fd00::5", "/s", ["0000:01:00.0"], setup_prefix="sudo -n env", trtype="TCP",
        transport=transport, extra_listen=" -f ipv6")


def test_deploy_target_checks_a_hand_made_config(remote, caplog):
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/s"])
    assert creator.deploy_target({"ip": "10.0.0.9", "path": "/t",
                                  "pci_devices": ["0000:05:00.0"]}) is True
    assert remote.steps()[0] == "root? /t"
    remote.calls.clear()
    assert creator.deploy_target({"ip": "10.0.0.9", "path": "/t",
                                  "pci_devices": ["$(reboot)"]}) is False
    assert remote.calls == []
    assert "malformed PCI address '$(reboot)'" in caplog.text


def test_main_exit_status(remote, caplog):
    assert main(["--spdk_target_info", "ip:10.0.0.1 path:/s pci:0000:01:00.0"]) == 0
    remote.rules["nvmf_create_transport"] = (2, "transport exists")
    assert main(["--spdk_target_info", "ip:10.0.0.1 path:/s pci:0000:01:00.0"]) == 1
    calls = len(remote.calls)
    assert main(["--spdk_target_info", "ip:10.0.0.1"]) == 1
    assert len(remote.calls) == calls
    assert "spdk_target_info 'ip:10.0.0.1': needs a path: field" in caplog.text


# ------------------------------------------------------------------ SSH without paramiko


def test_password_needs_paramiko_and_ssh_command_fallback(monkeypatch, remote, caplog):
    monkeypatch.setitem(sys.modules, "paramiko", None)  # import paramiko -> ImportError
    with pytest.raises(RuntimeError, match="needs paramiko"):
        SPDKTgtCreator(["ip:10.0.0.1 path:/s"], password="pw")
    assert main(["--spdk_target_info", "ip:10.0.0.1 path:/s", "--password", "pw"]) == 1
    assert "needs paramiko" in caplog.text
    assert remote.calls == []


def test_ssh_command_argv_and_timeout(monkeypatch):
    monkeypatch.setitem(sys.modules, "paramiko", None)
    monkeypatch.setattr(nof.shutil, "which", lambda name: "/usr/bin/ssh")
    seen = []

    def fake_run(argv, **kwargs):
        seen.append((argv, kwargs["timeout"]))
        if argv[-1] == "slow":
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        if argv[-1] == "unreachable":
            return subprocess.CompletedProcess(argv, 255, "", "ssh: connect to host 10.0.0.1 "
                                                             "port 2222: Connection refused\n")
        return subprocess.CompletedProcess(argv, 3, "", "boom\n")

    monkeypatch.setattr(nof.subprocess, "run", fake_run)
    shell = nof.SpdkShell({"username": "admin", "port": 2222, "key_file": "/k"})
    with pytest.raises(RuntimeError, match=r"10\.0\.0\.1: probe failed \(exit status 3\): boom"):
        shell.run("10.0.0.1", "true", 30, what="probe")
    assert seen[0] == (["/usr/bin/ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                        "-p", "2222", "-l", "admin", "-i", "/k", "--", "10.0.0.1", "true"], 40)
    with pytest.raises(RuntimeError, match="no answer over SSH within 15 s"):
        shell.run("10.0.0.1", "slow", 5)
    # ssh's own failure is not taken for a command's answer (e.g. "no rpc.py there")
    with pytest.raises(RuntimeError, match="10.0.0.1: SSH failed: ssh: connect to host "
                                           "10.0.0.1 port 2222: Connection refused"):
        shell._run("10.0.0.1", "unreachable", 5)


def test_imports_without_paramiko():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "paramiko":
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Block())
        from mooncake.spdk_tgt_create import SPDKTgtCreator, main, parse_arguments
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ------------------------------------------------------------------ the scripts, locally

SHELLS = [sh for sh in ("bash", "dash") if any(
    os.access(os.path.join(d, sh), os.X_OK) for d in os.environ["PATH"].split(os.pathsep))]


def write_tool(directory, name, body):
    path = directory / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def local(tmp_path, monkeypatch):
    """Runs the creator's remote commands with a local shell: /sys/ means tmp/sys/, and
    tmp/bin (fake lsblk, pgrep, pkill, a sleep that returns at once) comes first on
    PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_tool(bindir, "sleep", "exit 0\n")
    state = {"shell": "bash"}

    def run(shell, ip, command, timeout):
        command = command.replace("/sys/", f"{tmp_path}/sys/")
        env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
        done = subprocess.run([state["shell"], "-c", command], capture_output=True,
                              text=True, timeout=60, env=env, cwd=tmp_path)
        return done.returncode, done.stdout or done.stderr

    monkeypatch.setattr(nof.SpdkShell, "_run", run)
    return tmp_path, bindir, state


def fake_pci(root, bdf, pci_class="0x010802", driver=None):
    dev = root / "sys/devices/pci0000:00" / bdf
    dev.mkdir(parents=True)
    (dev / "class").write_text(pci_class + "\n")
    if driver:
        drv = root / "sys/bus/pci/drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(drv)
    link = root / "sys/bus/pci/devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(dev)
    return dev


def fake_disk(root, dev, name):
    ctrl = dev / "nvme" / ("nvme" + name[4])
    ctrl.mkdir(parents=True, exist_ok=True)
    block = root / "sys/block" / name
    block.mkdir(parents=True)
    (block / "device").symlink_to(ctrl)


@pytest.mark.parametrize("shell", SHELLS)
def test_discovery_script_leaves_used_disks_alone(local, shell, caplog):
    root, bindir, state = local
    state["shell"] = shell
    fake_disk(root, fake_pci(root, "0000:01:00.0", driver="nvme"), "nvme0n1")
    fake_disk(root, fake_pci(root, "0000:02:00.0", driver="nvme"), "nvme1n1")
    fake_pci(root, "0000:03:00.0", driver="vfio-pci")
    fake_pci(root, "0000:04:00.0", driver="nvme")
    fake_pci(root, "0000:05:00.0", pci_class="0x020000", driver="mlx5_core")
    fake_disk(root, fake_pci(root, "0000:06:00.0", driver="nvme"), "nvme2n1")
    fake_disk(root, fake_pci(root, "0000:07:00.0"), "nvme3n1")
    write_tool(bindir, "lsblk", """\
        case "$4" in
          /dev/nvme0n1) printf 'disk \\npart \\n' ;;
          /dev/nvme1n1) printf 'disk \\npart /data\\n' ;;
          /dev/nvme2n1) printf 'disk \\nlvm \\n' ;;
          *) exit 32 ;;
        esac
        """)
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/s"])
    assert creator._discover("10.0.0.1") == ["0000:01:00.0", "0000:03:00.0"]
    for bdf, why in [("0000:02:00.0", "in_use"), ("0000:04:00.0", "no_block_device"),
                     ("0000:06:00.0", "in_use"), ("0000:07:00.0", "unreadable")]:
        assert f"leaving NVMe controller {bdf} alone ({why})" in caplog.text
    assert "0000:05:00.0" not in caplog.text


@pytest.mark.parametrize("shell", SHELLS)
def test_driver_check_script(local, shell, caplog):
    root, _, state = local
    state["shell"] = shell
    fake_pci(root, "0000:01:00.0", driver="vfio-pci")
    fake_pci(root, "0000:02:00.0", driver="nvme")
    pcis = ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"]
    creator = SPDKTgtCreator(["ip:10.0.0.1 path:/s"])
    assert creator._ready("10.0.0.1", pcis, strict=False) == ["0000:01:00.0"]
    with pytest.raises(RuntimeError, match=r"0000:02:00\.0 \(driver nvme\), "
                                           r"0000:03:00\.0 \(driver none\)"):
        creator._ready("10.0.0.1", pcis, strict=True)


@pytest.mark.parametrize("shell", SHELLS)
def test_stop_script(local, shell):
    root, bindir, state = local
    state["shell"] = shell
    running = root / "running"
    write_tool(bindir, "pgrep", f'[ "$*" = "-x nvmf_tgt" ] && [ -e {running} ]\n')
    write_tool(bindir, "pkill", f'[ "$*" = "-x nvmf_tgt" ] && rm -f {running}\n')
    shell_ = nof.SpdkShell({})
    assert shell_.run("h", tgt._STOP_SCRIPT).strip() == "idle"
    running.touch()
    assert shell_.run("h", tgt._STOP_SCRIPT).strip() == "stopped"
    assert not running.exists()
    running.touch()
    write_tool(bindir, "pkill", "exit 0\n")  # it ignores SIGTERM
    with pytest.raises(RuntimeError, match="still runs 15 s after SIGTERM"):
        shell_.run("h", tgt._STOP_SCRIPT)


@pytest.mark.parametrize("shell", SHELLS)
def test_start_script(local, shell):
    root, bindir, state = local
    state["shell"] = shell
    write_tool(bindir, "pgrep", "exit 1\n")  # no nvmf_tgt running
    tree = root / "spdk tree"
    (tree / "scripts").mkdir(parents=True)
    creator = SPDKTgtCreator([f"ip:10.0.0.1 path:{tree}"], core_mask="0x3")
    with pytest.raises(RuntimeError, match="no build/bin/nvmf_tgt in .*spdk tree"):
        creator._restart_tgt("10.0.0.1", str(tree))
    (tree / "build/bin").mkdir(parents=True)
    write_tool(tree / "build/bin", "nvmf_tgt", 'echo "boom $*"; exit 3\n')
    write_tool(tree / "scripts", "rpc.py", "exit 1\n")
    # it died at start: said at once (not after waiting out the RPC loop), with its log
    with pytest.raises(RuntimeError, match=r"starting nvmf_tgt failed \(exit status 1\): "
                                           r"nvmf_tgt exited; end of tgt.log:\nboom -m 0x3$"):
        creator._restart_tgt("10.0.0.1", str(tree))
    write_tool(tree / "scripts", "rpc.py", '[ "$*" = "-t 1 spdk_get_version" ]\n')
    write_tool(tree / "build/bin", "nvmf_tgt", "exit 0\n")
    creator._restart_tgt("10.0.0.1", str(tree))  # answers at once: no error


# ------------------------------------------------------------------ paramiko channels


class _FakeChannel:
    """A channel whose command writes ``chunks`` to stdout (one per read) and then exits
    with ``rc``; ``exits=False``: it never exits."""

    def __init__(self, chunks, rc=0, exits=True, stderr=b""):
        import threading

        self._chunks = list(chunks)
        self._stderr = stderr
        self._rc = rc
        self._exits = exits
        self.status_event = threading.Event()
        if exits and not self._chunks:
            self.status_event.set()

    def recv_ready(self):
        return bool(self._chunks)

    def recv(self, n):
        chunk = self._chunks.pop(0)
        assert len(chunk) <= n
        if self._exits and not self._chunks:
            self.status_event.set()  # the command ends once its output was read
        return chunk

    def recv_stderr_ready(self):
        return bool(self._stderr)

    def recv_stderr(self, n):
        data, self._stderr = self._stderr, b""
        return data

    def exit_status_ready(self):
        return self.status_event.is_set()

    def recv_exit_status(self):
        assert self.status_event.is_set()
        return self._rc


def test_channel_output_is_read_as_it_comes_whatever_its_size():
    # 64 chunks of 64 KiB: 4 MiB, more than a channel's window, read before the exit.
    chunks = [bytes([65 + i % 26]) * (1 << 16) for i in range(64)]
    rc, out = nof.collect_channel(_FakeChannel(chunks, rc=3), "10.0.0.1", 30)
    assert rc == 3 and out.encode() == b"".join(chunks)


def test_channel_reports_stderr_when_stdout_is_empty():
    rc, out = nof.collect_channel(_FakeChannel([], rc=1, stderr=b"no such bdev"), "h", 30)
    assert (rc, out) == (1, "no such bdev")


def test_a_command_that_never_finishes_is_given_up_on():
    with pytest.raises(RuntimeError, match="did not finish within"):
        nof.collect_channel(_FakeChannel([b"partial"], exits=False), "10.0.0.1", 0.05)
