"""Prefill/decode disaggregation's KV connector: a prefill engine's blocks sent to a decode
engine's blocks over ``torch.distributed`` point-to-point messages: the control messages on the
world group (gloo), the K/V on a group of the two engines alone (gloo, or NCCL between GPUs:
*Where the bytes travel* below).

**The protocol is vLLM 0.33.0's NIXL connector's** (``vllm/distributed/kv_transfer/
kv_connector/v1/nixl/``: ``pull_scheduler.py`` for the scheduler side, ``worker.py``), with
its names:

1. A proxy sends the request to a **prefill** engine with ``kv_transfer_params =
   {"do_remote_decode": True}`` and ``max_tokens=1``. The prefill engine computes the prompt
   and samples one token; when the request finishes, :meth:`P2PConnector.request_finished`
   keeps its blocks (``delay_free_blocks``) and returns the parameters the decode side needs:
   ``{"do_remote_prefill": True, "remote_engine_id": <rank>, "remote_request_id": <seq id>,
   "remote_block_ids": [...]}``, which reach the proxy in ``RequestOutput.kv_transfer_params``.
2. The proxy sends the same prompt to a **decode** engine with those parameters. Its
   connector reports the prompt's tokens past the local prefix hit as external and
   asynchronous (:meth:`P2PConnector.get_num_new_matched_tokens`); the V1 scheduler allocates
   blocks for them and parks the request in ``WAITING_FOR_REMOTE_KVS``, its blocks kept out of
   the prefix cache until they are filled (``delay_cache_blocks``).
3. The decode side's worker asks the prefill engine for the blocks; they arrive layer by
   layer and are copied into the blocks it allocated; ``get_finished`` reports the request
   done receiving and it runs: it computes the prompt's last token (for the logits) and
   decodes. The prefill side reports the request done sending once its send completed, and
   only then are its blocks freed.

What differs from NIXL, and why:

* **Two-sided messages instead of one-sided reads.** NIXL's decode side *reads* the prefill
  side's GPU memory (RDMA) and notifies it when done. ``torch.distributed`` has no one-sided
  read, so the decode side sends a small *read request* (``[request id, tag, first block,
  number of blocks]``, one ``int64`` tensor) and the prefill side answers with a status and
  then one message per layer (K and V of the blocks, ``[2, n, block_size, kv_heads,
  head_dim]``): the decode side can start on layer 0 before layer 1 arrives. The blocks are
  gathered into one contiguous buffer per layer at send time (a send needs contiguous memory;
  NIXL reads the blocks in place) and held until the send completed, as NIXL holds them until
  the read is notified.
* **Messages on threads.** A gloo send or receive blocks, and its ``is_completed()`` does not
  move before ``wait()``: each peer gets a thread that does the blocking calls, and the
  engine's thread only looks at what they finished. The network effects of a step happen
  between steps (:meth:`P2PConnector.serve_transfers`, called by the process's loop), never
  inside one, so that a step that fails and is rolled back (``engine/rollback.py``) has sent
  nothing; what a step changes in the connector is put back by its checkpoint.
* **The decode side loads ``len(prompt) - 1`` tokens** and computes the last one, as the
  course's connector contract says; vLLM 0.33.0 loads all of them and then backs
  ``num_computed_tokens`` off by one (``_update_waiting_for_remote_kv`` in
  ``vllm/v1/core/sched/scheduler.py``): the same tokens are computed.
* **Blocks delayed only after ``max_tokens``.** A prefill request that stopped on its own
  (end of sequence as its first token) is finished: nothing follows, so its blocks are freed
  at once (vLLM delays on either status).

**Where the bytes travel.** The read requests and statuses are small ``int64`` CPU tensors on
the world group (gloo), as the caller set it up. The K/V layer messages go on ``data_groups``:
peer rank -> a group of this engine and that peer alone (``dist.new_group([p, d])``, made by
:mod:`course_lib.parallel.disagg`; ``None``: the world group). With ``data_backend="gloo"`` the
layers are staged through CPU memory (gathered, then ``.to("cpu")``; copied in with
``.to(cache device)``: no-ops for caches on the CPU), since gloo moves CPU tensors; with
``"nccl"`` the gathered and receive buffers stay on the cache's GPU and NCCL moves them GPU to
GPU. Why a group per pair: NCCL point-to-point ignores ``tag`` (messages on a communicator
match in the order they are posted) and one communicator must not be driven from two threads.
Both hold here:

* one thread per process touches a pair's group: the peer thread of that peer (prefill side:
  :meth:`P2PConnector._send_work`; decode side: :meth:`P2PConnector._recv_work`); the thread
  that listens for read requests (:meth:`P2PConnector._listen`) uses the world group only;
* at most one transfer is outstanding per pair: the decode side's peer thread does a
  transfer's read request, status and every layer before it takes the next transfer from its
  queue, so the next read request leaves only once the last layer arrived; the prefill side
  queues a transfer on its peer thread only in answer to a read request and sends it whole
  (status, then the layers in order). So the layer messages of a pair are posted in the same
  order on both sides, and order alone matches them (the tags stay, for gloo).

A receive that returns on the CPU does not mean NCCL's data arrived (it is queued on a CUDA
stream): after the last layer the decode side's thread synchronizes its CUDA stream before
the transfer is marked done, and the prefill side's after its last send before the send is
reported; both are no-ops for CPU buffers (:meth:`P2PConnector._wait_for_device`). A dead
peer makes NCCL wait rather than fail: the pair groups have a short timeout
(``course_lib.parallel.disagg.PAIR_TIMEOUT_S``; they are used only once the gloo status
handshake has shown the peer alive), and the engine processes run with
``TORCH_NCCL_BLOCKING_WAIT=1`` and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (the names torch
2.13's ``libtorch_cpu.so`` holds; in torch's ``ProcessGroupNCCL.cpp``, blocking wait makes
``wait()`` poll on the CPU, abort the communicator and raise in the calling thread once the
timeout passed, and starts no watchdog that would tear the process down): the timeout is a
failed transfer, recovered as below. **The NCCL path is unverified here**: this course's
machine has no GPU; the tests that run it (``tests/test_disagg.py``) skip without one. Also
untried: an engine with several peers drives several NCCL communicators at once, one per
thread (NCCL's user guide, "Using multiple NCCL communicators concurrently", warns this can
deadlock when their operations are not ordered); it would show as the timeout above.

Failures: a peer process that dies makes its pending messages fail (gloo: "connection closed
by peer"; NCCL: the pair group's timeout). A failed send frees the prefill side's blocks; a
failed receive reports the decode side's blocks in
:meth:`P2PConnector.get_block_ids_with_load_errors`, and the V1 scheduler computes those
tokens itself (vLLM's ``kv_load_failure_policy="recompute"``). Blocks no decode engine asks
for within ``abort_timeout_s`` are freed (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``). Two
engines whose caches differ in block size, dtype, layer count or head shape are refused when
they connect (:meth:`P2PConnector.connect`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..scheduler.output import KVConnectorMetadata
from ..sequence import SequenceStatus
from ..sizing.units import cdiv
from .kv_connector import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from ..memory.v1.kv_cache_manager import KVCacheManager
    from ..model.attention import AttentionMetadata
    from ..model.llama import KVCache
    from ..scheduler.output import SchedulerOutput
    from ..sequence import Sequence

CTRL_TAG = 1            # read requests, decode -> prefill, in order per pair
DATA_BACKENDS = ("gloo", "nccl")
STATUS_OK, STATUS_GONE = 1, 2
KV_ROLES = ("kv_producer", "kv_consumer")   # vLLM's kv_role values (kv_both is not built)


@dataclass(frozen=True)
class KVLayout:
    """What two engines' paged caches must agree on for blocks to move between them."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv_caches: list[KVCache]) -> KVLayout:
        key = kv_caches[0][0]                       # [num_blocks, block_size, kv_heads, dim]
        return cls(key.shape[1], len(kv_caches), key.shape[2], key.shape[3],
                   str(key.dtype).removeprefix("torch."))

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field that differs, as ``"name: mine vs theirs"``; None if they agree."""
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name}: {a} vs {b}"
        return None


@dataclass
class RecvSpec:
    """One decode-side load: ``block_ids`` (the decode engine's) get the prefill engine's
    blocks ``first_block .. first_block + len(block_ids) - 1`` of request ``remote_request_id``
    on rank ``remote_rank``."""

    seq_id: int
    remote_rank: int
    remote_request_id: int
    first_block: int
    block_ids: list[int]


@dataclass
class P2PConnectorMetadata(KVConnectorMetadata):
    """One step's transfers (plain data). Prefill side: ``reqs_to_send``, the requests whose
    blocks are now held for a decode engine (seq id -> block ids). Decode side: ``reqs_to_recv``,
    the loads to start; ``reqs_to_drop``, loads whose request ended before they finished."""

    reqs_to_send: dict[int, list[int]] = field(default_factory=dict)
    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    reqs_to_drop: list[int] = field(default_factory=list)


@dataclass
class _Transfer:
    """One transfer on a peer's thread; the thread sets ``done`` (and ``error``) last."""

    peer: int
    tag: int
    spec: RecvSpec | None = None              # decode side: the load
    request_id: int = -1                      # prefill side: the held request (-1: none)
    buffers: list[torch.Tensor] = field(default_factory=list)   # per layer [2, n, bs, h, d]
    status: int = STATUS_OK
    done: bool = False
    error: str | None = None


class _PeerThread:
    """A daemon thread doing one peer's blocking sends and receives, in order."""

    def __init__(self, name: str, work: Any) -> None:
        self.queue: deque[_Transfer] = deque()
        self.ready = threading.Condition()
        self.dead: str | None = None
        self._work = work
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, t: _Transfer | None) -> None:
        """Queue a transfer (``None``: stop once the ones before it are done)."""
        with self.ready:
            self.queue.append(t)
            self.ready.notify()

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                t = self.queue.popleft()
            if t is None:
                return
            if self.dead is not None:               # the peer is gone: fail at once
                t.error, t.done = self.dead, True
                continue
            try:
                self._work(t)
            except Exception as exc:                 # a dead peer: connection closed
                self.dead = t.error = f"{type(exc).__name__}: {exc}"
            t.done = True


