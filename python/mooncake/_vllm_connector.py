"""The vLLM-facing classes of ``mooncake.mooncake_connector_v1`` (importing this module
imports vLLM, pyzmq and torch). See that module for the protocol.

Scheduler side: a request with ``do_remote_prefill`` loads its prompt's blocks from the
prefill instance named in its ``kv_transfer_params``; a request with
``do_remote_decode`` keeps its blocks after it finishes until the decode side has
pulled them (or ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` seconds passed), and answers the
proxy with where to pull from.

Worker side: the KV caches are registered with a Transfer Engine; a prefill worker
serves pull requests on its ZeroMQ ROUTER socket from a thread pool, a decode worker
sends them from its own event loop and reports requests done once answered.
"""

import asyncio
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

try:  # the Hybrid Memory Allocator marker (newer vLLM only)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:
    SupportsHMA = object
try:
    from vllm.utils import get_ip, make_zmq_path, make_zmq_socket
except ImportError:
    from vllm.utils.network_utils import get_ip, make_zmq_path, make_zmq_socket

from . import mooncake_connector_v1 as M

logger = init_logger(__name__)

# Attention backends whose KV cache is one tensor per layer (not a K and a V).
_UNSPLIT_BACKENDS = ("FLASHINFER", "PALLAS")
_SIDE_CHANNEL_TIMEOUT_MS = 60000


class MooncakeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step: requests to pull, and requests
    whose blocks wait to be pulled."""

    def __init__(self):
        self.reqs_to_recv = {}  # request id -> RecvReqMeta
        self.reqs_to_send = {}  # request id -> local block ids

    def add_new_req(self, request_id, local_block_ids, kv_transfer_params,
                    load_remote_cache=True):
        if load_remote_cache:
            self.reqs_to_recv[request_id] = M.RecvReqMeta(
                local_block_ids=local_block_ids,
                remote_host=kv_transfer_params["remote_host"],
                remote_port=kv_transfer_params["remote_port"],
                remote_request_id=kv_transfer_params.get("remote_request_id"))
        else:
            self.reqs_to_send[request_id] = local_block_ids


class MooncakeConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector vLLM instantiates: delegates to the scheduler or worker half."""

    def __init__(self, vllm_config, role):
        transfer_config = vllm_config.kv_transfer_config
        if transfer_config is None or transfer_config.engine_id is None:
            raise ValueError("MooncakeConnector needs kv_transfer_config with an engine_id")
        super().__init__(vllm_config, role)
        self.engine_id = transfer_config.engine_id
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = MooncakeConnectorScheduler(vllm_config, self.engine_id)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = MooncakeConnectorWorker(vllm_config, self.engine_id)

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                                 num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        """Hybrid models give one block list per KV cache group; the transfer does not
        tell groups apart, so they are flattened."""
        return self.request_finished(request, [b for group in block_ids for b in group])

    # worker side
    def register_kv_caches(self, kv_caches):
        self.connector_worker.register_kv_caches(kv_caches)

    def get_finished(self, finished_req_ids):
        return self.connector_worker.get_finished()

    def start_load_kv(self, forward_context, **kwargs):
        self.connector_worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name):
        pass  # not layer by layer

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass  # the prefill side is pulled from, it does not push

    def wait_for_save(self):
        pass


