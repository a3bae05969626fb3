"""NIXL backend: one-sided UCX WRITEs from our registered KV cache into the peer's (a read asks
the holder to write: see docs/kvtransfer.md, reads)."""

from __future__ import annotations

import base64
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

try:
    from nixl_cu12 import (
        nixl_agent,
        nixl_agent_config,
        nixl_prepped_dlist_handle,
        nixl_xfer_handle,
    )
except ImportError:  # the same API built for CUDA 13 (Dockerfile: NIXL_PACKAGE=nixl-cu13)
    from nixl_cu13 import (
        nixl_agent,
        nixl_agent_config,
        nixl_prepped_dlist_handle,
        nixl_xfer_handle,
    )

from kvtransfer.agent import Fence, KVAgent, TransferHandle, done_fence
from kvtransfer.errors import (
    KVPeerError,
    KVTimeoutError,
    KVTransferError,
    error_from_wire,
    error_kind,
)
from kvtransfer.inbox import Expected
from kvtransfer.layout import KVLayout
from kvtransfer.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_MEMORY
from kvtransfer.staging import BlockMirror, Staging, ready_event, ucx_cuda_missing
from kvtransfer.wire import BlockHeader, PeerMetadata, ReadRequest

logger = logging.getLogger(__name__)

# The driver thread polls (no NIXL progress thread: it costs 3-4x on 2 cores). A short sleep
# while work is in flight keeps latency low without a core spinning; idle, it naps longer.
_POLL_ACTIVE_S = 50e-6
_POLL_IDLE_S = 2e-3
# A receiver that never answers 'begin' (dead, or an old metadata blob) fails the send.
_GRANT_TIMEOUT_S = 10.0
# How long a fence waits for an admitted writer to confirm it has nothing more in flight; a
# writer that stays silent is taken to be dead (its transport endpoints are gone with it).
_DRAIN_TIMEOUT_S = 1.0
# A holder answers a read once its own send of the blocks resolved; past this, the read fails
# (and the reader's cancel() fences a push that may still be writing).
_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class _Peer:
    """A receiver as its metadata describes it."""

    agent_name: str
    agent_metadata: bytes
    base_address: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    num_blocks: int
    bytes_per_block: int

    @classmethod
    def parse(cls, blob: bytes) -> _Peer:
        peer = PeerMetadata.decode(blob)
        if peer.backend != NixlAgent.backend:
            raise ValueError(f"backend: expected {NixlAgent.backend}, got {peer.backend}")
        try:
            ep = peer.endpoint
            return cls(
                agent_name=str(ep["agent_name"]),
                agent_metadata=base64.b64decode(ep["agent_metadata"]),
                base_address=int(ep["base_address"]),
                mem_type=str(ep["mem_type"]),
                device_id=int(ep["device_id"]),
                num_blocks=peer.num_blocks,
                bytes_per_block=peer.layout.bytes_per_block,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed nixl endpoint: {e!r}") from e


@dataclass(slots=True)
class _Job:
    peer: _Peer
    header: BlockHeader
    src_block_ids: list[int]
    handle: TransferHandle
    ready: torch.cuda.Event | None = None  # a CUDA cache's blocks are written once it is done


@dataclass(slots=True)
class _Burst:
    """Sends of one request to one receiver, from 'begin' until nothing is queued or in flight.

    No byte is written before the receiver answers 'go': that answer is what lets a receiver
    that cancels know every writer it must stop (see docs/kvtransfer.md, cancellation).
    """

    grant_deadline_s: float
    is_granted: bool = False
    queued: list[_Job] = field(default_factory=list)
    posted: list[tuple[_Job, nixl_xfer_handle]] = field(default_factory=list)
    # Granted jobs whose bytes are not ready yet: the GPU is still writing them, or copying
    # them to the host mirror. Posted once the event completes (the driver polls it).
    gated: list[tuple[_Job, torch.cuda.Event]] = field(default_factory=list)
    stop_error: KVTransferError | None = None  # set by the receiver's 'stop'


@dataclass(slots=True)
class _Read:
    """One of our reads, from the request to the holder until its answer."""

    handle: TransferHandle
    deadline_s: float
    is_answered: bool = False
    verdict: KVTransferError | None = None


def _block_descs(
    base_address: int, num_blocks: int, bytes_per_block: int, device_id: int
) -> np.ndarray:
    """One (address, length, device) row per block, so a transfer selects blocks by index."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * bytes_per_block
    descs[:, 1] = bytes_per_block
    descs[:, 2] = device_id
    return descs


class NixlAgent(KVAgent):
    """Every call into the NIXL agent after construction happens on one driver thread, so the
    agent runs without NIXL's own locking; callers hand work over through a queue."""

    backend = "nixl"

    def __init__(
        self, name: str, kv_cache: torch.Tensor, layout: KVLayout, staging: Staging = "auto"
    ) -> None:
        super().__init__(kv_cache, layout)
        # A fresh suffix: a restarted worker must not inherit its predecessor's entry in peers'
        # caches of loaded agents.
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = nixl_agent(self.name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend on this host")
        # The memory peers write into and we send from: the cache itself (DRAM, or VRAM that
        # UCX moves with cuda_ipc on one host and RDMA across hosts), or its host mirror.
        self._mirror: BlockMirror | None = None
        registered = self._register(kv_cache, staging)
        self._mem_type = "VRAM" if registered.is_cuda else "DRAM"
        memory = "staged" if self._mirror is not None else self._mem_type
        KV_TRANSFER_MEMORY.labels(self.backend, memory).set(1)
        self._device_id = registered.device.index or 0
        bpb = layout.bytes_per_block
        local = _block_descs(registered.data_ptr(), self.num_blocks, bpb, self._device_id)
        self._local_blocks = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, self._mem_type)
        self._agent_metadata = self._agent.get_agent_metadata()
        endpoint = {
            "agent_name": self.name,
            "agent_metadata": base64.b64encode(self._agent_metadata).decode(),
            "base_address": registered.data_ptr(),
            "mem_type": self._mem_type,
            "device_id": self._device_id,
        }
        self._metadata = PeerMetadata(self.backend, layout, self.num_blocks, endpoint).encode()
        # Driver-thread state.
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._remote_blocks: dict[str, nixl_prepped_dlist_handle] = {}  # by agent name
        self._loaded_agents: set[str] = set()
        self._bursts: dict[tuple[str, str], _Burst] = {}  # (agent name, request id)
        self._reads: dict[tuple[str, str], _Read] = {}  # (holder's agent name, request id)
        self._fences: dict[str, Fence] = {}  # request id -> writers not yet drained
        # Fences whose writers stayed silent past the drain timeout: a late 'drained' still
        # settles them, but they no longer keep the driver polling fast.
        self._late_fences: dict[str, Fence] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._driver = threading.Thread(target=self._drive, name="kv-nixl-driver", daemon=True)
        self._driver.start()

    def _register(self, kv_cache: torch.Tensor, staging: Staging) -> torch.Tensor:
        """Registers the cache, or a pinned host mirror of it where UCX cannot move GPU memory
        (or staging is forced); returns what was registered."""
        if not kv_cache.is_cuda and staging != "always":
            self._registration = self._agent.register_memory(kv_cache)
            return kv_cache
        reason = "staging forced (always)" if staging == "always" else ucx_cuda_missing()
        if reason is None:
            try:
                self._registration = self._agent.register_memory(kv_cache)  # as VRAM
                logger.info("NIXL: KV cache registered as VRAM on %s", kv_cache.device)
                return kv_cache
            except Exception as e:  # nixl raises its own exception types
                reason = f"registering VRAM failed: {type(e).__name__}: {e}"
        if staging == "never":
            raise RuntimeError(f"NIXL cannot move KV from {kv_cache.device} memory: {reason}")
        self._mirror = BlockMirror(kv_cache)
        gib = self._mirror.blocks.numel() * self._mirror.blocks.element_size() / 2**30
        logger.warning(
            "NIXL: staging KV from %s through a %.2f GiB pinned host mirror (%s)",
            kv_cache.device, gib, reason,
        )  # fmt: skip
        self._registration = self._agent.register_memory(self._mirror.blocks)
        return self._mirror.blocks

    @property
    def is_staged(self) -> bool:
        return self._mirror is not None

    def metadata(self) -> bytes:
        return self._metadata

    # ---- caller-thread API

    def expect(
        self, request_id: str, block_ids: Sequence[int], readable_block_ids: Sequence[int] = ()
    ) -> None:
        super().expect(request_id, block_ids, readable_block_ids)
        self._wake.set()  # the driver may be napping: the sender's 'begin' should not wait

    def send(
        self,
        peer_metadata: bytes,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        self._check_send_args(src_block_ids, dst_block_ids)
        num_bytes = len(src_block_ids) * self.layout.bytes_per_block
        handle = TransferHandle(request_id, num_bytes, self.backend)
        try:
            peer = _Peer.parse(peer_metadata)
            if min(dst_block_ids) < 0 or max(dst_block_ids) >= peer.num_blocks:
                raise ValueError(f"dst block ids must lie in [0, {peer.num_blocks})")
        except ValueError as e:
            handle.resolve(KVTransferError(request_id, f"bad peer metadata or block ids: {e}"))
            return handle
        if self._closed.is_set():
            handle.resolve(KVPeerError(request_id, "agent closed"))
            return handle
        header = BlockHeader(request_id, self.layout, tuple(dst_block_ids), num_bytes)
        # Recorded here, on the engine thread, right after the step that wrote these blocks.
        job = _Job(peer, header, list(src_block_ids), handle, ready_event(self.kv_cache))
        self._call(partial(self._start_job, job))
        return handle

    def _start_read(self, peer_metadata: bytes, read: ReadRequest, handle: TransferHandle) -> None:
        try:
            peer = _Peer.parse(peer_metadata)
        except ValueError as e:
            self._finish_read(handle, KVTransferError(read.request_id, f"bad peer metadata: {e}"))
            return
        if self._closed.is_set():
            self._finish_read(handle, KVPeerError(read.request_id, "agent closed"))
            return
        self._call(partial(self._request_read, peer, read, handle))

    def _fence(self, entry: Expected) -> Fence:
        # entry is forgotten: no writer can be admitted any more, so writer_ids is final.
        if not entry.writer_ids or self._closed.is_set():
            return done_fence()
        fence = Fence(set(entry.writer_ids))
        self._call(partial(self._start_fence, entry.request_id, fence))
        if not fence.done.wait(_DRAIN_TIMEOUT_S):
            logger.warning(
                "request %s: writers %s did not confirm a stop within %s s; its blocks must "
                "stay out of use until they do",
                entry.request_id,
                sorted(fence.writer_names),
                _DRAIN_TIMEOUT_S,
            )
            self._call(partial(self._demote_fence, entry.request_id))
        return fence

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._driver.join()
        # Work handed over after the driver's last step: run it here (the driver is gone, so
        # this thread owns the agent now) and fail what it queued, below.
        while True:
            try:
                self._calls.get_nowait()()
            except queue.Empty:
                break
        self._inbox.fail_all("agent closed")
        for burst in self._bursts.values():
            for job in burst.queued:
                job.handle.resolve(KVPeerError(job.header.request_id, "agent closed"))
            for job, xfer in burst.posted:
                job.handle.resolve(KVPeerError(job.header.request_id, "agent closed"))
                _release_quietly(xfer)
            for job, _ in burst.gated:
                job.handle.resolve(KVPeerError(job.header.request_id, "agent closed"))
        self._bursts.clear()
        for (_, request_id), read in self._reads.items():
            read.handle.resolve(KVPeerError(request_id, "agent closed"))
        self._reads.clear()
        # The fences stay unsettled: closing does not stop a remote writer.
        for remote in self._remote_blocks.values():
            _release_quietly(remote)
        _release_quietly(self._local_blocks)
        for agent_name in self._loaded_agents:
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as e:  # nixl raises its own exception types
                logger.debug("removing remote agent %s: %s", agent_name, e)
        self._agent.deregister_memory(self._registration)

    def _call(self, fn: Callable[[], None]) -> None:
        self._calls.put(fn)
        self._wake.set()

    # ---- driver thread

    def _drive(self) -> None:
        while not self._closed.is_set():
            self._wake.clear()  # before the work: a wake-up during it must end the next wait
            try:
                while True:
                    try:
                        self._calls.get_nowait()()
                    except queue.Empty:
                        break
                for agent_name, messages in self._agent.get_new_notifs().items():
                    for message in messages:
                        self._on_message(agent_name, message)
                self._progress()
            except Exception:  # keep serving other requests; each failure is logged
                logger.exception("nixl driver step failed")
            is_active = bool(self._bursts or self._fences or self._reads or self._inbox.num_open())
            self._wake.wait(_POLL_ACTIVE_S if is_active else _POLL_IDLE_S)

    def _notify(self, agent_name: str, op: str, request_id: str, **fields: Any) -> None:
        message = json.dumps({"op": op, "request_id": request_id, **fields}).encode()
        self._agent.send_notif(agent_name, message)

    def _on_message(self, agent_name: str, message: bytes) -> None:
        try:
            body = json.loads(message)
            op, request_id = str(body["op"]), str(body["request_id"])
            if op == "begin":
                self._on_begin(agent_name, request_id, body)
            elif op == "data":
                self._on_data(agent_name, BlockHeader.from_dict(body["header"]))
            elif op == "drained":
                self._on_drained(agent_name, request_id)
            elif op == "go":
                self._on_go(agent_name, request_id)
            elif op == "stop":
                error = error_from_wire(str(body["kind"]), request_id, str(body["reason"]))
                self._on_stop(agent_name, request_id, error)
            elif op == "read":
                self._on_read(agent_name, ReadRequest.from_dict(body["read"]))
            elif op == "read_done":
                self._on_read_done(agent_name, request_id, body)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # one bad message must not cost the rest of its batch
            logger.warning("dropping notification from %s: %r", agent_name, e)

    # receiver side

    def _on_begin(self, agent_name: str, request_id: str, body: dict[str, Any]) -> None:
        if agent_name not in self._loaded_agents:
            # Loading the sender lets us answer it; it rides along with every 'begin'.
            loaded_name = self._agent.add_remote_agent(base64.b64decode(body["agent_metadata"]))
            if loaded_name.decode() != agent_name:
                raise ValueError(f"{agent_name} sent the metadata of {loaded_name.decode()}")
            self._loaded_agents.add(agent_name)
        try:
            layout = KVLayout.from_dict(body["layout"])
        except ValueError as e:
            self._notify(agent_name, "stop", request_id, kind="header", reason=str(e))
            return
        try:
            self._inbox.grant(request_id, layout, agent_name)
        except KVTransferError as e:
            self._notify(agent_name, "stop", request_id, kind=error_kind(e), reason=e.reason)
            return
        self._notify(agent_name, "go", request_id)

    def _on_data(self, agent_name: str, header: BlockHeader) -> None:
        # The bytes are already in our blocks (the notification follows the WRITE); this
        # re-check fails the request if they are not what it expected.
        try:
            entry = self._inbox.admit(header, agent_name)
        except KVTransferError:
            return  # a late write to a forgotten request: it was fenced, nobody reads those blocks
        if self._mirror is not None:
            # Staged: the bytes are in the mirror; into the GPU blocks while the request is
            # open (forget() takes this lock, so none land after a cancel returned).
            with entry.write_lock:
                if entry.is_open:
                    self._mirror.copy_in(header.block_ids)
        self._inbox.land(entry)
        KV_TRANSFER_BYTES.labels(self.backend, "received").inc(header.num_bytes)

    def _on_read(self, agent_name: str, read: ReadRequest) -> None:
        push = self._push(read)
        # Answered on a later driver turn: the push may resolve on this very call.
        push.add_done_callback(
            lambda error: self._call(partial(self._answer_read, agent_name, read, error))
        )

    def _answer_read(
        self, agent_name: str, read: ReadRequest, error: KVTransferError | None
    ) -> None:
        verdict = self._read_verdict(read, error)
        fields = {} if verdict is None else {"kind": error_kind(verdict), "reason": verdict.reason}
        try:
            if agent_name not in self._loaded_agents:  # the push failed before loading it
                self._load_peer(_Peer.parse(read.reader_metadata))
            self._notify(agent_name, "read_done", read.request_id, **fields)
        except Exception as e:  # nixl raises its own exception types; the reader times out
            logger.warning(
                "request %s: cannot answer %s's read: %s", read.request_id, agent_name, e
            )

    def _start_fence(self, request_id: str, fence: Fence) -> None:
        self._fences[request_id] = fence
        for agent_name in list(fence.writer_names):
            try:
                self._notify(agent_name, "stop", request_id, kind="cancelled", reason="cancelled")
            except Exception as e:  # nixl raises its own exception types
                logger.warning("request %s: cannot stop writer %s: %s", request_id, agent_name, e)
                fence.writer_names.discard(agent_name)
        self._settle_fence(request_id, fence)

    def _on_drained(self, agent_name: str, request_id: str) -> None:
        fence = self._fences.get(request_id) or self._late_fences.get(request_id)
        if fence is not None:
            fence.writer_names.discard(agent_name)
            self._settle_fence(request_id, fence)

    def _settle_fence(self, request_id: str, fence: Fence) -> None:
        if not fence.writer_names:
            fence.done.set()
            self._fences.pop(request_id, None)
            self._late_fences.pop(request_id, None)

    def _demote_fence(self, request_id: str) -> None:
        fence = self._fences.pop(request_id, None)
        if fence is not None and not fence.is_done():
            self._late_fences[request_id] = fence

    # sender side

    def _start_job(self, job: _Job) -> None:
        peer, request_id = job.peer, job.header.request_id
        try:
            if peer.agent_name not in self._remote_blocks:
                self._load_peer(peer)
            key = (peer.agent_name, request_id)
            burst = self._bursts.get(key)
            if burst is None:
                burst = _Burst(grant_deadline_s=time.monotonic() + _GRANT_TIMEOUT_S)
                self._bursts[key] = burst
                self._notify(
                    peer.agent_name,
                    "begin",
                    request_id,
                    layout=self.layout.to_dict(),
                    agent_metadata=base64.b64encode(self._agent_metadata).decode(),
                )
        except Exception as e:  # nixl raises its own exception types
            job.handle.resolve(KVPeerError(request_id, f"cannot reach {peer.agent_name}: {e}"))
            return
        if burst.stop_error is not None:
            job.handle.resolve(burst.stop_error)
        elif burst.is_granted:
            self._post(job, burst)
        else:
            burst.queued.append(job)

    def _request_read(self, peer: _Peer, read: ReadRequest, handle: TransferHandle) -> None:
        try:
            if peer.agent_name not in self._remote_blocks:
                self._load_peer(peer)
            self._notify(peer.agent_name, "read", read.request_id, read=read.to_dict())
        except Exception as e:  # nixl raises its own exception types
            error = KVPeerError(read.request_id, f"cannot reach {peer.agent_name}: {e}")
            self._finish_read(handle, error)
            return
        deadline_s = time.monotonic() + _READ_TIMEOUT_S
        self._reads[(peer.agent_name, read.request_id)] = _Read(handle, deadline_s)

    def _on_read_done(self, agent_name: str, request_id: str, body: dict[str, Any]) -> None:
        read = self._reads.get((agent_name, request_id))
        if read is None:
            return
        read.is_answered = True
        if "kind" in body:
            read.verdict = error_from_wire(str(body["kind"]), request_id, str(body["reason"]))

    def _settle_reads(self, now: float) -> None:
        """A read ends with the holder's answer once its bytes have landed here (the answer may
        overtake the push's 'data' notification), or at its deadline."""
        for key, read in list(self._reads.items()):
            if read.is_answered and (read.verdict is not None or self._inbox.is_settled(key[1])):
                del self._reads[key]
                self._finish_read(read.handle, read.verdict)
            elif now > read.deadline_s:
                del self._reads[key]
                # Not forgotten: a push may still be writing; the caller's cancel() fences it.
                reason = f"{key[0]} did not answer the read within {_READ_TIMEOUT_S} s"
                read.handle.resolve(KVTimeoutError(key[1], reason))

    def _load_peer(self, peer: _Peer) -> None:
        if peer.agent_name not in self._loaded_agents:
            loaded_name = self._agent.add_remote_agent(peer.agent_metadata).decode()
            if loaded_name != peer.agent_name:
                raise ValueError(f"metadata names agent {loaded_name}, not {peer.agent_name}")
            self._loaded_agents.add(peer.agent_name)
        descs = _block_descs(
            peer.base_address, peer.num_blocks, peer.bytes_per_block, peer.device_id
        )
        self._remote_blocks[peer.agent_name] = self._agent.prep_xfer_dlist(
            peer.agent_name, descs, peer.mem_type
        )

    def _on_go(self, agent_name: str, request_id: str) -> None:
        burst = self._bursts.get((agent_name, request_id))
        if burst is None or burst.is_granted or burst.stop_error is not None:
            return
        burst.is_granted = True
        queued, burst.queued = burst.queued, []
        for job in queued:
            self._post(job, burst)

    def _post(self, job: _Job, burst: _Burst) -> None:
        """Posts the WRITE once its source bytes are ready (at once for a CPU cache)."""
        gate = job.ready
        if self._mirror is not None:
            gate = self._mirror.copy_out(job.src_block_ids, job.ready)
        if gate is None or gate.query():
            self._post_now(job, burst)
        else:
            burst.gated.append((job, gate))

    def _post_now(self, job: _Job, burst: _Burst) -> None:
        request_id = job.header.request_id
        # The receiver gets this after the bytes have landed; it re-checks the header in it.
        notification = {"op": "data", "request_id": request_id, "header": job.header.to_dict()}
        try:
            xfer = self._agent.make_prepped_xfer(
                "WRITE",
                self._local_blocks,
                job.src_block_ids,
                self._remote_blocks[job.peer.agent_name],
                list(job.header.block_ids),
                json.dumps(notification).encode(),
            )
            state = self._agent.transfer(xfer)
        except Exception as e:  # nixl raises its own exception types
            job.handle.resolve(KVPeerError(request_id, f"nixl WRITE not posted: {e}"))
            return
        if state == "ERR":
            _release_quietly(xfer)
            job.handle.resolve(KVPeerError(request_id, "nixl WRITE failed to post"))
            return
        burst.posted.append((job, xfer))

    def _on_stop(self, agent_name: str, request_id: str, error: KVTransferError) -> None:
        key = (agent_name, request_id)
        burst = self._bursts.get(key)
        if burst is None:
            self._notify(agent_name, "drained", request_id)
            return
        burst.stop_error = error
        queued, burst.queued = burst.queued, []
        gated, burst.gated = burst.gated, []
        for job in [*queued, *(job for job, _ in gated)]:
            job.handle.resolve(error)
        self._retire_if_idle(key, burst)

    def _progress(self) -> None:
        now = time.monotonic()
        self._settle_reads(now)
        for key, burst in list(self._bursts.items()):
            gated, burst.gated = burst.gated, []
            for job, gate in gated:
                if gate.query():
                    self._post_now(job, burst)
                else:
                    burst.gated.append((job, gate))
            still_posted = []
            for job, xfer in burst.posted:
                try:
                    state = self._agent.check_xfer_state(xfer)
                except Exception as e:  # nixl raises its own exception types
                    logger.warning("request %s: nixl transfer state: %s", key[1], e)
                    state = "ERR"
                if state == "PROC":
                    still_posted.append((job, xfer))
                    continue
                _release_quietly(xfer)
                error = burst.stop_error
                if error is None and state != "DONE":
                    error = KVPeerError(job.header.request_id, "nixl WRITE failed")
                job.handle.resolve(error)
            burst.posted = still_posted
            if not burst.is_granted and burst.queued and now > burst.grant_deadline_s:
                for job in burst.queued:
                    job.handle.resolve(
                        KVPeerError(key[1], f"{key[0]} did not answer within {_GRANT_TIMEOUT_S} s")
                    )
                burst.queued = []
            self._retire_if_idle(key, burst)

    def _retire_if_idle(self, key: tuple[str, str], burst: _Burst) -> None:
        """Drop a burst with nothing queued or in flight; the next send begins a new one."""
        if burst.queued or burst.posted or burst.gated:
            return
        del self._bursts[key]
        if burst.stop_error is not None:
            self._notify(key[0], "drained", key[1])


def _release_quietly(handle: nixl_xfer_handle | nixl_prepped_dlist_handle) -> None:
    try:
        handle.release()
    except Exception as e:  # nixl raises its own exception types
        logger.debug("releasing nixl handle: %s", e)