class P2PConnector(KVConnectorBase_V1):
    """The prefill (``kv_role="kv_producer"``) or decode (``"kv_consumer"``) side of a
    disaggregated deployment (module docstring). ``rank``: this engine's rank in the
    ``torch.distributed`` world of all engines (initialised by the caller, as
    :mod:`course_lib.parallel.disagg` does). ``exit_after_layers``: fault injection for the
    tests and chapter 13: the process exits (``os._exit``) once its first transfer has sent
    (prefill) or received (decode) that many layers: a process killed mid-transfer.
    ``transport``: what moves the messages, with ``torch.distributed``'s ``send``, ``recv``,
    ``all_gather_object`` and ``get_world_size``: that module itself by default; the tests
    pass an in-process stand-in to drive two engines in one process, step by step.
    ``data_groups``: peer rank -> the group the K/V layer messages to and from that peer go on
    (``group=`` of ``send`` / ``recv``); None: the world group. ``data_backend``: ``"gloo"``
    (layers staged through CPU memory) or ``"nccl"`` (layers stay on the cache's GPU); module
    docstring, *Where the bytes travel*."""

    __rollback_skip__ = KVConnectorBase_V1.__rollback_skip__ + (
        "_peers", "_inbox", "_inbox_lock", "_sent", "_in_flight", "_released", "events",
        "transport", "data_groups", "layer_messages")

    def __init__(self, kv_role: str, rank: int, *, abort_timeout_s: float = 120.0,
                 exit_after_layers: int | None = None, transport: Any = dist,
                 data_groups: dict[int, Any] | None = None,
                 data_backend: str = "gloo") -> None:
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {kv_role!r}")
        if data_backend not in DATA_BACKENDS:
            raise ValueError(f"data_backend must be one of {DATA_BACKENDS}, got "
                             f"{data_backend!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        if not abort_timeout_s > 0:
            raise ValueError(f"abort_timeout_s must be > 0, got {abort_timeout_s!r}")
        super().__init__(KVConnectorRole.SCHEDULER)
        self.kv_role, self.rank = kv_role, rank
        self.abort_timeout_s = abort_timeout_s
        self.exit_after_layers = exit_after_layers
        self.transport = transport
        self.data_groups = data_groups
        self.data_backend = data_backend
        #: layer messages sent or received, per group: "pair <p>-<d>" or "world"
        self.layer_messages: dict[str, int] = {}
        self.block_size = 0
        self.layout: KVLayout | None = None
        self.peer_layouts: dict[int, KVLayout] = {}
        # scheduler side, per step (reset by build_connector_meta)
        self._lookup: dict[int, int] = {}              # seq_id -> its local hit (tokens)
        self._reqs_to_send: dict[int, list[int]] = {}
        self._reqs_to_recv: list[RecvSpec] = []
        self._reqs_to_drop: list[int] = []
        self._recv_seq_ids: set[int] = set()           # loads asked for (once per request)
        # worker side: what the steps handed over (put back with a failed step)
        self._held: dict[int, tuple[list[int], float]] = {}    # prefill: id -> ids, since
        self._to_start: list[RecvSpec] = []                     # decode: loads to start
        self._recving: dict[int, _Transfer] = {}                # decode: seq_id -> its load
        self._reported: set[int] = set()                        # prefill: sends reported
        self._load_errors: set[int] = set()
        # worker side: the threads' (never put back: they record what really happened)
        self._peers: dict[int, _PeerThread] = {}
        self._inbox: list[tuple[int, list[int], float]] = []    # (peer, read request, when)
        self._inbox_lock = threading.Lock()
        self._sent: list[_Transfer] = []            # prefill: finished sends, in order
        self._in_flight: set[int] = set()           # prefill: requests being sent
        self._released: list[int] = []              # prefill: held requests let go (proxy)
        self._next_tag = 0
        # counters
        self.num_sent_blocks = self.num_recv_blocks = 0
        self.num_failed_sends = self.num_failed_recvs = self.num_aborted = 0
        self.events: list[tuple[float, str, int]] = []   # (monotonic time, what, request)

    # ------------------------------------------------------------------ binding
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.block_size = kv_cache_manager.block_size

    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        super().register_kv_caches(kv_caches)
        self.layout = KVLayout.of(kv_caches)

    def connect(self, roles: dict[int, str]) -> None:
        """Meet the other engines: every rank shares its role and cache layout (one
        ``all_gather_object`` over the world) and each checks the engines of the other role;
        a difference raises ``ValueError`` naming the ranks and the field, on every rank, before
        anything is sent. ``roles``: rank -> kv_role, for every rank of the world. Then start
        the threads that listen to the peers."""
        if self.layout is None:
            raise RuntimeError("register_kv_caches first: the engine does it when built")
        world = self.transport.get_world_size()
        if sorted(roles) != list(range(world)) or roles.get(self.rank) != self.kv_role:
            raise ValueError(f"roles must name every rank 0..{world - 1}, this one "
                             f"({self.rank}) as {self.kv_role!r}; got {roles!r}")
        gathered: list[Any] = [None] * world
        self.transport.all_gather_object(gathered, (self.kv_role, self.layout))
        problems = []
        for r, (role, layout) in enumerate(gathered):
            if role != roles[r]:
                problems.append(f"rank {r} says it is a {role}, roles say {roles[r]}")
            elif role != self.kv_role:
                self.peer_layouts[r] = layout
        producers = [r for r in range(world) if roles[r] == KV_ROLES[0]]
        consumers = [r for r in range(world) if roles[r] == KV_ROLES[1]]
        for p in producers:
            for c in consumers:
                diff = gathered[p][1].mismatch(gathered[c][1])
                if diff is not None:
                    problems.append(f"prefill rank {p} and decode rank {c} differ in {diff}")
        if problems:
            raise ValueError("the engines' KV caches cannot exchange blocks: "
                             + "; ".join(problems)
                             + " (give every engine the same model dtype and block_size)")
        if self.data_groups is not None and set(self.data_groups) != set(self.peer_layouts):
            raise ValueError(f"data_groups must name each peer of the other role "
                             f"({sorted(self.peer_layouts)}), got {sorted(self.data_groups)}")
        cache_device = self.kv_caches[0][0].device
        if self.data_backend == "nccl" and cache_device.type != "cuda":
            raise ValueError(f"data_backend='nccl' moves GPU memory; this engine's KV cache "
                             f"is on {cache_device} (use 'gloo')")
        for peer in self.peer_layouts:
            work = self._send_work if self.kv_role == "kv_producer" else self._recv_work
            self._peers[peer] = _PeerThread(f"kv-{self.kv_role}-peer{peer}", work)
            if self.kv_role == "kv_producer":
                threading.Thread(target=self._listen, args=(peer,), daemon=True,
                                 name=f"kv-listen-{peer}").start()

    # ------------------------------------------------------------ scheduler side
    def _params(self, seq: Sequence) -> dict:
        return seq.kv_transfer_params or {}

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Decode side: a request with ``do_remote_prefill`` gets the prompt's tokens past its
        local hit from the prefill engine, asynchronously (at most ``len - 1``: the last is
        computed here, for its logits). Once per request: a request preempted after its load
        computes again (the prefill side has freed its blocks)."""
        params = self._params(seq)
        if not params.get("do_remote_prefill") or seq.seq_id in self._recv_seq_ids:
            return 0, False
        self._lookup[seq.seq_id] = num_computed_tokens
        count = len(seq) - 1 - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, seq: Sequence, block_ids: SequenceABC[int],
                                 num_external_tokens: int) -> None:
        """Decode side: plan the load of the blocks after the local hit (or, with nothing to
        load, a read request for no block: the prefill side frees its copy)."""
        if seq.seq_id not in self._lookup:
            return
        local = self._lookup.pop(seq.seq_id)
        params = self._params(seq)
        first = local // self.block_size
        last = cdiv(local + num_external_tokens, self.block_size) if num_external_tokens \
            else first
        self._recv_seq_ids.add(seq.seq_id)
        self._reqs_to_recv.append(RecvSpec(seq.seq_id, int(params["remote_engine_id"]),
                                           int(params["remote_request_id"]), first,
                                           list(block_ids[first:last])))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2PConnectorMetadata:
        meta = P2PConnectorMetadata(self._reqs_to_send, self._reqs_to_recv, self._reqs_to_drop)
        self._reqs_to_send, self._reqs_to_recv, self._reqs_to_drop = {}, [], []
        self._lookup = {}
        return meta

    def request_finished(self, seq: Sequence, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: a request capped by its ``max_tokens`` keeps its blocks for the
        decode engine and returns where to find them. Decode side: a request that ends while
        its load is under way drops the load (its blocks are freed now; the copy never
        happens)."""
        params = self._params(seq)
        if self.kv_role == "kv_consumer":
            self._recv_seq_ids.discard(seq.seq_id)
            self._reqs_to_drop.append(seq.seq_id)
            return False, None
        if not params.get("do_remote_decode") or \
                seq.status != SequenceStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None
        self._reqs_to_send[seq.seq_id] = list(block_ids)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.rank, "remote_request_id": seq.seq_id,
                      "remote_block_ids": list(block_ids)}

    # --------------------------------------------------------------- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take over the step's requests (their network effects wait for
        :meth:`serve_transfers`, between steps)."""
        super().bind_connector_metadata(connector_metadata)
        now = time.monotonic()
        for seq_id, ids in connector_metadata.reqs_to_send.items():
            self._held[seq_id] = (ids, now)
        self._to_start.extend(connector_metadata.reqs_to_recv)
        for seq_id in connector_metadata.reqs_to_drop:
            self._recving.pop(seq_id, None)
            self._to_start = [s for s in self._to_start if s.seq_id != seq_id]

    def start_load_kv(self, **kwargs: Any) -> None:
        """Nothing in the step: loads run on the peers' threads between steps."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Nothing: a request runs only once all its layers arrived (``get_finished``)."""

    def save_kv_layer(self, layer: int, kv_layer: KVCache, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing: the blocks are sent when a decode engine asks (:meth:`serve_transfers`)."""

    def wait_for_save(self) -> None:
        """Nothing to wait for in the step."""

    def get_finished(self, finished_req_ids: set[int]
                     ) -> tuple[set[int] | None, set[int] | None]:
        """(requests done sending, requests done receiving). Prefill side: sends the threads
        completed (or that failed: the decode engine is gone either way), and held requests no
        one asked for within ``abort_timeout_s``. Decode side: loads whose every layer
        arrived, copied now into the blocks allocated for them (the undo registered with the
        step's checkpoint), and failed loads, whose blocks :meth:`get_block_ids_with_load_errors`
        reports."""
        if self.kv_role == "kv_producer":
            return self._finished_sending() or None, None
        done: set[int] = set()
        for seq_id, t in list(self._recving.items()):
            if not t.done:
                continue
            del self._recving[seq_id]
            done.add(seq_id)
            if t.error is not None or t.status != STATUS_OK:
                self.num_failed_recvs += 1
                self._load_errors.update(t.spec.block_ids)
                self._event("load failed", seq_id)
                continue
            self._copy_in(t)
            self.num_recv_blocks += len(t.spec.block_ids)
            self._event("loaded", seq_id)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _finished_sending(self) -> set[int]:
        done = set()
        with self._inbox_lock:
            sent = list(self._sent)
        for t in sent:
            if t.request_id in self._held and t.request_id not in self._reported:
                self._reported.add(t.request_id)
                del self._held[t.request_id]
                done.add(t.request_id)
                if t.error is None:
                    self.num_sent_blocks += t.buffers[0].shape[1] if t.buffers else 0
                    self._event("sent, blocks freed", t.request_id)
                else:
                    self.num_failed_sends += 1
                    self._event("send failed, blocks freed", t.request_id)
        for seq_id in list(self._released):
            if seq_id in self._held and seq_id not in self._in_flight and \
                    seq_id not in self._reported:
                self._reported.add(seq_id)
                del self._held[seq_id]
                self.num_aborted += 1
                done.add(seq_id)
                self._event("released, blocks freed", seq_id)
        now = time.monotonic()
        for seq_id, (_, since) in list(self._held.items()):
            if now - since > self.abort_timeout_s and not self._serving(seq_id):
                del self._held[seq_id]
                self.num_aborted += 1
                done.add(seq_id)
                self._event("not asked for in time, blocks freed", seq_id)
        return done

    def _serving(self, seq_id: int) -> bool:
        return seq_id in self._in_flight

    def _copy_in(self, t: _Transfer) -> None:
        """Copy a finished load into the paged cache; a failed step puts the blocks back."""
        idx = torch.tensor(t.spec.block_ids, dtype=torch.int64)
        if not len(idx):
            return
        saved = []
        for (k, v), buf in zip(self.kv_caches, t.buffers, strict=True):
            i = idx.to(k.device)
            saved.append((k.index_select(0, i), v.index_select(0, i)))
            k.index_copy_(0, i, buf[0].to(k.device))
            v.index_copy_(0, i, buf[1].to(v.device))
        if self._in_step():
            def put_back() -> None:
                for (k, v), (ks, vs) in zip(self.kv_caches, saved, strict=True):
                    k.index_copy_(0, idx.to(k.device), ks)
                    v.index_copy_(0, idx.to(v.device), vs)
            self.checkpoint.on_rollback(put_back)

    def close(self) -> None:
        """Stop the peers' threads once their queued transfers are done (a process that ends
        need not call it; an engine dropped inside a process that goes on should). A thread
        waiting for a read request stops when the transport's ``recv`` raises."""
        for peer in self._peers.values():
            peer.submit(None)

    # ------------------------------------------------------- between steps
    def release(self, request_ids: SequenceABC[int]) -> None:
        """Prefill side, between steps: no decode engine will ask for these held requests
        (the proxy gave up on them: their decode engine died and none is left); their blocks
        are freed at the next step, as an abort timeout would."""
        self._released.extend(int(r) for r in request_ids)

    def busy(self) -> bool:
        """Transfers under way or blocks held: the engine must keep stepping to report
        them, even with no request to run."""
        return bool(self._reqs_to_send or self._held or self._recving or self._to_start
                    or self._inbox)

    @property
    def num_held_requests(self) -> int:
        """Prefill side: requests whose blocks wait for a decode engine."""
        return len(self._held.keys() | self._reqs_to_send.keys())

    def serve_transfers(self) -> None:
        """Between steps (the process's loop calls it): decode side, send the read requests of
        the loads the last steps planned; prefill side, answer the read requests that came in
        (gather the blocks, queue the send), or say a request is gone."""
        if self.kv_role == "kv_consumer":
            for spec in self._to_start:
                self._tag_and_submit(spec)
            self._to_start = []
            return
        now = time.monotonic()
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
            self._sent = [t for t in self._sent if t.request_id not in self._reported]
            self._released = [r for r in self._released if r not in self._reported]
        for peer, (req_id, tag, first, num), since in inbox:
            t = _Transfer(peer, tag, request_id=req_id)
            if req_id in self._held and not self._serving(req_id):
                ids = self._held[req_id][0]
                if first < 0 or num < 0 or first + num > len(ids):
                    t.status, t.request_id = STATUS_GONE, -1
                else:
                    t.buffers = self._gather(ids[first:first + num]) if num else []
                    self._in_flight.add(req_id)
                    self._event("send", req_id)
            elif now - since < self.abort_timeout_s and req_id not in self._reported:
                with self._inbox_lock:          # not bound yet: the next step binds it
                    self._inbox.append((peer, [req_id, tag, first, num], since))
                continue
            else:
                t.status, t.request_id = STATUS_GONE, -1
            self._peers[peer].submit(t)

    def _tag_and_submit(self, spec: RecvSpec) -> None:
        layout = self.layout
        tag = self._next_tag * (layout.num_layers + 1) + CTRL_TAG + 1
        self._next_tag += 1
        n = len(spec.block_ids)                # none: the prefill side frees its copy
        t = _Transfer(spec.remote_rank, tag, spec=spec, buffers=[
            torch.empty((2, n, layout.block_size, layout.num_kv_heads, layout.head_dim),
                        dtype=self.kv_caches[0][0].dtype, device=self._buffer_device())
            for _ in range(layout.num_layers)] if n else [])
        self._recving[spec.seq_id] = t
        self._event("read request", spec.seq_id)
        peer = self._peers.get(spec.remote_rank)
        if peer is None:
            t.error, t.done = f"rank {spec.remote_rank} is not a prefill engine", True
            return
        peer.submit(t)

    def _buffer_device(self) -> torch.device:
        """Where the layer messages' buffers live: the cache's device for NCCL, else the CPU
        (gloo moves CPU tensors: the layers are staged through CPU memory)."""
        if self.data_backend == "nccl":
            return self.kv_caches[0][0].device
        return torch.device("cpu")

    def _gather(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Per layer, K and V of ``block_ids`` in one contiguous tensor ``[2, n, bs, h, d]``,
        on :meth:`_buffer_device` (``.to`` is a no-op where the cache already is)."""
        out = []
        where = self._buffer_device()
        for k, v in self.kv_caches:
            i = torch.tensor(block_ids, dtype=torch.int64, device=k.device)
            out.append(torch.stack([k.index_select(0, i), v.index_select(0, i)]).to(where))
        return out

    def _data_group(self, peer: int) -> tuple[Any, str]:
        """The group of the layer messages with ``peer`` (None: the world group), and its
        name in :attr:`layer_messages`."""
        if self.data_groups is None:
            return None, "world"
        a, b = sorted((self.rank, peer))
        return self.data_groups[peer], f"pair {a}-{b}"

    def _count_layer(self, name: str) -> None:
        with self._inbox_lock:
            self.layer_messages[name] = self.layer_messages.get(name, 0) + 1

    @staticmethod
    def _wait_for_device(buffers: list[torch.Tensor]) -> None:
        """Block until the GPU has done the messages queued on these buffers. NCCL's send and
        receive return once queued on a CUDA stream (and ``wait()`` makes the current stream
        wait, not the CPU); nothing to do for CPU buffers, whose gloo messages are done when
        the call returns."""
        if buffers and buffers[0].is_cuda:
            torch.cuda.current_stream(buffers[0].device).synchronize()

    # -------------------------------------------------------------- the threads
    def _listen(self, peer: int) -> None:
        """Prefill side: receive read requests from one decode engine, forever."""
        msg = torch.zeros(4, dtype=torch.int64)
        while True:
            try:
                self.transport.recv(msg, src=peer, tag=CTRL_TAG)
            except Exception as exc:                  # the peer is gone
                self._peers[peer].dead = f"{type(exc).__name__}: {exc}"
                return
            with self._inbox_lock:
                self._inbox.append((peer, msg.tolist(), time.monotonic()))

    def _send_work(self, t: _Transfer) -> None:
        """Prefill side, on the peer's thread: the status (world group), then one message per
        layer (the pair's group), then the GPU's work waited for."""
        group, name = self._data_group(t.peer)
        try:
            self.transport.send(torch.tensor([t.status, len(t.buffers)], dtype=torch.int64),
                                t.peer, tag=t.tag)
            for layer, buf in enumerate(t.buffers):
                self.transport.send(buf, t.peer, tag=t.tag + 1 + layer, group=group)
                self._count_layer(name)
                self._maybe_exit(layer + 1)
            self._wait_for_device(t.buffers)
        except Exception as exc:            # set before the send is reported, below
            t.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if t.request_id >= 0:
                with self._inbox_lock:
                    self._sent.append(t)
                    self._in_flight.discard(t.request_id)

    def _recv_work(self, t: _Transfer) -> None:
        """Decode side, on the peer's thread: the read request and the status (world group),
        the layers (the pair's group), then the GPU's work waited for: only then is the
        transfer done (``_PeerThread`` sets ``done`` when this returns)."""
        spec = t.spec
        group, name = self._data_group(t.peer)
        self.transport.send(torch.tensor([spec.remote_request_id, t.tag, spec.first_block,
                                          len(spec.block_ids)], dtype=torch.int64),
                            t.peer, tag=CTRL_TAG)
        status = torch.zeros(2, dtype=torch.int64)
        self.transport.recv(status, src=t.peer, tag=t.tag)
        t.status = int(status[0])
        if t.status != STATUS_OK:
            return
        for layer, buf in enumerate(t.buffers):
            self.transport.recv(buf, src=t.peer, tag=t.tag + 1 + layer, group=group)
            self._count_layer(name)
            self._maybe_exit(layer + 1)
        self._wait_for_device(t.buffers)

    def _maybe_exit(self, layers_done: int) -> None:
        if self.exit_after_layers is not None and layers_done >= self.exit_after_layers:
            os._exit(3)                                   # fault injection: killed mid-transfer

    def _event(self, what: str, seq_id: int) -> None:
        self.events.append((time.monotonic(), what, seq_id))

    def check_invariants(self) -> None:
        """A request held for sending keeps its blocks in the manager until reported sent."""
        assert not (set(self._held) & self._reported), "a request reported sent is still held"
        if self.kv_cache_manager is not None:
            kept = set(self.kv_cache_manager.delayed_frees)
            assert set(self._held) <= kept, \
                f"held requests {sorted(set(self._held) - kept)} have no blocks kept"