class MooncakeConnectorScheduler:
    def __init__(self, vllm_config, engine_id):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.side_channel_host = get_ip()
        self.side_channel_port = M.get_mooncake_side_channel_port(vllm_config)
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        self._reqs_need_recv = {}  # request id -> (request, local block ids)
        self._reqs_need_send = {}  # request id -> local block ids
        logger.info("Mooncake connector scheduler %s (%s)", engine_id, self.kv_role)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """(tokens to load from the prefill instance, loaded asynchronously)."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_prefill"):
            if "remote_host" in params and "remote_port" in params:
                # With no external tokens (a full prefix hit) the pull still runs, with no
                # blocks, so the prefill side frees its blocks.
                blocks_to_fill = blocks.get_unhashed_block_ids() if num_external_tokens > 0 \
                    else []
                self._reqs_need_recv[request.request_id] = (request, blocks_to_fill)
            else:
                logger.warning("Invalid kv_transfer_params %s: no KV transfer for this "
                               "request", params)
            params["do_remote_prefill"] = False  # one transfer per request
        elif params.get("do_remote_decode"):
            self._reqs_need_send[request.request_id] = []

    def build_connector_meta(self, scheduler_output):
        meta = MooncakeConnectorMetadata()
        if self.kv_role != "kv_producer":
            for req_id, (request, block_ids) in self._reqs_need_recv.items():
                meta.add_new_req(req_id, block_ids, request.kv_transfer_params)
            self._reqs_need_recv.clear()
        if self.kv_role != "kv_consumer":
            for req_id, block_ids in self._reqs_need_send.items():
                meta.add_new_req(req_id, block_ids, {}, load_remote_cache=False)
            self._reqs_need_send.clear()
        return meta

    def request_finished(self, request, block_ids):
        """(keep the blocks for a pull, the kv_transfer_params to answer with)."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before it was scheduled: pull nothing, but let the prefill side
            # free its blocks.
            self._reqs_need_recv[request.request_id] = (request, [])
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or \
                request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        keep = len(block_ids) > 0
        if keep:
            self._reqs_need_send[request.request_id] = block_ids
        return keep, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_host": self.side_channel_host,
                      "remote_port": self.side_channel_port,
                      "remote_request_id": request.request_id}


def _attention_backend_name(vllm_config):
    from vllm.attention.selector import get_attn_backend

    model, cache = vllm_config.model_config, vllm_config.cache_config
    try:
        backend = get_attn_backend(model.get_head_size(), model.dtype, cache.cache_dtype,
                                   cache.block_size, use_mla=model.use_mla)
    except TypeError:  # signatures differ between vLLM releases
        backend = get_attn_backend(model.get_head_size(), model.dtype, cache.cache_dtype,
                                   cache.block_size, None, use_mla=model.use_mla)
    return backend.get_name()


