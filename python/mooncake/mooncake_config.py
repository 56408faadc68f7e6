"""Mooncake store client configuration: from a JSON file or from environment variables.

Sizes are an ``int`` (bytes) or a human string: a number (decimals allowed) followed by
k, m, g or t (binary multiples), with or without a trailing "b" or "ib", in any case, e.g.
``"4GB"``, ``"512mb"``, ``"1.5g"``, ``"64K"``, ``"100"``, ``"1e9"``. Anything else
(``"10%"``, ``"abc"``, negative numbers) raises ``ValueError``.

A config's protocol is lower-cased (engines match protocol names exactly); one this module
does not know is passed on with a warning, since which transports exist is the engine's
to say (``mooncake info``).
"""

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "MooncakeConfig",
    "parse_size",
    "DEFAULT_GLOBAL_SEGMENT_SIZE",
    "DEFAULT_LOCAL_BUFFER_SIZE",
]

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200  # 3.125 GiB
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824  # 1 GiB

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*$",
                   re.IGNORECASE)
# The protocol names our engine takes (crates/engine/src/engine/config.rs: its transports, and Mooncake's
# hardware protocols it has no transport for, which run over TCP with a warning). Only a
# hint for a warning here: the engine decides what this host can use.
KNOWN_PROTOCOLS = frozenset({
    "auto", "tcp", "shm", "rdma", "efa", "fabric",
    "nvlink", "nvlink_intra", "nvmeof", "cxl", "cxi", "ascend", "hccl", "musa", "hip",
    "barex", "maca", "ub", "ubshmem", "sunrise_link",
})
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")


def parse_size(value, name="size"):
    """Bytes from an int or a human size string (see the module docstring)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int or a size string, got bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: {value} is negative")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}: {value!r} is not a byte count")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(
                f"{name}: {value!r} is not a size (an int, or a number with k/m/g/t, "
                f"e.g. '4GB', '512MB', '1.5g'; percentages are not accepted)")
        number, unit = m.groups()
        mult = _UNITS[unit.lower()]
        if number.isdigit():
            return int(number) * mult
        scaled = float(number) * mult
        if not math.isfinite(scaled):
            raise ValueError(f"{name}: {value!r} is not a byte count")
        return int(scaled)
    raise TypeError(f"{name}: expected an int or a size string, got {type(value).__name__}")


def _parse_segment_size(value):
    """Upstream's name for :func:`parse_size` (its tests and tools import it)."""
    return parse_size(value, "segment size")


def bool_word(value):
    """True or False for a boolean spelled as configs and environments spell it (a bool,
    a number, or words such as "yes", "off", "enable"; empty and None are False); None for
    anything else."""
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if isinstance(value, (int, float)):
        return bool(value)
    s = str(value).strip().lower()
    if s in ("", "0", "false", "f", "n", "no", "off", "disable"):
        return False
    if s in ("1", "true", "t", "y", "yes", "on", "enable"):
        return True
    return None


def _parse_bool(value, name):
    parsed = bool_word(value)
    if parsed is None:
        raise ValueError(f"{name}: {value!r} is not a boolean")
    return parsed


def port_number(value, name):
    try:
        port = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{name}: {port} is not a port number")
    return port



def parse_defines(items):
    """{key: value} from the tools' -Dkey=value items; one without '=' (or without a key)
    is logged and skipped."""
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if eq and key:
            out[key] = value
        else:
            # under the tools' logger, with the rest of what they report
            logging.getLogger("mooncake").warning("ignoring -D%s (expected key=value)",
                                                  item)
    return out

