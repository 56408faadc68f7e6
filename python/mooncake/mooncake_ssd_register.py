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


class MooncakeNoFRegister:
    """The SSDs of ``spdk_targets`` ("ip:... path:..." strings), ready to register."""

    def __init__(self, cli_config=None, spdk_targets=None):
        self.cli_config = dict(cli_config or {})
        self.spdk_targets = list(spdk_targets or [])
        self.register = None
        if not self.spdk_targets:
            raise ValueError("spdk_target_info is required")
        master = self.cli_config.get("master_server_address")
        if not master:
            raise ValueError("master_server_address is required when using spdk_target_info")
        self.config_list = self._remote_ssds(master)
        nof.apply_overrides(self.config_list, self.cli_config)
        self.config_list = nof.dedupe(self.config_list)
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
        try:
            register_class = nof.nof_register_class()
        except RuntimeError as e:
            logger.error("%s", e)
            return False
        failed = 0
        for i, cfg in enumerate(self.config_list, 1):
            try:
                self.register = register_class()
                ret = self.register.real_register(cfg["nqn"], cfg["nsid"], cfg["traddr"],
                                                  cfg["trsvcid"], cfg["base"], cfg["size"],
                                                  cfg["master_server_address"])
                if ret != 0:
                    raise RuntimeError(f"Registration failed with code {ret}")
                logger.info("registered SSD %d/%d", i, len(self.config_list))
            except Exception as e:  # the store's own errors; report and go on
                if "SEGMENT_ALREADY_EXISTS" in str(e) or "segment already exists" in str(e):
                    logger.info("SSD %d/%d already registered, skipped", i,
                                len(self.config_list))
                else:
                    logger.error("failed to register SSD %d/%d: %s", i,
                                 len(self.config_list), e)
                    failed += 1
        return failed == 0


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description="Register SPDK targets' SSDs with a "
                                                 "Mooncake master")
    parser.add_argument("--master_server_address", required=True,
                        help="master address, e.g. 192.168.65.81:50051")
    parser.add_argument("--spdk_target_info", action="append", required=True,
                        help='a target, e.g. "ip:192.168.65.56 path:/home/spdk"')
    parser.add_argument("--username", default="root", help="SSH user (root)")
    parser.add_argument("--port", type=int, default=22, help="SSH port (22)")
    parser.add_argument("--password", help="SSH password (needs paramiko)")
    parser.add_argument("--key-file", help="SSH private key file")
    parser.add_argument("-D", "--define", action="append", default=[],
                        help="override a field of every SSD, e.g. -Dtrsvcid=4420")
    return parser.parse_args(argv)


def cli_config_from(args):
    cli_config = nof.parse_defines(args.define)
    cli_config["master_server_address"] = args.master_server_address
    cli_config["username"] = args.username
    cli_config["port"] = args.port
    if args.password:
        cli_config["password"] = args.password
    if args.key_file:
        cli_config["key_file"] = args.key_file
    return cli_config


def main(argv=None):
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    args = parse_arguments(argv)
    try:
        register = MooncakeNoFRegister(cli_config_from(args), args.spdk_target_info)
    except (ValueError, RuntimeError) as e:
        logger.error("configuration load failed: %s", e)
        return 1
    return 0 if register.start_ssd_service() else 1


if __name__ == "__main__":
    sys.exit(main())
