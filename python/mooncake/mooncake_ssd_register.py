"""``python -m mooncake.mooncake_ssd_register``: register the NVMe namespaces that remote
SPDK targets export as SSD segments of a Mooncake master (upstream's tool, same flags):

    python -m mooncake.mooncake_ssd_register --master_server_address=H:50051 \\
        --spdk_target_info="ip:192.168.65.56 path:/home/spdk" [--spdk_target_info=...] \\
        [--username root] [--port 22] [--password P | --key-file F] [-Dtrsvcid=4420]

Each target is asked (over SSH, SPDK's scripts/rpc.py) for its subsystems, namespaces
and their sizes; -D overrides apply to every SSD found. Registering needs the store's
NVMe-oF support, which this build lacks: the tool then reports that and exits 1.
"""

import argparse
import logging
import sys

from . import _spdk_nof as nof

__all__ = ["MooncakeNoFRegister", "parse_arguments", "main"]

logger = logging.getLogger("mooncake")


def _already_registered(error):
    return "SEGMENT_ALREADY_EXISTS" in str(error) or "segment already exists" in str(error)


class MooncakeNoFRegister:
    """The SSDs of ``spdk_targets`` ("ip:... path:..." strings), ready to register."""

    def __init__(self, cli_config=None, spdk_targets=None):
        self.cli_config = dict(cli_config or {})
        self.spdk_targets = list(spdk_targets or [])
        self.register = None
        master = nof.master_of(self.cli_config, self.spdk_targets)
        self.config_list = nof.settle(self._remote_ssds(master), self.cli_config)
        logger.info("loaded %d SSD configuration(s)", len(self.config_list))

    def _remote_ssds(self, master):
        shell = nof.SpdkShell(self.cli_config)
        configs = []
        for text in self.spdk_targets:
            target = nof.parse_target_info(text)
            ip, path = target.get("ip"), target.get("path")
            if not ip or not path:
                logger.error("invalid target info %r (needs ip: and path:)", text)
                continue
            try:
                for nqn, traddr, trsvcid, nsid, bdev in nof.nvme_namespaces(shell, ip, path):
                    if not bdev:
                        continue
                    size = nof.bdev_size(shell, ip, path, bdev)
                    configs.append(nof.ssd_config(nqn, nsid, traddr, trsvcid, size, master))
                    logger.info("found SSD nqn=%s nsid=%s traddr=%s size=%d", nqn, nsid,
                                traddr, size)
            except (RuntimeError, OSError, ValueError) as e:
                logger.error("failed to get SSD info from %s: %s", ip, e)
        if not configs:
            raise RuntimeError("No SSD information found from remote targets")
        return configs

    def start_ssd_service(self):
        """Registers every SSD; True when each was registered or already was."""
        return nof.for_each_ssd(
            self, "register", "Registration",
            lambda register, cfg: register.real_register(
                cfg["nqn"], cfg["nsid"], cfg["traddr"], cfg["trsvcid"], cfg["base"],
                cfg["size"], cfg["master_server_address"]),
            skip=_already_registered)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description="Register SPDK targets' SSDs with a "
                                                 "Mooncake master")
    parser.add_argument("--master_server_address", required=True,
                        help="master address, e.g. 192.168.65.81:50051")
    parser.add_argument("--spdk_target_info", action="append", required=True,
                        help='a target, e.g. "ip:192.168.65.56 path:/home/spdk"')
    nof.add_shared_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    return nof.run_tool(MooncakeNoFRegister, parse_arguments(argv),
                        MooncakeNoFRegister.start_ssd_service)


if __name__ == "__main__":
    sys.exit(main())
