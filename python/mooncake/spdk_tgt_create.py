"""``python -m mooncake.spdk_tgt_create``: turn NVMe SSDs of remote hosts into SPDK
NVMe-oF targets, over SSH (upstream's tool, same flags and defaults):

    python -m mooncake.spdk_tgt_create \\
        --spdk_target_info="ip:192.168.65.56 path:/home/spdk pci:0000:01:00.0,0000:02:00.0" \\
        --spdk_target_info="ip:192.168.65.57 path:/home/spdk" \\
        [--core-mask 0xff] [--transport-type RDMA] [--max-queue-depth 128] ... \\
        [--username root] [--port 22] [--password P | --key-file F]

A target names the host (``ip:``, also the address the target listens on), the SPDK
tree there (``path:``, or a directory holding it as spdk/) and optionally the NVMe
controllers to hand to SPDK (``pci:``, comma- or space-separated). Without ``pci:`` the
host's NVMe controllers already bound to a user-space driver, or with no mounted or
otherwise used block device, are taken.

On each host, in order: SPDK's scripts/setup.sh binds the controllers; a running
nvmf_tgt is stopped and a fresh one started with the core mask; then rpc.py runs
nvmf_create_transport, bdev_nvme_attach_controller (one per controller),
nvmf_create_subsystem (nqn.2016-06.io.spdk:cnode1), nvmf_subsystem_add_ns (one per
namespace) and nvmf_subsystem_add_listener (port 4420). The first failing step ends
that host's set-up; the tool goes on with the next host and exits 1 if any failed.

SSH is that of ``mooncake_ssd_register`` (paramiko when installed, else the ``ssh``
command, which needs key-based log-in). Every value sent to a remote shell is quoted.
"""

import argparse
import ipaddress
import logging
import re
import shlex
import sys

from . import _spdk_nof as nof

__all__ = ["SPDKTgtCreator", "parse_arguments", "main"]

logger = logging.getLogger("mooncake")

SUBSYSTEM_NQN = "nqn.2016-06.io.spdk:cnode1"
SUBSYSTEM_SERIAL = "SPDK00000000000001"
SUBSYSTEM_MAX_NAMESPACES = 12
LISTEN_PORT = 4420

# Drivers under which SPDK (not the kernel) owns a PCI function.
_USERSPACE_DRIVERS = ("vfio-pci", "uio_pci_generic", "igb_uio")
_SETUP_TIMEOUT_S = 300    # setup.sh rebinds drivers and reserves hugepages
_STOP_TIMEOUT_S = 30      # the stop script gives nvmf_tgt 15 s
_START_TIMEOUT_S = 120    # the start script waits up to ~60 s for RPCs
_RPC_TIMEOUT_S = 90
_CHECK_TIMEOUT_S = 30     # the discovery and driver-check scripts

