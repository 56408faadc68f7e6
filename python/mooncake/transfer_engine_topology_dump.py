"""``transfer_engine_topology_dump``: print this machine's NIC priority matrix as the
Transfer Engine sees it (``TransferEngine.get_local_topology``).

    transfer_engine_topology_dump [--device-name mlx5_0,mlx5_1]
        [--backend auto|te|tent] [--use-custom-topo | --custom-topo-json PATH]

By default the matrix is discovered. ``--custom-topo-json PATH`` (or
``--use-custom-topo`` with ``MC_CUSTOM_TOPO_JSON`` set) prints the custom matrix that
file gives instead (this engine does not read custom topologies itself, so the file is
loaded and checked here). ``--backend tent`` uses the ``tent`` module where installed,
else the classic engine (upstream's fallback); ``auto`` follows MC_USE_TENT/MC_USE_TEV1.
Under ``tent`` a topology override inside ``MC_TENT_CONF`` (a JSON file or inline JSON
whose ``topology`` holds ``priority_matrix`` or ``custom_json_path``) counts as a custom
topology for ``--use-custom-topo``, and is left out, through a temporary copy of the
configuration, for discovery. The output line is upstream's:
``Local topology [<backend>/<mode>]: <json>``.
"""

import argparse
import json
import os
import sys
import tempfile

__all__ = ["main", "parse_args", "resolve_backend", "apply_backend",
           "sanitize_tent_conf_for_discover", "dump_te_topology", "dump_tent_topology",
           "load_custom_topology"]

# Keys of a TENT configuration's "topology" that override discovery.
_TENT_OVERRIDES = ("priority_matrix", "custom_json_path")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="transfer_engine_topology_dump",
        description="Dump the Transfer Engine's NIC priority matrix (discovered, or from a "
                    "custom topology file).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device-name", default="",
                        help="only these IB devices (comma-separated)")
    parser.add_argument("--backend", choices=("auto", "te", "tent"), default="auto",
                        help="te: classic Transfer Engine; tent: the tent module; auto: "
                             "MC_USE_TENT/MC_USE_TEV1 decide")
    parser.add_argument("--use-custom-topo", action="store_true",
                        help="print the custom matrix named by MC_CUSTOM_TOPO_JSON")
    parser.add_argument("--custom-topo-json", default=None,
                        help="print the custom matrix in this JSON file")
    return parser.parse_args(argv)


def resolve_backend(backend):
    if backend == "auto":
        return "tent" if os.environ.get("MC_USE_TENT") or os.environ.get("MC_USE_TEV1") else "te"
    return backend


def apply_backend(backend):
    """Selects ``backend`` for engines created from here on: TENT through MC_USE_TENT
    (kept if already set), the classic engine by clearing both TENT switches."""
    if backend == "tent":
        os.environ.setdefault("MC_USE_TENT", "1")
    else:
        os.environ.pop("MC_USE_TENT", None)
        os.environ.pop("MC_USE_TEV1", None)


def _tent_conf():
    """MC_TENT_CONF's JSON (a file path or the JSON itself), or None when unset or not
    JSON."""
    conf = os.environ.get("MC_TENT_CONF", "")
    if not conf:
        return None
    try:
        if os.path.isfile(conf):
            with open(conf, encoding="utf-8") as f:
                return json.load(f)
        return json.loads(conf)
    except (OSError, ValueError):
        return None


def _tent_topology_override(conf):
    topology = conf.get("topology") if isinstance(conf, dict) else None
    if isinstance(topology, dict) and any(k in topology for k in _TENT_OVERRIDES):
        return topology
    return None


def sanitize_tent_conf_for_discover():
    """Points MC_TENT_CONF at a temporary copy of the configuration without its topology
    override, so TENT discovers the topology; returns that file's path (the caller
    removes it), or None when there was nothing to take out."""
    conf = _tent_conf()
    topology = _tent_topology_override(conf)
    if topology is None:
        return None
    stripped = dict(conf, topology={k: v for k, v in topology.items()
                                    if k not in _TENT_OVERRIDES})
    fd, path = tempfile.mkstemp(prefix="tent-topo-dump-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(stripped, f)
    os.environ["MC_TENT_CONF"] = path
    return path


def dump_te_topology(device_name):
    from .engine import TransferEngine

    return TransferEngine().get_local_topology(device_name=device_name or None)


def dump_tent_topology(device_name):
    try:
        import tent
    except ImportError:
        return dump_te_topology(device_name)
    if device_name:
        os.environ["MC_TE_FILTERS"] = device_name
    engine = tent.TransferEngine()
    if not engine.available():
        raise RuntimeError("tent.TransferEngine is not available")
    return engine.get_local_topology()


def load_custom_topology(path):
    """The custom matrix in ``path`` as compact JSON; ValueError if it is not a JSON
    object of device -> [[preferred NICs], [other NICs]]."""
    with open(path, encoding="utf-8") as f:
        matrix = json.load(f)
    if not isinstance(matrix, dict):
        raise ValueError(f"{path}: expected a JSON object of device -> NIC lists")
    for device, lists in matrix.items():
        if not isinstance(lists, list) or not all(
                isinstance(nics, list) and all(isinstance(n, str) for n in nics)
                for nics in lists):
            raise ValueError(f"{path}: {device!r}: expected [[preferred NICs], [others]]")
    return json.dumps(matrix)


def main(argv=None):
    args = parse_args(argv)
    backend = resolve_backend(args.backend)
    apply_backend(backend)
    custom, tent_custom, scratch = args.custom_topo_json, False, None
    if custom is None and args.use_custom_topo:
        custom = os.environ.get("MC_CUSTOM_TOPO_JSON", "") or None
        tent_custom = custom is None and backend == "tent" and \
            _tent_topology_override(_tent_conf()) is not None
        if custom is None and not tent_custom:
            print("error: --use-custom-topo requires MC_CUSTOM_TOPO_JSON or TENT "
                  "topology/priority_matrix|custom_json_path in MC_TENT_CONF", file=sys.stderr)
            return 1
    try:
        if custom is not None:
            mode, topology = f"custom ({custom})", load_custom_topology(custom)
        elif tent_custom:
            mode, topology = "custom (MC_TENT_CONF topology)", dump_tent_topology(
                args.device_name)
        elif backend == "tent":
            scratch = sanitize_tent_conf_for_discover()
            mode, topology = "discover", dump_tent_topology(args.device_name)
        else:
            mode, topology = "discover", dump_te_topology(args.device_name)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: failed to dump topology: {exc}", file=sys.stderr)
        return 1
    finally:
        if scratch:
            try:
                os.unlink(scratch)
            except OSError:
                pass
    print(f"Local topology [{backend}/{mode}]: {topology}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
