"""vLLM v1 KV connector moving prefill KV caches to decode instances with the Transfer
Engine (upstream's ``mooncake.mooncake_connector_v1``; for vLLM 0.10 to 0.12, newer vLLM
ships its own Mooncake connector).

    Prefill: --kv-transfer-config '{"kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer", "kv_connector_module_path": "mooncake.mooncake_connector_v1"}'
    Decode:  the same with "kv_role": "kv_consumer"; then run
             ``python -m mooncake.vllm_v1_proxy_server`` in front of both.

A decode worker asks the prefill worker of its tensor-parallel rank, over a ZeroMQ side
channel (port ``VLLM_MOONCAKE_SIDE_CHANNEL_PORT`` + data-parallel rank x TP size + TP
rank), to write a request's KV blocks into its own registered caches; the prefill side
writes them with ``batch_transfer_sync_write`` (grouping contiguous blocks) and answers
``trans_done``. The side-channel message is JSON (both ends run this module; upstream's
is msgpack).

The connector classes (``MooncakeConnector``, ``MooncakeConnectorScheduler``,
``MooncakeConnectorWorker``, ``MooncakeConnectorMetadata``) need vLLM, pyzmq and torch
and are imported from ``mooncake._vllm_connector`` on first use; everything else here is
standard library only.
"""

import asyncio
import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

__all__ = [
    "EngineId", "ReqId", "TRANS_DONE", "TRANS_ERROR", "VLLM_MOONCAKE_SIDE_CHANNEL_PORT",
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "VLLM_MOONCAKE_SENDER_WORKERS",
    "VLLM_MOONCAKE_PROTOCOL", "MooncakeAgentMetadata", "RecvReqMeta", "SendBlockMeta",
    "MooncakeConnectorMetadata", "MooncakeConnector", "MooncakeConnectorScheduler",
    "MooncakeConnectorWorker", "zmq_ctx", "group_concurrent_contiguous",
    "get_mooncake_side_channel_port",
]

EngineId = str
ReqId = str

TRANS_DONE = b"trans_done"
TRANS_ERROR = b"trans_error"
VLLM_MOONCAKE_SIDE_CHANNEL_PORT = int(os.getenv("VLLM_MOONCAKE_SIDE_CHANNEL_PORT", "6557"))
VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT = int(os.getenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT",
                                                    "120"))
VLLM_MOONCAKE_SENDER_WORKERS = int(os.getenv("VLLM_MOONCAKE_SENDER_WORKERS", "10"))
VLLM_MOONCAKE_PROTOCOL = os.getenv("VLLM_MOONCAKE_PROTOCOL", "rdma")

_VLLM_CLASSES = ("MooncakeConnector", "MooncakeConnectorScheduler", "MooncakeConnectorWorker",
                 "MooncakeConnectorMetadata")


@dataclass
class MooncakeAgentMetadata:
    """A decode worker's request to a prefill worker: write the KV blocks of
    ``request_ids`` (prefill-side ids) into ``block_ids`` (one list per request) of the
    caches at ``kv_caches_base_addr`` (one per layer) in the engine
    ``remote_hostname:remote_port``."""

    remote_hostname: str
    remote_port: int
    request_ids: list
    kv_caches_base_addr: list
    block_ids: list

    def encode(self):
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data):
        """The metadata in ``data``; ValueError when it is not well formed."""
        try:
            raw = json.loads(bytes(data))
            meta = cls(**raw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"malformed MooncakeAgentMetadata: {e}") from None
        ints = [meta.remote_port, *meta.kv_caches_base_addr,
                *(b for blocks in meta.block_ids for b in blocks)]
        if not isinstance(meta.remote_hostname, str) or \
                any(isinstance(v, bool) or not isinstance(v, int) for v in ints) or \
                len(meta.block_ids) != len(meta.request_ids):
            raise ValueError("malformed MooncakeAgentMetadata: wrong field types")
        return meta


@dataclass
class RecvReqMeta:
    local_block_ids: list
    remote_host: str
    remote_port: int
    remote_request_id: Optional[ReqId] = None


@dataclass
class SendBlockMeta:
    local_block_ids: list
    ready: asyncio.Event
    expire_time: float = field(default=float("inf"))


def group_concurrent_contiguous(src_indices, dst_indices):
    """Splits parallel block lists into runs contiguous on both sides:
    ([1, 2, 3, 7], [5, 6, 9, 10]) -> ([[1, 2], [3], [7]], [[5, 6], [9], [10]])."""
    src, dst = list(src_indices), list(dst_indices)
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    src_groups, dst_groups = [], []
    for i, (s, d) in enumerate(zip(src, dst)):
        if i and s == src[i - 1] + 1 and d == dst[i - 1] + 1:
            src_groups[-1].append(s)
            dst_groups[-1].append(d)
        else:
            src_groups.append([s])
            dst_groups.append([d])
    return src_groups, dst_groups


def get_mooncake_side_channel_port(vllm_config):
    """The side-channel base port of this data-parallel rank."""
    parallel = vllm_config.parallel_config
    return VLLM_MOONCAKE_SIDE_CHANNEL_PORT + \
        parallel.data_parallel_rank * parallel.tensor_parallel_size


@contextlib.contextmanager
def zmq_ctx(socket_type, addr):
    """A ZeroMQ ROUTER (bound) or REQ (connected) socket on ``addr`` for the block."""
    import zmq

    if socket_type not in (zmq.ROUTER, zmq.REQ):
        raise ValueError(f"Unexpected socket type: {socket_type}")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(socket_type)
        if socket_type == zmq.ROUTER:
            sock.bind(addr)
        else:
            sock.connect(addr)
        yield sock
    finally:
        ctx.destroy(linger=0)


def _async_loop(loop):
    asyncio.set_event_loop(loop)
    loop.run_forever()


def __getattr__(name):
    # The vLLM-facing classes load vLLM; only on first use (PEP 562).
    if name in _VLLM_CLASSES:
        try:
            from . import _vllm_connector
        except ImportError as e:
            raise ImportError(f"mooncake.mooncake_connector_v1.{name} needs vLLM (0.10 to "
                              f"0.12), pyzmq and torch: {e}") from e
        value = getattr(_vllm_connector, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