# "[domain:]bus:device.function"; the domain defaults to 0000.
_PCI_RE = re.compile(
    r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_CORE_MASK_RE = re.compile(
    r"^(?:(?:0[xX])?[0-9a-fA-F]+|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])$")
_TRTYPE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_FIELD_RE = re.compile(r"^([A-Za-z_]\w*):(.*)$")

# Prints "use BDF [driver]" or "skip BDF reason" for every NVMe controller (PCI class
# 0x0108) of the host: one SPDK may take is bound to a user-space driver already, or has
# block devices none of which is mounted, swapped on or holds LVM/RAID/crypt volumes.
_DISCOVER_SCRIPT = r"""for dev in /sys/bus/pci/devices/*; do
  class=$(cat "$dev/class" 2>/dev/null) || continue
  case "$class" in 0x0108*) ;; *) continue ;; esac
  bdf=${dev##*/}
  drv=$(readlink "$dev/driver" 2>/dev/null); drv=${drv##*/}
  case "$drv" in
    vfio-pci|uio_pci_generic|igb_uio) echo "use $bdf $drv"; continue ;;
  esac
  disks=0; busy=
  for blk in /sys/block/nvme*; do
    [ -e "$blk" ] || continue
    where=$(readlink -f "$blk/device" 2>/dev/null)
    case "$where/" in */"$bdf"/*) ;; *) continue ;; esac
    disks=$((disks + 1))
    if ! info=$(lsblk -nr -o TYPE,MOUNTPOINT "/dev/${blk##*/}" 2>/dev/null); then
      busy=unreadable
    elif printf '%s\n' "$info" |
        awk '$2 != "" || ($1 != "disk" && $1 != "part") { f = 1 } END { exit !f }'; then
      busy=in_use
    fi
  done
  if [ "$disks" -eq 0 ]; then echo "skip $bdf no_block_device"
  elif [ -n "$busy" ]; then echo "skip $bdf $busy"
  else echo "use $bdf"
  fi
done"""

# Prints "ready BDF driver" or "unready BDF driver|none" for each BDF argument.
_READY_SCRIPT = r"""for bdf in {bdfs}; do
  drv=$(readlink "/sys/bus/pci/devices/$bdf/driver" 2>/dev/null); drv=${{drv##*/}}
  case "$drv" in
    vfio-pci|uio_pci_generic|igb_uio) echo "ready $bdf $drv" ;;
    *) echo "unready $bdf ${{drv:-none}}" ;;
  esac
done"""

# Stops every nvmf_tgt of the host; prints "idle" or "stopped".
_STOP_SCRIPT = r"""pgrep -x nvmf_tgt > /dev/null || { echo idle; exit 0; }
pkill -x nvmf_tgt
i=0
while [ "$i" -lt 150 ]; do
  pgrep -x nvmf_tgt > /dev/null || { echo stopped; exit 0; }
  sleep 0.1; i=$((i + 1))
done
echo "nvmf_tgt still runs 15 s after SIGTERM"; exit 1"""

# Starts nvmf_tgt in the background (log: tgt.log of the SPDK tree) and waits until it
# answers RPCs; on failure prints the end of its log.
_START_SCRIPT = r"""cd {root} || exit 1
[ -x build/bin/nvmf_tgt ] || {{ echo "no build/bin/nvmf_tgt in $(pwd) (is SPDK built?)"; exit 1; }}
nohup ./build/bin/nvmf_tgt -m {mask} > tgt.log 2>&1 < /dev/null &
pid=$!
i=0
while [ "$i" -lt 120 ]; do
  ./scripts/rpc.py -t 1 spdk_get_version > /dev/null 2>&1 && exit 0
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "nvmf_tgt exited; end of tgt.log:"; tail -n 20 tgt.log; exit 1
  fi
  sleep 0.2; i=$((i + 1))
done
echo "nvmf_tgt does not answer RPCs; end of tgt.log:"; tail -n 20 tgt.log; exit 1"""


def _normalize_pci(text):
    """"DDDD:BB:DD.F" (lower case) for a PCI address with or without its domain;
    ValueError for anything else."""
    m = _PCI_RE.match(text)
    if not m:
        raise ValueError(f"malformed PCI address {text!r} (expected e.g. 0000:01:00.0)")
    domain, bus, device, function = m.groups()
    return f"{domain or '0000'}:{bus}:{device}.{function}".lower()


def _check_ip(text):
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"ip:{text} is not an IP address (the target listens on it)") \
            from None
    return text


def _target_config(ip, path, pci_devices):
    """The checked target dict ({"ip", "path", "pci_devices"}) deploy_target takes."""
    if not ip:
        raise ValueError("needs an ip: field")
    if not path:
        raise ValueError("needs a path: field")
    pcis = []
    for pci in pci_devices:
        pci = _normalize_pci(pci)
        if pci not in pcis:
            pcis.append(pci)
    return {"ip": _check_ip(ip), "path": path, "pci_devices": pcis}


def _parse_target(text):
    """{"ip", "path", "pci_devices"} from "ip:A path:P [pci:X,Y ...]". A word without a
    field name continues the field before it: another PCI address, or the rest of a path
    with spaces."""
    fields = {"ip": None, "path": None}
    pcis, current = [], None
    for word in text.split():
        m = _FIELD_RE.match(word)
        if current == "pci" and _PCI_RE.match(word.split(",")[0]):
            m = None  # "abcd:01:00.0" is an address, not a field "abcd"
        if m:
            key, value = m.groups()
            if key == "pci":
                pcis.extend(p for p in value.split(",") if p)
            elif key in fields:
                if fields[key] is not None:
                    raise ValueError(f"{key}: given twice")
                fields[key] = value
            else:
                raise ValueError(f"unknown field {key!r} (expected ip:, path: and pci:)")
            current = key
        elif current == "pci":
            pcis.extend(p for p in word.split(",") if p)
        elif current == "path":
            fields["path"] += " " + word
        else:
            raise ValueError(f"unexpected {word!r} (expected ip:, path: and pci:)")
    return _target_config(fields["ip"], fields["path"], pcis)


def _checked_core_mask(text):
    text = str(text)
    if not _CORE_MASK_RE.match(text) or re.fullmatch(r"(0[xX])?0+", text):
        raise ValueError(f"malformed core mask {text!r} (expected e.g. 0xff or [0-3,8])")
    return text


