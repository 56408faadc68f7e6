"""What ``mooncake_ssd_register`` and ``mooncake_ssd_unregister`` share: SPDK target
descriptions, asking a target (over SSH, its ``scripts/rpc.py``) which NVMe namespaces
it exports, and the store's NVMe-oF registration class.

SSH goes through paramiko when it is installed (password or key file), else the ``ssh``
command (key-based, non-interactive). The registration itself needs
``mooncake.store.MooncakeDistributedNoFRegister``, which this build's store does not
provide: :func:`nof_register_class` says so with a RuntimeError.
"""

import json
import logging
import re
import shlex
import shutil
import subprocess

logger = logging.getLogger("mooncake")

_SSH_CONNECT_TIMEOUT_S = 10
_SSH_COMMAND_TIMEOUT_S = 30
_RPC_SCRIPT = "scripts/rpc.py"


def parse_target_info(text):
    """{"ip": ..., "path": ..., "ns": ..., ...} from "ip:1.2.3.4 path:/home/spdk"."""
    return dict(re.findall(r"(\w+):(\S+)", text))


def parse_defines(items):
    """{key: value} from -Dkey=value items; items without '=' are logged and skipped."""
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if eq and key:
            out[key] = value
        else:
            logger.warning("ignoring -D%s (expected key=value)", item)
    return out


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


class SpdkShell:
    """Runs SPDK's rpc.py on targets over SSH with the CLI's user/port/password/key."""

    def __init__(self, cli_config):
        self._user = cli_config.get("username", "root")
        self._port = int(cli_config.get("port", 22))
        self._password = cli_config.get("password")
        self._key_file = cli_config.get("key_file")

    def rpc(self, ip, spdk_path, rpc_args):
        """The JSON answer of ``scripts/rpc.py RPC_ARGS`` in ``spdk_path`` (or its spdk/
        subdirectory) on ``ip``."""
        for root in (spdk_path, f"{spdk_path.rstrip('/')}/spdk"):
            quoted = shlex.quote(root)
            rc, _ = self._run(ip, f"cd {quoted} && test -f {_RPC_SCRIPT}", 5)
            if rc == 0:
                rc, out = self._run(ip, f"cd {quoted} && ./{_RPC_SCRIPT} {rpc_args}",
                                    _SSH_COMMAND_TIMEOUT_S)
                if rc != 0:
                    raise RuntimeError(f"{ip}: rpc.py {rpc_args} failed: {out.strip()}")
                return json.loads(out)
        raise RuntimeError(f"{ip}: no {_RPC_SCRIPT} under {spdk_path} or {spdk_path}/spdk")

    def _run(self, ip, command, timeout):
        try:
            import paramiko
        except ImportError:
            return self._run_ssh_command(ip, command, timeout)
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect(ip, port=self._port, username=self._user, password=self._password,
                           key_filename=self._key_file, timeout=_SSH_CONNECT_TIMEOUT_S)
            _, stdout, stderr = client.exec_command(command, timeout=timeout)
            rc = stdout.channel.recv_exit_status()
            return rc, stdout.read().decode() or stderr.read().decode()
        finally:
            client.close()

    def _run_ssh_command(self, ip, command, timeout):
        if self._password:
            raise RuntimeError("SSH with a password needs paramiko (pip install paramiko); "
                               "or use --key-file")
        ssh = shutil.which("ssh")
        if ssh is None:
            raise RuntimeError("no ssh command found (and paramiko is not installed)")
        cmd = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={_SSH_CONNECT_TIMEOUT_S}",
               "-p", str(self._port), "-l", self._user]
        if self._key_file:
            cmd += ["-i", self._key_file]
        done = subprocess.run(cmd + [ip, command], capture_output=True, text=True,
                              timeout=timeout + _SSH_CONNECT_TIMEOUT_S)
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


def nof_register_class():
    """The store's NVMe-oF registration class; RuntimeError where the build has none."""
    from . import store

    cls = getattr(store, "MooncakeDistributedNoFRegister", None)
    if cls is None:
        raise RuntimeError("NVMe-oF SSD segments are not supported by this build (its "
                           "mooncake.store has no MooncakeDistributedNoFRegister)")
    return cls
