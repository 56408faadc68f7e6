"""What ``mooncake_ssd_register`` and ``mooncake_ssd_unregister`` share: their common
flags and start-up, SPDK target descriptions, asking a target (over SSH, its
``scripts/rpc.py``) which NVMe namespaces it exports, and the store's NVMe-oF
registration class, applied to each SSD in turn.

SSH goes through paramiko when it is installed (password or key file), else the ``ssh``
command (key-based, non-interactive). ``spdk_tgt_create`` uses the same :class:`SpdkShell`
to run its set-up commands on a target. The registration class itself,
``mooncake.store.MooncakeDistributedNoFRegister``, lives here: in this build it answers
-1 (no NVMe-oF segments), so each SSD is reported as failed with the reason logged.
"""

import json
import logging
import re
import shlex
import shutil
import subprocess
import time

from .mooncake_config import parse_defines

logger = logging.getLogger("mooncake")

_SSH_CONNECT_TIMEOUT_S = 10
_READ_CHUNK = 1 << 16
_POLL_S = 0.01
_SSH_COMMAND_TIMEOUT_S = 30
_RPC_SCRIPT = "scripts/rpc.py"


def add_shared_arguments(parser):
    """The SSH and -D flags both tools take."""
    parser.add_argument("--username", default="root", help="SSH user (root)")
    parser.add_argument("--port", type=int, default=22, help="SSH port (22)")
    parser.add_argument("--password", help="SSH password (needs paramiko)")
    parser.add_argument("--key-file", help="SSH private key file")
    parser.add_argument("-D", "--define", action="append", default=[],
                        help="override a field of every SSD, e.g. -Dtrsvcid=4420")


def cli_config_from(args):
    """The tools' cli_config: the -D overrides, the master and the SSH settings."""
    cli_config = parse_defines(args.define)
    cli_config["master_server_address"] = args.master_server_address
    cli_config["username"] = args.username
    cli_config["port"] = args.port
    if args.password:
        cli_config["password"] = args.password
    if args.key_file:
        cli_config["key_file"] = args.key_file
    return cli_config


def run_tool(tool_class, args, start):
    """A tool's ``main``: logs to stderr, builds ``tool_class`` from the parsed ``args``
    and runs ``start(tool)``; exit status 0 when it succeeded, else 1."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    try:
        tool = tool_class(cli_config_from(args), args.spdk_target_info)
    except (ValueError, RuntimeError) as e:
        logger.error("configuration load failed: %s", e)
        return 1
    return 0 if start(tool) else 1


def master_of(cli_config, spdk_targets):
    """The master address of a tool's arguments; ValueError when it or the targets are
    missing."""
    if not spdk_targets:
        raise ValueError("spdk_target_info is required")
    master = cli_config.get("master_server_address")
    if not master:
        raise ValueError("master_server_address is required when using spdk_target_info")
    return master


def parse_target_info(text):
    """{"ip": ..., "path": ..., "ns": ..., ...} from "ip:1.2.3.4 path:/home/spdk"."""
    return dict(re.findall(r"(\w+):(\S+)", text))


def apply_overrides(configs, cli_config):
    """Sets every -D override whose key a config already has (trsvcid/nsid as ints)."""
    for config in configs:
        for key, value in cli_config.items():
            if key not in config:
                continue
            if key in ("trsvcid", "nsid"):
                try:
                    config[key] = int(value)
                except ValueError:
                    logger.warning("ignoring -D%s=%s: not an integer", key, value)
            else:
                config[key] = value


def settle(configs, cli_config):
    """The configs with the -D overrides of ``cli_config`` applied, each SSD once."""
    apply_overrides(configs, cli_config)
    return dedupe(configs)


def dedupe(configs):
    """The configs, each (nqn, nsid, traddr, trsvcid) once, first one kept."""
    seen, out = set(), []
    for config in configs:
        key = (config["nqn"], config["nsid"], config["traddr"], config["trsvcid"])
        if key not in seen:
            seen.add(key)
            out.append(config)
    if len(out) < len(configs):
        logger.info("removed %d duplicate SSD configuration(s)", len(configs) - len(out))
    return out


def ssd_config(nqn, nsid, traddr, trsvcid, size, master_server_address):
    return {"nqn": nqn, "nsid": nsid, "traddr": traddr, "trsvcid": int(trsvcid), "base": 0,
            "size": size, "master_server_address": master_server_address,
            "metadata_server": ""}


def remote_path(path):
    """``path`` quoted for a remote shell; a leading ``~/`` stays unquoted so that it
    still means the remote user's home."""
    if path == "~" or path == "~/":
        return "~"
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def rpc_command(root, rpc_args):
    """The remote command that runs ``scripts/rpc.py RPC_ARGS`` (already quoted) of the
    SPDK tree ``root``."""
    return f"cd {remote_path(root)} && ./{_RPC_SCRIPT} {rpc_args}"