class SPDKTgtCreator:
    """Sets up an SPDK NVMe-oF target on each host of ``spdk_targets`` ("ip:... path:...
    [pci:...]" strings). ``transport_options`` override DEFAULT_TRANSPORT_OPTIONS; the
    keyword arguments are the SSH log-in (upstream's tool takes them as flags but logs in
    as root without them). ValueError (or RuntimeError) for a malformed argument."""

    DEFAULT_TRANSPORT_OPTIONS = {
        "trtype": "RDMA",
        "max_queue_depth": 128,
        "max_io_qpairs_per_ctrlr": 127,
        "max_io_size": 4096,
        "in_capsule_data_size": 131072,
        "io_unit_size": 131072,
        "max_aq_depth": 128,
        "num_shared_buffers": 4096,
        "buf_cache_size": 32,
    }

    # The rpc.py nvmf_create_transport flag of each option, in the order they are passed.
    TRANSPORT_RPC_FLAGS = {
        "trtype": "-t",
        "max_queue_depth": "-q",
        "max_io_qpairs_per_ctrlr": "-m",
        "max_io_size": "-c",
        "in_capsule_data_size": "-i",
        "io_unit_size": "-u",
        "max_aq_depth": "-a",
        "num_shared_buffers": "-n",
        "buf_cache_size": "-b",
    }

    def __init__(self, spdk_targets, transport_options=None, core_mask="0xff", port=22, *,
                 username="root", password=None, key_file=None):
        if isinstance(spdk_targets, str):
            spdk_targets = [spdk_targets]
        self.spdk_targets = list(spdk_targets or [])
        if not self.spdk_targets:
            raise ValueError("no SPDK target given (--spdk_target_info)")
        self.core_mask = _checked_core_mask(core_mask)
        self.port = self._checked_port(port)
        self.transport_options = self._checked_transport_options(transport_options)
        self.logger = logger
        self.shell = nof.SpdkShell({"username": username, "port": self.port,
                                    "password": password, "key_file": key_file})
        self.shell.check_password_support()
        self._sudo = "" if username == "root" else "sudo -n "
        self.target_configs = []
        for text in self.spdk_targets:
            try:
                config = _parse_target(text)
            except ValueError as e:
                raise ValueError(f"spdk_target_info {text!r}: {e}") from None
            self.target_configs.append(config)
            self.logger.info("target %s: SPDK in %s, PCI devices %s", config["ip"],
                             config["path"],
                             ", ".join(config["pci_devices"]) or "to be discovered")

    @staticmethod
    def _checked_port(port):
        try:
            value = None if isinstance(port, (bool, float)) else int(port)
        except (TypeError, ValueError):
            value = None
        if value is None or not 0 < value < 65536:
            raise ValueError(f"SSH port {port!r} is not a port number (1-65535)")
        return value

    def _checked_transport_options(self, overrides):
        options = dict(self.DEFAULT_TRANSPORT_OPTIONS)
        for key, value in (overrides or {}).items():
            if key not in options:
                raise ValueError(f"unknown transport option {key!r} (known: "
                                 f"{', '.join(options)})")
            if key == "trtype":
                if not isinstance(value, str) or not _TRTYPE_RE.match(value):
                    raise ValueError(f"malformed transport type {value!r} (e.g. RDMA, TCP)")
            else:
                try:
                    number = int(value)
                except (TypeError, ValueError):
                    number = None
                if number is None or isinstance(value, (bool, float)) or number <= 0:
                    raise ValueError(f"transport option {key} must be a positive integer, "
                                     f"not {value!r}")
                value = number
            options[key] = value
        return options

    # ------------------------------------------------------------ remote steps

    def _run(self, ip, command, timeout, what):
        return self.shell.run(ip, command, timeout, what=what)

    def _rpc(self, ip, root, *args):
        """rpc.py ARGS in the SPDK tree ``root``; its output."""
        quoted = " ".join(shlex.quote(str(a)) for a in args)
        return self._run(ip, nof.rpc_command(root, quoted), _RPC_TIMEOUT_S,
                         f"rpc.py {' '.join(str(a) for a in args)}")

    def _discover(self, ip):
        self.logger.info("%s: no pci: given, looking for NVMe controllers SPDK may take", ip)
        out = self._run(ip, _DISCOVER_SCRIPT, _CHECK_TIMEOUT_S,
                        "NVMe controller discovery")
        found = []
        for line in out.splitlines():
            words = line.split()
            if len(words) < 2 or not _PCI_RE.match(words[1]):
                continue
            if words[0] == "use":
                found.append(_normalize_pci(words[1]))
            elif words[0] == "skip":
                self.logger.warning("%s: leaving NVMe controller %s alone (%s)", ip, words[1],
                                    " ".join(words[2:]) or "not eligible")
        if not found:
            raise RuntimeError(f"{ip}: no NVMe controller that is bound to a user-space "
                               f"driver or has no mounted or used block device")
        self.logger.info("%s: discovered %s", ip, ", ".join(found))
        return found

    def _setup(self, ip, root, pcis):
        allowed = shlex.quote(" ".join(pcis))
        self.logger.info("%s: binding %s to SPDK (scripts/setup.sh)", ip, ", ".join(pcis))
        self._run(ip, f"cd {nof.remote_path(root)} && {self._sudo}env PCI_ALLOWED={allowed} "
                      f"./scripts/setup.sh", _SETUP_TIMEOUT_S, "scripts/setup.sh")

    def _ready(self, ip, pcis, strict):
        """Those of ``pcis`` bound to a user-space driver. Any other is an error when
        ``strict`` (the user named them), else skipped with a warning."""
        script = _READY_SCRIPT.format(bdfs=" ".join(shlex.quote(p) for p in pcis))
        out = self._run(ip, script, _CHECK_TIMEOUT_S, "driver check")
        ready, unready = [], []
        for line in out.splitlines():
            words = line.split()
            if len(words) != 3 or words[1] not in pcis:
                continue
            if words[0] == "ready":
                ready.append(words[1])
            elif words[0] == "unready":
                unready.append(f"{words[1]} (driver {words[2]})")
        if unready:
            message = (f"{ip}: not bound to a user-space driver after setup.sh: "
                       f"{', '.join(unready)}")
            if strict:
                raise RuntimeError(message + "; is it mounted or in use?")
            self.logger.warning("%s; skipping", message)
        if not ready:
            raise RuntimeError(f"{ip}: no PCI device is available to SPDK after setup.sh")
        return ready

    def _restart_tgt(self, ip, root):
        out = self._run(ip, _STOP_SCRIPT, _STOP_TIMEOUT_S, "stopping nvmf_tgt")
        if out.strip() == "stopped":
            self.logger.info("%s: stopped the nvmf_tgt that was running", ip)
        self.logger.info("%s: starting nvmf_tgt with core mask %s", ip, self.core_mask)
        script = _START_SCRIPT.format(root=nof.remote_path(root),
                                      mask=shlex.quote(self.core_mask))
        self._run(ip, script, _START_TIMEOUT_S, "starting nvmf_tgt")

    def _create_transport(self, ip, root):
        args = []
        for option, flag in self.TRANSPORT_RPC_FLAGS.items():
            args += [flag, self.transport_options[option]]
        self.logger.info("%s: creating the %s transport", ip, self.transport_options["trtype"])
        self._rpc(ip, root, "nvmf_create_transport", *args)

    def _attach(self, ip, root, pcis):
        """The bdev of each namespace of each controller (NvmeIn1, ...)."""
        bdevs = []
        for i, pci in enumerate(pcis):
            name = f"Nvme{i}"
            out = self._rpc(ip, root, "bdev_nvme_attach_controller", "-b", name, "-t", "PCIe",
                            "-a", pci)
            # rpc.py prints the namespaces' bdevs; if it does not, the first is NvmeIn1
            names = [w for w in out.split() if re.fullmatch(rf"{name}n\d+", w)]
            bdevs += names or [f"{name}n1"]
            self.logger.info("%s: %s attached as %s", ip, pci, ", ".join(names or bdevs[-1:]))
        return bdevs

    def _export(self, ip, root, bdevs):
        trtype = self.transport_options["trtype"]
        self._rpc(ip, root, "nvmf_create_subsystem", SUBSYSTEM_NQN, "-a", "-s",
                  SUBSYSTEM_SERIAL, "-m", max(SUBSYSTEM_MAX_NAMESPACES, len(bdevs)))
        for bdev in bdevs:
            self._rpc(ip, root, "nvmf_subsystem_add_ns", SUBSYSTEM_NQN, bdev)
        family = ["-f", "ipv6"] if ipaddress.ip_address(ip).version == 6 else []
        self.logger.info("%s: listening for %s on port %d", ip, trtype, LISTEN_PORT)
        self._rpc(ip, root, "nvmf_subsystem_add_listener", SUBSYSTEM_NQN, "-t", trtype,
                  "-a", ip, "-s", LISTEN_PORT, *family)

    # ------------------------------------------------------------ public

    def deploy_target(self, target_config):
        """Sets up the target of one ``target_config`` ({"ip", "path", "pci_devices"},
        as in ``target_configs``); True when every step succeeded. A failure is logged."""
        try:
            config = _target_config(target_config.get("ip"), target_config.get("path"),
                                    target_config.get("pci_devices") or [])
        except ValueError as e:
            self.logger.error("invalid target %r: %s", target_config, e)
            return False
        ip, path, pcis = config["ip"], config["path"], config["pci_devices"]
        self.logger.info("%s: deploying an SPDK target", ip)
        try:
            root = self.shell.spdk_root(ip, path)
            chosen = pcis or self._discover(ip)
            self._setup(ip, root, chosen)
            chosen = self._ready(ip, chosen, strict=bool(pcis))
            self._restart_tgt(ip, root)
            self._create_transport(ip, root)
            bdevs = self._attach(ip, root, chosen)
            self._export(ip, root, bdevs)
        except (RuntimeError, OSError, ValueError) as e:
            self.logger.error("failed to deploy the SPDK target on %s: %s", ip, e)
            return False
        self.logger.info("%s: SPDK target %s serves %s on port %d", ip, SUBSYSTEM_NQN,
                         ", ".join(bdevs), LISTEN_PORT)
        return True

    def deploy_all_targets(self):
        """Deploys every target in turn (one failing does not stop the others); True
        when all succeeded."""
        total = len(self.target_configs)
        ok = 0
        for i, config in enumerate(self.target_configs, 1):
            self.logger.info("target %d/%d: %s", i, total, config["ip"])
            ok += self.deploy_target(config)
        self.logger.log(logging.INFO if ok == total else logging.ERROR,
                        "deployed %d of %d SPDK target(s), %d failed", ok, total, total - ok)
        return ok == total


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not positive")
    return value


