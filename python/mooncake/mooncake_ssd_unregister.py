"""``python -m mooncake.mooncake_ssd_unregister``: withdraw SSD segments registered with
``mooncake_ssd_register`` from a Mooncake master (upstream's tool, same flags):

    python -m mooncake.mooncake_ssd_unregister --master_server_address=H:50051 \\
        --spdk_target_info="ip:192.168.65.56 ns:1 nqn:nqn.2016-06.io.spdk:cnode1"

A target names one namespace (``ns:``), or ``path:`` to ask the SPDK target for all of
its namespaces (over SSH), or neither: namespace 1. ``nqn:`` defaults to
nqn.2016-06.io.spdk:cnode1 and ``port:`` (the NVMe-oF service) to 4420. Unregistering
needs the store's NVMe-oF support, which this build lacks: the tool then reports that and
exits 1.
"""

import argparse
import logging
import sys

from . import _spdk_nof as nof

__all__ = ["MooncakeNoFUnregister", "parse_arguments", "main"]

logger = logging.getLogger("mooncake")

DEFAULT_NQN = "nqn.2016-06.io.spdk:cnode1"
DEFAULT_TRSVCID = 4420
DEFAULT_TARGET = f"ip:192.168.65.56 ns:1 nqn:{DEFAULT_NQN}"  # upstream's default


class MooncakeNoFUnregister:
    def __init__(self, cli_config=None, spdk_targets=None):
        self.cli_config = dict(cli_config or {})
        self.spdk_targets = list(spdk_targets or [])
        self.register = None
        master = nof.master_of(self.cli_config, self.spdk_targets)
        configs = []
        for text in self.spdk_targets:
            configs.extend(self._target_ssds(nof.parse_target_info(text), master))
        if not configs:
            raise RuntimeError("No SSD configuration generated from target info")
        self.config_list = nof.settle(configs, self.cli_config)
        logger.info("loaded %d SSD configuration(s) to unregister", len(self.config_list))

    def _target_ssds(self, target, master):
        if "ip" not in target:
            raise ValueError("spdk_target_info must contain 'ip' field")
        ip = target["ip"]
        nqn = target.get("nqn", DEFAULT_NQN)
        trsvcid = int(target.get("port", DEFAULT_TRSVCID))
        if "ns" in target:
            return [nof.ssd_config(nqn, int(target["ns"]), ip, trsvcid, 0, master)]
        if "path" in target:
            try:
                found = nof.nvme_namespaces(nof.SpdkShell(self.cli_config), ip, target["path"])
                # A target-given nqn applies unless the user named one.
                return [nof.ssd_config(nqn if "nqn" in target else sub_nqn, nsid, traddr,
                                       port, 0, master)
                        for sub_nqn, traddr, port, nsid, _ in found]
            except (RuntimeError, OSError, ValueError) as e:
                logger.error("failed to get namespace info from %s: %s; unregistering "
                             "namespace 1", ip, e)
        else:
            logger.warning("no path: in %r; unregistering namespace 1 only", target)
        return [nof.ssd_config(nqn, 1, ip, trsvcid, 0, master)]

    def start_ssd_unregister_service(self):
        """Unregisters every SSD; True when all succeeded."""
        return nof.for_each_ssd(
            self, "unregister", "Unregistration",
            lambda register, cfg: register.real_unregister_by_endpoint(
                cfg["nqn"], cfg["nsid"], cfg["traddr"], cfg["trsvcid"],
                cfg["master_server_address"]))


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description="Unregister SSDs from a Mooncake master")
    parser.add_argument("--master_server_address", default="192.168.65.81:50051",
                        help="master address (upstream's default: 192.168.65.81:50051)")
    parser.add_argument("--spdk_target_info", action="append", default=None,
                        help='a target, e.g. "ip:192.168.65.56 ns:1 nqn:..." or '
                             '"ip:192.168.65.56 path:/home/spdk"')
    nof.add_shared_arguments(parser)
    args = parser.parse_args(argv)
    if args.spdk_target_info is None:
        args.spdk_target_info = [DEFAULT_TARGET]
    return args


def main(argv=None):
    return nof.run_tool(MooncakeNoFUnregister, parse_arguments(argv),
                        MooncakeNoFUnregister.start_ssd_unregister_service)


if __name__ == "__main__":
    sys.exit(main())