@dataclass
class MooncakeConfig:
    """A store client's settings (the fields of Mooncake's ``MooncakeConfig``).

    JSON file example::

        {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
         "global_segment_size": "4GB", "local_buffer_size": "512MB", "protocol": "tcp",
         "device_name": "", "master_server_address": "localhost:50051"}
    """

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: Optional[str]
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300
    # Our extension (docs/security.md): the cluster secret, or a file holding it. Unset,
    # the library takes MC_CLUSTER_SECRET from the environment.
    cluster_secret: str = ""
    cluster_secret_file: str = ""

    def __post_init__(self):
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r} (a name such as 'tcp' or "
                             f"'rdma' is needed)")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in KNOWN_PROTOCOLS:
            logger.warning("Unrecognised protocol %r: passed on to the engine as given "
                           "(known: %s)", self.protocol, ", ".join(sorted(KNOWN_PROTOCOLS)))
        for name in ("global_segment_size", "local_buffer_size"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{name}: {value} is negative")
            setattr(self, name, parse_size(value, name))
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, got "
                                 f"{value!r}")

    @staticmethod
    def from_file(file_path: str) -> "MooncakeConfig":
        """Loads a JSON config file; missing required fields raise ValueError."""
        with open(file_path) as fin:
            config = json.load(fin)
        if not isinstance(config, dict):
            raise ValueError(f"{file_path}: expected a JSON object")
        for field in _REQUIRED:
            if field not in config:
                raise ValueError(f"Missing required config field: {field}")
        return MooncakeConfig(
            local_hostname=str(config["local_hostname"]),
            metadata_server=str(config["metadata_server"]),
            global_segment_size=parse_size(
                config.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE),
                "global_segment_size"),
            local_buffer_size=parse_size(
                config.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE), "local_buffer_size"),
            protocol=str(config.get("protocol", "tcp")),
            device_name=config.get("device_name", "") or "",
            master_server_address=str(config["master_server_address"]),
            enable_ssd_offload=_parse_bool(config.get("enable_ssd_offload", False),
                                           "enable_ssd_offload"),
            ssd_offload_path=str(config.get("ssd_offload_path") or ""),
            tenant_id=str(config.get("tenant_id") or "default"),
            enable_client_http_server=_parse_bool(config.get("enable_client_http_server", False),
                                                  "enable_client_http_server"),
            client_http_port=port_number(config.get("client_http_port", 9300),
                                         "client_http_port"),
            cluster_secret=str(config.get("cluster_secret") or ""),
            cluster_secret_file=str(config.get("cluster_secret_file") or ""),
        )

    @staticmethod
    def load_from_env() -> "MooncakeConfig":
        """From the file named by MOONCAKE_CONFIG_PATH, else from MOONCAKE_MASTER (required),
        MOONCAKE_LOCAL_HOSTNAME (localhost), MOONCAKE_TE_META_DATA_SERVER (P2PHANDSHAKE),
        MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_PROTOCOL (tcp),
        MOONCAKE_DEVICE ("")."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError(
                "Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor "
                "'MOONCAKE_MASTER' is set.")
        return MooncakeConfig(
            local_hostname=os.getenv("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=os.getenv("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=parse_size(
                os.getenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE),
                "MOONCAKE_GLOBAL_SEGMENT_SIZE"),
            local_buffer_size=parse_size(
                os.getenv("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE),
                "MOONCAKE_LOCAL_BUFFER_SIZE"),
            protocol=os.getenv("MOONCAKE_PROTOCOL", "tcp"),
            device_name=os.getenv("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=_parse_bool(os.getenv("MOONCAKE_OFFLOAD_ENABLED", "false"),
                                           "MOONCAKE_OFFLOAD_ENABLED"),
            ssd_offload_path=os.getenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=os.getenv("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_parse_bool(
                os.getenv("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false"),
                "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER"),
            client_http_port=port_number(os.getenv("MOONCAKE_CLIENT_HTTP_PORT", 9300),
                                   "MOONCAKE_CLIENT_HTTP_PORT"),
        )

    def to_setup_dict(self) -> dict:
        """The dict ``MooncakeDistributedStore.setup`` accepts."""
        setup = {
            "local_hostname": self.local_hostname,
            "metadata_server": self.metadata_server,
            "global_segment_size": self.global_segment_size,
            "local_buffer_size": self.local_buffer_size,
            "protocol": self.protocol,
            "rdma_devices": self.device_name or "",
            "master_server_addr": self.master_server_address,
            "enable_ssd_offload": self.enable_ssd_offload,
            "ssd_offload_path": self.ssd_offload_path,
            "tenant_id": self.tenant_id,
            "enable_client_http_server": self.enable_client_http_server,
            "client_http_port": self.client_http_port,
        }
        for key in ("cluster_secret", "cluster_secret_file"):
            if getattr(self, key):
                setup[key] = getattr(self, key)
        return setup