def _port_number(text):
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return value


def _core_mask_arg(text):
    try:
        return _checked_core_mask(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _trtype_arg(text):
    if not _TRTYPE_RE.match(text):
        raise argparse.ArgumentTypeError(f"malformed transport type {text!r}")
    return text


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(
        description="Set up SPDK NVMe-oF targets on remote hosts over SSH")
    parser.add_argument("--spdk_target_info", action="append", required=True,
                        help='a host, e.g. "ip:192.168.65.56 path:/home/spdk '
                             'pci:0000:01:00.0,0000:02:00.0" (repeat for more hosts); '
                             "without pci: free NVMe controllers are found")
    parser.add_argument("--core-mask", type=_core_mask_arg, default="0xff",
                        help="nvmf_tgt's -m core mask (0xff)")
    parser.add_argument("--transport-type", type=_trtype_arg, default="RDMA",
                        help="NVMe-oF transport, e.g. RDMA or TCP (RDMA)")
    for flag, default, what in (
            ("--max-queue-depth", 128, "queue depth limit per queue"),
            ("--max-io-qpairs-per-ctrlr", 127, "I/O queue pairs per controller"),
            ("--max-io-size", 4096, "largest I/O in bytes"),
            ("--in-capsule-data-size", 131072, "in-capsule data limit in bytes"),
            ("--io-unit-size", 131072, "I/O unit in bytes"),
            ("--max-aq-depth", 128, "admin queue depth"),
            ("--num-shared-buffers", 4096, "data buffers pooled by the transport"),
            ("--buf-cache-size", 32, "buffers cached per poll group")):
        parser.add_argument(flag, type=_positive_int, default=default,
                            help=f"transport: {what} ({default})")
    parser.add_argument("--username", default="root", help="SSH user (root)")
    parser.add_argument("--port", type=_port_number, default=22, help="SSH port (22)")
    parser.add_argument("--password", help="SSH password (needs paramiko)")
    parser.add_argument("--key-file", help="SSH private key file")
    return parser.parse_args(argv)


def main(argv=None):
    """Exit status: 0 when every target was set up, 1 otherwise (2: bad flags)."""
    args = parse_arguments(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    transport_options = {option: getattr(args, "transport_type" if option == "trtype"
                                         else option)
                         for option in SPDKTgtCreator.DEFAULT_TRANSPORT_OPTIONS}
    try:
        creator = SPDKTgtCreator(args.spdk_target_info, transport_options, args.core_mask,
                                 args.port, username=args.username, password=args.password,
                                 key_file=args.key_file)
    except (ValueError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    return 0 if creator.deploy_all_targets() else 1


if __name__ == "__main__":
    sys.exit(main())