def have_paramiko():
    try:
        import paramiko  # noqa: F401
    except ImportError:
        return False
    return True


def collect_channel(chan, ip, timeout):
    """(exit status, stdout or else stderr) of a command running on a paramiko channel,
    read as it comes (a command writing more than the channel's window would otherwise
    never finish); RuntimeError when it has not finished within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    out, err = [], []
    while True:
        moved = False
        while chan.recv_ready():
            out.append(chan.recv(_READ_CHUNK))
            moved = True
        while chan.recv_stderr_ready():
            err.append(chan.recv_stderr(_READ_CHUNK))
            moved = True
        if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{ip}: the command did not finish within {timeout} s")
        if not moved:
            # Woken early by the exit status; data that comes meanwhile waits a moment.
            chan.status_event.wait(_POLL_S)
    rc = chan.recv_exit_status()
    return rc, b"".join(out).decode(errors="replace") or b"".join(err).decode(errors="replace")


class SpdkShell:
    """Runs commands (SPDK's rpc.py among them) on targets over SSH with the CLI's
    user/port/password/key. Every command is one SSH session; :meth:`_run` is the only
    place that talks to a host."""

    def __init__(self, cli_config):
        self._user = cli_config.get("username", "root")
        self._port = int(cli_config.get("port", 22))
        self._password = cli_config.get("password")
        self._key_file = cli_config.get("key_file")

    def check_password_support(self):
        """RuntimeError when a password was given but only the ssh command (which cannot
        take one) is available."""
        if self._password and not have_paramiko():
            raise RuntimeError("SSH with a password needs paramiko (pip install paramiko); "
                               "or use --key-file")

    def run(self, ip, command, timeout=_SSH_COMMAND_TIMEOUT_S, what=None):
        """The output of ``command`` on ``ip``; RuntimeError, naming ``what`` (default:
        the command) and the output, when it exits nonzero."""
        rc, out = self._run(ip, command, timeout)
        if rc != 0:
            detail = out.strip() or "no output"
            raise RuntimeError(f"{ip}: {what or command} failed (exit status {rc}): {detail}")
        return out

    def spdk_root(self, ip, spdk_path):
        """The SPDK tree on ``ip``: ``spdk_path`` or its spdk/ subdirectory, whichever
        holds scripts/rpc.py; RuntimeError when neither does."""
        candidates = (spdk_path, f"{spdk_path.rstrip('/')}/spdk")
        for root in candidates:
            rc, _ = self._run(ip, f"cd {remote_path(root)} && test -f {_RPC_SCRIPT}", 5)
            if rc == 0:
                return root
        raise RuntimeError(f"{ip}: no {_RPC_SCRIPT} under {' or '.join(candidates)}")

    def rpc(self, ip, spdk_path, rpc_args):
        """The JSON answer of ``scripts/rpc.py RPC_ARGS`` in ``spdk_path`` (or its spdk/
        subdirectory) on ``ip``."""
        root = self.spdk_root(ip, spdk_path)
        return json.loads(self.run(ip, rpc_command(root, rpc_args), what=f"rpc.py {rpc_args}"))

    def _run(self, ip, command, timeout):
        """(exit status, stdout or else stderr) of ``command`` on ``ip``; RuntimeError or
        OSError when the host cannot be reached or does not answer in time."""
        try:
            import paramiko
        except ImportError:
            return self._run_ssh_command(ip, command, timeout)
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect(ip, port=self._port, username=self._user, password=self._password,
                           key_filename=self._key_file, timeout=_SSH_CONNECT_TIMEOUT_S)
            _, stdout, _ = client.exec_command(command, timeout=timeout)
            return collect_channel(stdout.channel, ip, timeout)
        except paramiko.SSHException as e:  # authentication, protocol, channel errors
            raise RuntimeError(f"{ip}: SSH failed: {e}") from e
        finally:
            client.close()

    def _run_ssh_command(self, ip, command, timeout):
        self.check_password_support()
        ssh = shutil.which("ssh")
        if ssh is None:
            raise RuntimeError("no ssh command found (and paramiko is not installed)")
        cmd = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={_SSH_CONNECT_TIMEOUT_S}",
               "-p", str(self._port), "-l", self._user]
        if self._key_file:
            cmd += ["-i", self._key_file]
        limit = timeout + _SSH_CONNECT_TIMEOUT_S
        try:
            # "--": a host can never be read as an ssh option
            done = subprocess.run(cmd + ["--", ip, command], capture_output=True, text=True,
                                  timeout=limit)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{ip}: no answer over SSH within {limit} s") from e
        if done.returncode == 255:  # ssh's own failure (connect, log-in), as paramiko raises
            raise RuntimeError(f"{ip}: SSH failed: {done.stderr.strip() or 'exit status 255'}")
        return done.returncode, done.stdout or done.stderr


def nvme_namespaces(shell, ip, spdk_path):
    """[(nqn, traddr, trsvcid, nsid, bdev_name)] for every namespace of every NVMe
    subsystem the target at ``ip`` exports (first listen address of each)."""
    out = []
    for subsystem in shell.rpc(ip, spdk_path, "nvmf_get_subsystems"):
        listeners = subsystem.get("listen_addresses") or []
        if subsystem.get("subtype") != "NVMe" or not subsystem.get("nqn") or not listeners:
            continue
        traddr, trsvcid = listeners[0].get("traddr"), listeners[0].get("trsvcid")
        if not traddr or not trsvcid:
            continue
        for namespace in subsystem.get("namespaces") or []:
            if namespace.get("nsid"):
                out.append((subsystem["nqn"], traddr, int(trsvcid), namespace["nsid"],
                            namespace.get("bdev_name")))
    return out


def bdev_size(shell, ip, spdk_path, bdev_name):
    """Bytes of an SPDK block device (block size x block count); 0 if unknown."""
    bdevs = shell.rpc(ip, spdk_path, f"bdev_get_bdevs -b {shlex.quote(bdev_name)}")
    if not bdevs:
        return 0
    return int(bdevs[0].get("block_size", 512)) * int(bdevs[0].get("num_blocks", 0))


class MooncakeDistributedNoFRegister:
    """Upstream's ``mooncake.store`` registration of an NVMe-oF SSD (an SPDK target's
    namespace) with the master as a store segment. This build has no NVMe-oF segments:
    both calls log why and answer -1, upstream's failure value, as upstream does when its
    master refuses. Arguments of the wrong type are a TypeError, as there."""

    _WHY = "NVMe-oF SSD segments are not supported by this build"

    def real_register(self, nqn, nsid, traddr, trsvcid, base, size, master_server_addr):
        _endpoint_types(nqn, nsid, traddr, trsvcid, master_server_addr)
        _typed(base, int, "base")
        _typed(size, int, "size")
        logger.error("mooncake: registering SSD %s ns %d at %s:%d: %s", nqn, nsid, traddr,
                     trsvcid, self._WHY)
        return -1

    def real_unregister_by_endpoint(self, nqn, nsid, traddr, trsvcid, master_server_addr):
        _endpoint_types(nqn, nsid, traddr, trsvcid, master_server_addr)
        logger.error("mooncake: unregistering SSD %s ns %d at %s:%d: %s", nqn, nsid, traddr,
                     trsvcid, self._WHY)
        return -1


MooncakeDistributedNoFRegister.__module__ = "mooncake.store"  # exported there


def _typed(value, kind, name):
    if isinstance(value, bool) or not isinstance(value, kind) or \
            (kind is int and value < 0):
        raise TypeError(f"{name}: expected a{'n unsigned' if kind is int else ''} "
                        f"{kind.__name__}, got {value!r}")


def _endpoint_types(nqn, nsid, traddr, trsvcid, master_server_addr):
    for value, kind, name in ((nqn, str, "nqn"), (nsid, int, "nsid"), (traddr, str, "traddr"),
                              (trsvcid, int, "trsvcid"),
                              (master_server_addr, str, "master_server_addr")):
        _typed(value, kind, name)


def for_each_ssd(tool, action, noun, call, skip=lambda error: False):
    """Runs ``call(register, config)`` (0 on success) for each of ``tool.config_list``,
    with a fresh store registration object kept as ``tool.register``, and logs each
    outcome: ``action`` ("register") names the step, ``noun`` ("Registration") a failed
    one. An error ``skip`` accepts counts as done. True when none failed."""
    done, failed, total = action + "ed", 0, len(tool.config_list)
    for i, cfg in enumerate(tool.config_list, 1):
        try:
            tool.register = MooncakeDistributedNoFRegister()
            ret = call(tool.register, cfg)
            if ret != 0:
                raise RuntimeError(f"{noun} failed with code {ret}")
            logger.info("%s SSD %d/%d", done, i, total)
        except Exception as e:  # the store's own errors; report and go on
            if skip(e):
                logger.info("SSD %d/%d already %s, skipped", i, total, done)
            else:
                logger.error("failed to %s SSD %d/%d: %s", action, i, total, e)
                failed += 1
    return failed == 0