class MooncakeConnectorWorker:
    def __init__(self, vllm_config, engine_id):
        from .engine import TransferEngine

        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        self.hostname = get_ip()
        self.engine = TransferEngine()
        if self.engine.initialize(self.hostname, "P2PHANDSHAKE", M.VLLM_MOONCAKE_PROTOCOL,
                                  "") != 0:
            raise RuntimeError("Mooncake Transfer Engine initialization failed.")
        self.rpc_port = self.engine.get_rpc_port()
        self.side_channel_port = M.get_mooncake_side_channel_port(vllm_config)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_group = get_tp_group()
        self.use_mla = vllm_config.model_config.use_mla
        self.block_size = vllm_config.cache_config.block_size
        self.backend_name = _attention_backend_name(vllm_config)
        self.split_k_and_v = not self.use_mla and not any(
            b in self.backend_name.upper() for b in _UNSPLIT_BACKENDS)
        self.num_blocks = 0
        self.block_len = 0
        self.kv_caches_base_addr = []
        self.device_kv_caches = {}
        self.reqs_need_send = {}  # request id -> SendBlockMeta (on the sender loop)
        self.finished_sending_reqs = set()
        self.finished_recving_reqs = set()
        self.async_zmq_ctx = zmq.asyncio.Context()
        if self.kv_role != "kv_consumer":
            self._sender_executor = ThreadPoolExecutor(
                max_workers=M.VLLM_MOONCAKE_SENDER_WORKERS,
                thread_name_prefix="vllm-mooncake-sender")
            self.sender_queue = asyncio.Queue()
            self.sender_loop = asyncio.new_event_loop()
            self._sender_thread = threading.Thread(target=M._async_loop,
                                                   args=(self.sender_loop,), daemon=True)
            self._sender_thread.start()
        if self.kv_role != "kv_producer":
            self.receiver_loop = asyncio.new_event_loop()
            self._receiver_thread = threading.Thread(target=M._async_loop,
                                                     args=(self.receiver_loop,), daemon=True)
            self._receiver_thread.start()
        logger.info("Mooncake connector worker %s: engine %s:%d, backend %s", engine_id,
                    self.hostname, self.rpc_port, self.backend_name)

    def shutdown(self):
        self.async_zmq_ctx.term()
        if self.kv_role != "kv_consumer":
            self._sender_executor.shutdown(wait=False)
            if self.sender_loop.is_running():
                self.sender_loop.call_soon_threadsafe(self.sender_loop.stop)
                self._sender_thread.join()
        if self.kv_role != "kv_producer" and self.receiver_loop.is_running():
            self.receiver_loop.call_soon_threadsafe(self.receiver_loop.stop)
            self._receiver_thread.join()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    # ------------------------------------------------------------ caches

    def register_kv_caches(self, kv_caches):
        """Registers every cache tensor (K and V apart where the backend splits them);
        all must be equally large. The prefill side then starts its side channel."""
        ptrs, size = [], None
        for layer, caches in kv_caches.items():
            for cache in (caches if self.split_k_and_v else [caches]):
                if cache.data_ptr() in ptrs:
                    continue
                if size is None:
                    size, self.num_blocks = cache.nbytes, cache.shape[0]
                if cache.nbytes != size:
                    raise ValueError(f"KV cache of {layer} has {cache.nbytes} bytes, others "
                                     f"{size}: all must be the same size")
                ptrs.append(cache.data_ptr())
        if not ptrs or not self.num_blocks or size % self.num_blocks:
            raise ValueError("no KV cache to register, or caches not divisible in blocks")
        if self.engine.batch_register_memory(ptrs, [size] * len(ptrs)) != 0:
            raise RuntimeError("Mooncake batch memory registration failed.")
        self.kv_caches_base_addr = ptrs
        self.block_len = size // self.num_blocks
        self.device_kv_caches = kv_caches
        if self.kv_role == "kv_consumer":
            return
        ready = threading.Event()
        asyncio.run_coroutine_threadsafe(self._serve_pulls(ready), self.sender_loop)
        ready.wait()

    # ------------------------------------------------------------ prefill side

    async def _serve_pulls(self, ready):
        path = make_zmq_path("tcp", self.hostname, self.side_channel_port + self.tp_rank)
        sock = make_zmq_socket(self.async_zmq_ctx, path, zmq.ROUTER)
        workers = [asyncio.create_task(self._pull_worker(sock))
                   for _ in range(2 * M.VLLM_MOONCAKE_SENDER_WORKERS)]
        ready.set()
        try:
            while True:
                identity, _, body = await sock.recv_multipart()
                await self.sender_queue.put((identity, body))
        except zmq.ContextTerminated:
            pass
        except Exception as e:  # the side channel ends; logged for the operator
            logger.error("Mooncake side channel stopped: %s", e)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            sock.close()

    async def _pull_worker(self, sock):
        while True:
            identity, body = await self.sender_queue.get()
            try:
                await self._send_to_decode(M.MooncakeAgentMetadata.decode(body))
                answer = M.TRANS_DONE
            except Exception as e:  # answered as an error; the decode side logs it
                logger.error("Mooncake KV pull failed: %s", e)
                answer = M.TRANS_ERROR
            finally:
                self.sender_queue.task_done()
            await sock.send_multipart((identity, b"", answer))

    async def _send_to_decode(self, meta):
        pending = []
        for req_id in meta.request_ids:
            send = self.reqs_need_send.get(req_id)
            if send is None:
                raise KeyError(f"request {req_id} has no blocks waiting to be pulled")
            send.expire_time = float("inf")  # being sent now
            pending.append(send)
        srcs, dsts, lens = [], [], []
        for send, remote_blocks in zip(pending, meta.block_ids):
            await send.ready.wait()
            if not remote_blocks:
                continue
            # A partial prefix hit on the decode side pulls only the last blocks.
            local_blocks = send.local_block_ids[-len(remote_blocks):]
            local_runs, remote_runs = M.group_concurrent_contiguous(local_blocks, remote_blocks)
            for local_base, remote_base in zip(self.kv_caches_base_addr,
                                               meta.kv_caches_base_addr):
                for lr, rr in zip(local_runs, remote_runs):
                    srcs.append(local_base + lr[0] * self.block_len)
                    dsts.append(remote_base + rr[0] * self.block_len)
                    lens.append(len(lr) * self.block_len)
        session = f"{meta.remote_hostname}:{meta.remote_port}"
        rc = await self.sender_loop.run_in_executor(
            self._sender_executor, self.engine.batch_transfer_sync_write, session, srcs,
            dsts, lens) if srcs else 0
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write to {session} failed: {rc}")
        for req_id in meta.request_ids:
            self.reqs_need_send.pop(req_id, None)
        self.finished_sending_reqs.update(meta.request_ids)

    async def _record_send_reqs(self, metadata):
        for req_id, block_ids in metadata.reqs_to_send.items():
            # An empty list announces the request; its blocks come once it finished.
            send = self.reqs_need_send.setdefault(req_id, M.SendBlockMeta([], asyncio.Event()))
            if block_ids:
                send.local_block_ids = block_ids
                send.expire_time = time.perf_counter() + M.VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
                send.ready.set()

    async def _take_finished_sending(self):
        done, self.finished_sending_reqs = self.finished_sending_reqs, set()
        now = time.perf_counter()
        expired = [r for r, s in self.reqs_need_send.items() if s.expire_time < now]
        for req_id in expired:
            logger.warning("request %s was not pulled within %d s; freeing its blocks",
                           req_id, M.VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)
            del self.reqs_need_send[req_id]
        done.update(expired)
        return done

    # ------------------------------------------------------------ decode side

    async def _pull(self, path, requests):
        """Asks the prefill worker at ``path`` to write ``requests`` [(local id, remote
        id, local blocks)] into this worker's caches."""
        local_ids = [r[0] for r in requests]
        meta = M.MooncakeAgentMetadata(self.hostname, self.rpc_port, [r[1] for r in requests],
                                       self.kv_caches_base_addr, [r[2] for r in requests])
        sock = make_zmq_socket(self.async_zmq_ctx, path, zmq.REQ, bind=False, linger=0)
        sock.setsockopt(zmq.RCVTIMEO, _SIDE_CHANNEL_TIMEOUT_MS)
        try:
            await sock.send(meta.encode())
            answer = await sock.recv()
        except zmq.ContextTerminated:
            return
        except Exception as e:  # logged; the requests stay unfinished
            logger.error("KV pull of %s from %s failed: %s", meta.request_ids, path, e)
            return
        finally:
            sock.close()
        if answer != M.TRANS_DONE:
            logger.error("KV pull of %s from %s failed (see the prefill logs)",
                         meta.request_ids, path)
            return
        self.finished_recving_reqs.update(local_ids)

    async def _take_finished_recving(self):
        done, self.finished_recving_reqs = self.finished_recving_reqs, set()
        return done

    def group_kv_pull(self, metadata):
        """{side-channel path: [(local id, remote id, local blocks)]}."""
        pulls = defaultdict(list)
        for req_id, meta in metadata.reqs_to_recv.items():
            path = make_zmq_path("tcp", meta.remote_host, meta.remote_port + self.tp_rank)
            pulls[path].append((req_id, meta.remote_request_id or req_id,
                                meta.local_block_ids))
        return pulls

    # ------------------------------------------------------------ per step

    def start_load_kv(self, metadata):
        if self.kv_role != "kv_producer":
            for path, requests in self.group_kv_pull(metadata).items():
                asyncio.run_coroutine_threadsafe(self._pull(path, requests),
                                                 self.receiver_loop)
        if self.kv_role != "kv_consumer":
            asyncio.run_coroutine_threadsafe(self._record_send_reqs(metadata),
                                             self.sender_loop)

    def get_finished(self):
        """(requests done sending, requests done receiving), None for none."""
        recv = asyncio.run_coroutine_threadsafe(self._take_finished_recving(),
                                                self.receiver_loop) \
            if self.kv_role != "kv_producer" else None
        send = asyncio.run_coroutine_threadsafe(self._take_finished_sending(),
                                                self.sender_loop) \
            if self.kv_role != "kv_consumer" else None
        sent = send.result() if send else set()
        received = recv.result() if recv else set()
        return sent or None, received or None
