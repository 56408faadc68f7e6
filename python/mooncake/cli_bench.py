"""``transfer_engine_bench``: upstream's transfer benchmark command, on this package's
``mooncake`` binary.

It takes upstream's gflags (``--flag=value``, ``--flag value``, one or two dashes,
``--noflag`` for a false boolean) and runs:

  --mode=target      ``mooncake target`` serving a ``--buffer_size`` buffer under
                     ``--local_server_name`` on ``--metadata_server``;
  --mode=initiator   ``mooncake bench transfer`` reading or writing (``--operation``)
                     ``--block_size`` blocks, ``--batch_size`` per batch, from
                     ``--threads`` threads for ``--duration`` seconds against the target
                     ``--segment_id`` (its JSON result lines replace upstream's report).

Flags of upstream's without a counterpart here (device_name, auto_discovery,
nic_priority_matrix, report_unit, report_precision, backend, gpu_id, use_vram) are
accepted and noted on stderr. Metadata servers are upstream's forms: P2PHANDSHAKE,
http://..., etcd://... or a bare etcd host:port.
"""

import sys

from . import cli
from ._common import metadata_connection

__all__ = ["main", "parse_flags", "command_for"]

# name: (kind, default). Upstream's defaults, except where noted.
FLAGS = {
    "mode": (str, "initiator"),
    "metadata_server": (str, "P2PHANDSHAKE"),  # upstream: a lab etcd address
    "local_server_name": (str, ""),  # upstream: "vm"; empty: the target picks its address
    "segment_id": (str, ""),
    "protocol": (str, "tcp"),  # upstream: rdma
    "operation": (str, "read"),
    "batch_size": (int, 128),
    "block_size": (int, 65536),
    "buffer_size": (int, 1 << 30),
    "duration": (int, 10),
    "threads": (int, 12),
    "device_name": (str, ""),
    "nic_priority_matrix": (str, ""),
    "report_unit": (str, "GB"),
    "report_precision": (int, 2),
    "backend": (str, "classic"),
    "gpu_id": (int, 0),
    "auto_discovery": (bool, False),
    "use_vram": (bool, False),
}
_WITHOUT_COUNTERPART = ("device_name", "nic_priority_matrix", "report_unit",
                        "report_precision", "backend", "gpu_id", "auto_discovery", "use_vram")
_TRUE = ("1", "true", "yes", "y", "t")
_FALSE = ("0", "false", "no", "n", "f")


class FlagError(ValueError):
    pass


def _convert(name, kind, text):
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise FlagError(f"--{name}: expected true or false, got {text!r}")
    if kind is int:
        try:
            return int(text, 0)
        except ValueError:
            raise FlagError(f"--{name}: expected an integer, got {text!r}") from None
    return text


def parse_flags(argv):
    """({flag: value} with defaults filled in, [names given explicitly]); FlagError for
    an unknown flag or a bad value."""
    values = {name: default for name, (_, default) in FLAGS.items()}
    given = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            raise FlagError(f"unexpected argument {arg!r}")
        name, eq, text = arg.lstrip("-").partition("=")
        negated = name.startswith("no") and name[2:] in FLAGS and FLAGS[name[2:]][0] is bool
        if negated:
            name, text, eq = name[2:], "false", "="
        if name not in FLAGS:
            raise FlagError(f"unknown flag --{name}")
        kind = FLAGS[name][0]
        if not eq:
            if kind is bool:
                text = "true"
            elif i < len(args):
                text = args[i]
                i += 1
            else:
                raise FlagError(f"--{name} needs a value")
        values[name] = _convert(name, kind, text)
        given.append(name)
    return values, given


def command_for(values):
    """The ``mooncake`` arguments for parsed flags; FlagError when they cannot run."""
    metadata = metadata_connection(values["metadata_server"])
    if metadata is None:
        raise FlagError(f"--metadata_server {values['metadata_server']!r} is not supported")
    protocol = ["--protocol", values["protocol"]]
    if values["mode"] == "target":
        cmd = ["target", "--size", str(values["buffer_size"]), "--metadata", metadata, *protocol]
        if values["local_server_name"]:
            cmd += ["--name", values["local_server_name"]]
        return cmd
    if values["mode"] == "initiator":
        if not values["segment_id"]:
            raise FlagError("--mode=initiator needs --segment_id (the target's segment name)")
        if values["operation"] not in ("read", "write"):
            raise FlagError(f"--operation: read or write, got {values['operation']!r}")
        return ["bench", "transfer", *protocol, "--op", values["operation"],
                "--block-size", str(values["block_size"]),
                "--batch-size", str(values["batch_size"]),
                "--threads", str(values["threads"]), "--duration", str(values["duration"]),
                "--segment", values["segment_id"], "--metadata", metadata]
    raise FlagError(f"--mode: initiator or target, got {values['mode']!r}")


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a.lstrip("-") in ("h", "help", "helpfull") for a in args):
        print(__doc__)
        return 0
    try:
        values, given = parse_flags(args)
        cmd = command_for(values)
    except FlagError as e:
        print(f"transfer_engine_bench: {e}", file=sys.stderr)
        return 2
    ignored = [name for name in given if name in _WITHOUT_COUNTERPART]
    if ignored:
        print("transfer_engine_bench: no counterpart here, ignored: "
              + ", ".join(f"--{n}" for n in ignored), file=sys.stderr)
    cli._exec(cmd)


if __name__ == "__main__":
    sys.exit(main())
