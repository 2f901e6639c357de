"""Prefill/decode disaggregation's KV connector: a prefill engine's blocks sent to a decode
engine's blocks. This module is the protocol: what is asked for, held, released, and when a
transfer is done or failed; the messages themselves travel by
:class:`~course_lib.engine.p2p_transport.P2PTransport` (threads and ``torch.distributed``: the
control on the gloo world group, the K/V on a group of the two engines alone).

**The protocol is vLLM 0.33.0's NIXL connector's** (``vllm/distributed/kv_transfer/
kv_connector/v1/nixl/``: ``pull_scheduler.py`` for the scheduler side, ``pull_worker.py``
and ``base_worker.py`` for the transfers; ``worker.py`` only re-exports them), with its names:

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
   the prefix cache until they are filled (``delay_cache_blocks``). Once its blocks are
   allocated, the request's ``do_remote_prefill`` is turned off, as NIXL's
   ``update_state_after_alloc`` does ("only trigger 1 KV transfer per request"): a request
   computed again later (a preemption, a recovery) computes everything itself.
3. The decode side asks the prefill engine for the blocks (a *read request*); they arrive layer
   by layer and are copied into the blocks it allocated; ``get_finished`` reports the request
   done receiving and it runs: it computes the prompt's last token (for the logits) and
   decodes. The prefill side reports the request done sending once its send completed, and
   only then are its blocks freed.

What differs from NIXL, and why:

* **Two-sided messages instead of one-sided reads.** NIXL's decode side *reads* the prefill
  side's GPU memory and notifies it when done; ``torch.distributed`` has no one-sided read, so
  the decode side asks and the prefill side answers with a status, then the layers
  (:mod:`course_lib.engine.p2p_transport`). A read request for no block is the protocol's
  *release*: the prefill side answers and frees the request's blocks, as NIXL's notification
  for a full local hit or an aborted request does (``pull_worker.py``: "full local hits and
  aborted cleanup only notify P").
* **Network effects between steps.** What a step decides (blocks held, loads planned, loads
  dropped) is carried out by :meth:`P2PConnector.serve_transfers`, which the process's loop
  calls between steps; a step itself sends nothing.
* **The decode side loads ``len(prompt) - 1`` tokens** and computes the last one, as the
  course's connector contract says; vLLM 0.33.0 loads all of them and then backs
  ``num_computed_tokens`` off by one (``_update_waiting_for_remote_kv`` in
  ``vllm/v1/core/sched/scheduler.py``): the same tokens are computed.
* **Blocks delayed only after ``max_tokens``.** A prefill request that stopped on its own
  (end of sequence as its first token) is finished: nothing follows, so its blocks are freed
  at once (vLLM delays on either status).

Failures: a transfer whose peer died fails (the transport's error), and so does one that
takes longer than ``transfer_timeout_s`` (a peer that stopped answering). A failed send frees the
prefill side's blocks; a failed load (or a prefill side that answers that the blocks are gone)
reports the decode side's blocks in :meth:`P2PConnector.get_block_ids_with_load_errors`, and the
V1 scheduler computes those tokens itself (vLLM's ``kv_load_failure_policy="recompute"``;
vLLM's default is ``"fail"``, which fails the request: ``vllm/config/kv_transfer.py``).
Blocks no decode engine asks for within ``abort_timeout_s`` are freed (vLLM 0.33.0 bounds
them by a lease instead: ``kv_lease_duration``, 30 s, renewed by the decode side's heartbeats,
``nixl/base_scheduler.py``; it replaced ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``). A decode request
that ends before its read request left sends a release instead. Two engines whose caches
differ in block size, dtype, layer count or head shape are refused when they connect
(:meth:`P2PConnector.connect`).

**Recovery** (:meth:`P2PConnector.reset_cache`, after a failed step; the engine then rebuilds
its KV bookkeeping empty and recomputes every unfinished request):

* decode side: a request waiting for remote K/V is computed here instead. Its read request,
  if it has not left, becomes a release (the prefill side frees its blocks, as on an abort);
  one under way finishes on its thread (the prefill side frees after its send) and what
  arrives is not copied (its blocks belong to the thrown-away pool). The connector remembers
  the request as abandoned and never asks for its blocks again (its ``do_remote_prefill`` may
  be on again: the recovery puts a request's parameters back as they were after the last
  completed step, before step 2 turned it off);
* prefill side: the blocks held for decode engines are gone with the rebuilt pool, and the
  requests are forgotten. A read request for a request this side does not hold (nor is about
  to hold) is answered that the blocks are gone: between steps every request whose blocks a
  decode engine may ask for is held or about to be, unless its blocks were freed (sent,
  released, timed out) or thrown away by a recovery. So a read request for one of them,
  waiting or still to come, fails on the decode side, which recomputes (its load-failure
  path), and nothing is gathered from the new pool's blocks for it. A send under way goes on:
  its layers were copied out before the fault.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..scheduler.output import KVConnectorMetadata
from ..sequence import SequenceStatus, finite_float, is_int
from ..sizing.units import cdiv
from .kv_connector import KVConnectorBase_V1, KVConnectorRole
from .p2p_transport import P2PTransport, ReadRequest, Transfer

if TYPE_CHECKING:
    from ..memory.v1.kv_cache_manager import KVCacheManager
    from ..model.attention import AttentionMetadata
    from ..model.llama import KVCache
    from ..scheduler.output import SchedulerOutput
    from ..sequence import Sequence

STATUS_OK, STATUS_GONE = 1, 2               # a read request's answer
KV_ROLES = ("kv_producer", "kv_consumer")   # vLLM's kv_role values (kv_both is not built)
#: the fields of ``kv_transfer_params`` the connector reads (module docstring, steps 1-2)
KV_TRANSFER_FIELDS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id",
                      "remote_request_id", "remote_block_ids")
MAX_REQUEST_ID = 2 ** 63                     # ids travel as int64 (a read request's tensor)


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


class P2PConnector(KVConnectorBase_V1):
    """The prefill (``kv_role="kv_producer"``) or decode (``"kv_consumer"``) side of a
    disaggregated deployment (module docstring). ``transport``: this engine's
    :class:`~course_lib.engine.p2p_transport.P2PTransport` (its rank in the world of all
    engines, the groups and backend its messages use). ``abort_timeout_s``: how long the
    prefill side holds blocks no decode engine asks for. ``transfer_timeout_s``: how long a
    transfer may take once asked for; one that takes longer fails (decode side: its tokens are
    computed here; prefill side: its blocks are freed, the layers it copied out go on being
    sent), so that no request waits longer on a peer that stopped answering, whatever the
    transport's own timeouts. Each a finite number of seconds > 0 (any real number, kept as a
    float). A request's ``kv_transfer_params`` are checked for the role at the engine's door
    (:meth:`check_kv_transfer_params`)."""

    def __init__(self, kv_role: str, transport: P2PTransport, *,
                 abort_timeout_s: float = 120.0, transfer_timeout_s: float = 30.0) -> None:
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {kv_role!r}")
        if not isinstance(transport, P2PTransport):
            raise ValueError(f"transport must be a P2PTransport, got {transport!r}")
        seconds = {}
        for name, value in (("abort_timeout_s", abort_timeout_s),
                            ("transfer_timeout_s", transfer_timeout_s)):
            try:                             # any real number, by value, kept as a float
                seconds[name] = finite_float(value, name)
            except ValueError:
                seconds[name] = 0.0
            if not seconds[name] > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r:.60}")
        super().__init__(KVConnectorRole.SCHEDULER)
        self.kv_role = kv_role
        self.transport = transport
        self.abort_timeout_s = seconds["abort_timeout_s"]
        self.transfer_timeout_s = seconds["transfer_timeout_s"]
        self.block_size = 0
        self.layout: KVLayout | None = None
        self.peer_layouts: dict[int, KVLayout] = {}
        # scheduler side, per step (reset by build_connector_meta)
        self._lookup: dict[int, int] = {}              # seq_id -> its local hit (tokens)
        self._reqs_to_send: dict[int, list[int]] = {}
        self._reqs_to_recv: list[RecvSpec] = []
        self._reqs_to_drop: list[int] = []
        # the last metadata built, and the last one the worker side took over: a reset
        # releases the loads a failed step built but never bound
        self._built: P2PConnectorMetadata | None = None
        self._bound: P2PConnectorMetadata | None = None
        # worker side, prefill
        self._held: dict[int, tuple[list[int], float]] = {}   # id -> its blocks, since when
        self._asked: list[ReadRequest] = []        # for requests not held yet, or being sent
        self._sending: dict[int, Transfer] = {}    # id -> its send under way
        self._released: list[int] = []             # ids the proxy let go
        # worker side, decode
        self._to_start: list[RecvSpec] = []        # read requests to send (no block: release)
        self._recving: dict[int, tuple[RecvSpec, Transfer]] = {}   # seq_id -> its load
        self._load_errors: set[int] = set()
        # decode: requests whose remote blocks a reset released or let go: computed here,
        # whatever their parameters say (kept across resets: it is what they remember)
        self._abandoned: set[int] = set()
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
        all-gather over the world) and each checks the engines of the other role; a
        difference raises ``ValueError`` naming the ranks and the field, on every rank, before
        anything is sent (NIXL's handshake compares the same). ``roles``: rank -> kv_role, for
        every rank of the world. Then the transport starts its threads."""
        if self.layout is None:
            raise RuntimeError("register_kv_caches first: the engine does it when built")
        world, rank = self.transport.world_size(), self.transport.rank
        if sorted(roles) != list(range(world)) or roles.get(rank) != self.kv_role:
            raise ValueError(f"roles must name every rank 0..{world - 1}, this one "
                             f"({rank}) as {self.kv_role!r}; got {roles!r}")
        gathered = self.transport.all_gather((self.kv_role, self.layout))
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
        self.transport.start(sorted(self.peer_layouts), serve=self.kv_role == KV_ROLES[0],
                             cache_device=self.kv_caches[0][0].device)

    # ------------------------------------------------------------ scheduler side
    def _params(self, seq: Sequence) -> dict:
        return seq.kv_transfer_params or {}

    def check_kv_transfer_params(self, kv_transfer_params: dict) -> dict:
        """The door (``LLMEngine.add_request``; the contract is the base class's): only the
        fields the protocol knows (``KV_TRANSFER_FIELDS``; a typo would silently compute
        everything here), ``do_remote_decode`` / ``do_remote_prefill`` bools, each for the
        role that acts on it; with ``do_remote_prefill`` (a decode engine) the fields step 3
        reads: ``remote_engine_id``, the rank of a prefill engine this one met at
        :meth:`connect` (any other rank 0..2**63 before it), ``remote_request_id`` an int in
        ``[0, 2**63)`` (both travel in an int64 read request), and ``remote_block_ids``, a
        list of block ids >= 0, at least one (what the prefill engine returned; the course
        reads its count from the blocks the prefill side holds). A copy with plain Python
        values is returned. vLLM 0.33.0's NIXL connector finds missing fields only when it
        allocates (``update_state_after_alloc`` in ``nixl/pull_scheduler.py``: "Got invalid
        KVTransferParams", logged, and the request computes everything itself); here, without
        the check, they failed every step (the recovery recomputes with the same
        parameters)."""
        params = dict(kv_transfer_params)
        unknown = sorted(map(str, params.keys() - set(KV_TRANSFER_FIELDS)))
        if unknown:
            raise ValueError(f"kv_transfer_params has {unknown}; P2PConnector reads "
                             f"{list(KV_TRANSFER_FIELDS)}")
        for name in ("do_remote_decode", "do_remote_prefill"):
            if name in params:
                if not isinstance(params[name], (bool, np.bool_)):
                    raise ValueError(f"kv_transfer_params: {name!r} must be a bool, got "
                                     f"{params[name]!r:.60}")
                params[name] = bool(params[name])
        if params.get("do_remote_prefill") and self.kv_role == "kv_producer":
            raise ValueError("a prefill engine (kv_producer) loads no blocks: "
                             "'do_remote_prefill' must be False here (send the request with "
                             "it to a decode engine)")
        if params.get("do_remote_decode") and self.kv_role == "kv_consumer":
            raise ValueError("a decode engine (kv_consumer) sends no blocks: "
                             "'do_remote_decode' must be False here (send the request with it "
                             "to a prefill engine)")
        if not params.get("do_remote_prefill"):
            return params
        rank = self.transport.rank
        prefill = sorted(self.peer_layouts)
        engine = params.get("remote_engine_id")
        if not is_int(engine) or (engine not in prefill if prefill else
                                  not 0 <= engine < MAX_REQUEST_ID or engine == rank):
            where = f"one of {prefill}" if prefill else f"an int >= 0, not this one ({rank})"
            raise ValueError(f"kv_transfer_params: 'remote_engine_id' must be the rank of a "
                             f"prefill engine ({where}), got {engine!r:.60}")
        request = params.get("remote_request_id")
        if not is_int(request) or not 0 <= request < MAX_REQUEST_ID:
            raise ValueError(f"kv_transfer_params: 'remote_request_id' must be an int in "
                             f"[0, 2**63), got {request!r:.60}")
        blocks = params.get("remote_block_ids")
        try:
            if isinstance(blocks, (str, bytes)):
                raise TypeError
            ids = list(blocks)
        except TypeError:
            raise ValueError(f"kv_transfer_params: 'remote_block_ids' must be a list of block "
                             f"ids (ints >= 0, at least one), got {blocks!r:.60}") from None
        bad = next((i for i, b in enumerate(ids) if not is_int(b) or b < 0), None)
        if bad is not None or not ids:
            item = f"; item {bad} is {ids[bad]!r:.60}" if bad is not None else ""
            raise ValueError(f"kv_transfer_params: 'remote_block_ids' must be a list of block "
                             f"ids (ints >= 0, at least one), got {blocks!r:.60}{item}")
        params.update(remote_engine_id=int(engine), remote_request_id=int(request),
                      remote_block_ids=[int(b) for b in ids])
        return params

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Decode side: a request with ``do_remote_prefill`` gets the prompt's tokens past its
        local hit from the prefill engine, asynchronously (at most ``len - 1``: the last is
        computed here, for its logits); none for a request a reset abandoned."""
        if not self._params(seq).get("do_remote_prefill") or seq.seq_id in self._abandoned:
            return 0, False
        self._lookup[seq.seq_id] = num_computed_tokens
        count = len(seq) - 1 - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, seq: Sequence, block_ids: SequenceABC[int],
                                 num_external_tokens: int) -> None:
        """Decode side: plan the load of the blocks after the local hit (or, with nothing to
        load, a release: the prefill side frees its copy), and turn the request's
        ``do_remote_prefill`` off: one transfer per request (module docstring, step 2; a copy
        of the parameters, which are the caller's)."""
        if seq.seq_id not in self._lookup:
            return
        local = self._lookup.pop(seq.seq_id)
        params = self._params(seq)
        seq.kv_transfer_params = {**params, "do_remote_prefill": False}
        first = local // self.block_size
        last = cdiv(local + num_external_tokens, self.block_size) if num_external_tokens \
            else first
        self._reqs_to_recv.append(RecvSpec(seq.seq_id, int(params["remote_engine_id"]),
                                           int(params["remote_request_id"]), first,
                                           list(block_ids[first:last])))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2PConnectorMetadata:
        meta = P2PConnectorMetadata(self._reqs_to_send, self._reqs_to_recv, self._reqs_to_drop)
        self._reqs_to_send, self._reqs_to_recv, self._reqs_to_drop = {}, [], []
        self._lookup = {}
        self._built = meta
        return meta

    def request_finished(self, seq: Sequence, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: a request capped by its ``max_tokens`` keeps its blocks for the
        decode engine and returns where to find them. Decode side: a request that ends while
        its load is under way drops the load (its blocks are freed now; the copy never
        happens; a read request not sent yet becomes a release); one that ends before its
        blocks were allocated (``do_remote_prefill`` still on: aborted while waiting) sends a
        release, so that the prefill engine frees its copy at once, not after
        ``abort_timeout_s`` (vLLM 0.33.0's ``request_finished`` in ``nixl/pull_scheduler.py``
        adds an empty read for it, "to avoid stranding the prefill blocks")."""
        params = self._params(seq)
        if self.kv_role == "kv_consumer":
            if params.get("do_remote_prefill") and seq.seq_id not in self._abandoned:
                seq.kv_transfer_params = {**params, "do_remote_prefill": False}
                self._reqs_to_recv.append(RecvSpec(seq.seq_id, int(params["remote_engine_id"]),
                                                   int(params["remote_request_id"]), 0, []))
                return False, None
            self._reqs_to_drop.append(seq.seq_id)
            return False, None
        if not params.get("do_remote_decode") or \
                seq.status != SequenceStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None
        self._reqs_to_send[seq.seq_id] = list(block_ids)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.transport.rank,
                      "remote_request_id": seq.seq_id, "remote_block_ids": list(block_ids)}

    # --------------------------------------------------------------- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take over the step's requests (their network effects wait for
        :meth:`serve_transfers`, between steps)."""
        super().bind_connector_metadata(connector_metadata)
        now = time.monotonic()
        for seq_id, ids in connector_metadata.reqs_to_send.items():
            self._held[seq_id] = (ids, now)
        self._to_start.extend(connector_metadata.reqs_to_recv)
        dropped = set(connector_metadata.reqs_to_drop)
        for seq_id in dropped:
            self._recving.pop(seq_id, None)
        self._to_start = [_release(s) if s.seq_id in dropped else s for s in self._to_start]
        self._bound = connector_metadata

    def start_load_kv(self, **kwargs: Any) -> None:
        """Nothing in the step: loads run on the transport's threads between steps."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Nothing: a request runs only once all its layers arrived (``get_finished``)."""

    def save_kv_layer(self, layer: int, kv_layer: KVCache, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing: the blocks are sent when a decode engine asks (:meth:`serve_transfers`)."""

    def wait_for_save(self) -> None:
        """Nothing to wait for in the step."""

    def get_finished(self, finished_req_ids: set[int]
                     ) -> tuple[set[int] | None, set[int] | None]:
        """(requests done sending, requests done receiving). Prefill side: sends that
        completed (or failed: the decode engine is gone either way), held requests the proxy
        released, and those no one asked for within ``abort_timeout_s``. Decode side: loads
        whose every layer arrived, copied now into the blocks allocated for them, and failed
        loads, whose blocks :meth:`get_block_ids_with_load_errors` reports."""
        if self.kv_role == "kv_producer":
            return self._finished_sending() or None, None
        done: set[int] = set()
        now = time.monotonic()
        for seq_id, (spec, t) in list(self._recving.items()):
            late = now - t.started > self.transfer_timeout_s
            if not t.done and not late:
                continue
            del self._recving[seq_id]       # a late one is let go: what arrives is not copied
            done.add(seq_id)
            if not t.done or t.error is not None or t.status != STATUS_OK:
                self.num_failed_recvs += 1
                self._load_errors.update(spec.block_ids)
                self._event("load failed", seq_id)
                continue
            self._copy_in(spec, t.buffers)
            self.num_recv_blocks += len(spec.block_ids)
            self._event("loaded", seq_id)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _finished_sending(self) -> set[int]:
        """Prefill side: the held requests whose blocks are freed now (reported by
        ``get_finished``); a later read request for one is told they are gone
        (:meth:`serve_transfers`)."""
        done, now = set(), time.monotonic()
        for req_id, t in list(self._sending.items()):
            if not t.done and now - t.started <= self.transfer_timeout_s:
                continue
            del self._sending[req_id]       # a late one is let go: it sends copies (_gather)
            del self._held[req_id]
            done.add(req_id)
            if t.done and t.error is None:
                self.num_sent_blocks += t.num_blocks
                self._event("sent, blocks freed", req_id)
            else:
                self.num_failed_sends += 1
                self._event("send failed, blocks freed", req_id)
        for req_id in self._released:
            if req_id in self._held and req_id not in self._sending:
                del self._held[req_id]
                self.num_aborted += 1
                done.add(req_id)
                self._event("released, blocks freed", req_id)
        self._released = [r for r in self._released if r in self._held or
                          r in self._reqs_to_send]      # (one being sent: once it is sent)
        for req_id, (_, since) in list(self._held.items()):
            if now - since > self.abort_timeout_s and req_id not in self._sending:
                del self._held[req_id]
                self.num_aborted += 1
                done.add(req_id)
                self._event("not asked for in time, blocks freed", req_id)
        return done

    def _copy_in(self, spec: RecvSpec, buffers: list[torch.Tensor]) -> None:
        """Copy a finished load (per layer ``[2, n, bs, h, d]``) into the paged cache."""
        idx = torch.tensor(spec.block_ids, dtype=torch.int64)
        for (k, v), buf in zip(self.kv_caches, buffers, strict=True):
            i = idx.to(k.device)
            k.index_copy_(0, i, buf[0].to(k.device))
            v.index_copy_(0, i, buf[1].to(v.device))

    # ------------------------------------------------------- between steps
    def release(self, request_ids: SequenceABC[int]) -> None:
        """Prefill side, between steps: no decode engine will ask for these held requests
        (the proxy gave up on them: their decode engine died and none is left); their blocks
        are freed at the next step, as an abort timeout would."""
        self._released.extend(int(r) for r in request_ids)

    def busy(self) -> bool:
        """Transfers under way, blocks held or read requests unanswered: the engine must keep
        stepping to report them, even with no request to run."""
        return bool(self._reqs_to_send or self._held or self._recving or self._to_start
                    or self._asked)

    @property
    def num_held_requests(self) -> int:
        """Prefill side: requests whose blocks wait for a decode engine."""
        return len(self._held.keys() | self._reqs_to_send.keys())

    def serve_transfers(self) -> None:
        """Between steps (the process's loop calls it): decode side, send the read requests
        (and releases) the last steps planned; prefill side, answer the read requests that
        came in (gather the blocks, send them), or say a request's blocks are gone."""
        if self.kv_role == "kv_consumer":
            for spec in self._to_start:
                self._start_read(spec)
            self._to_start = []
            return
        asked, self._asked = self._asked + self.transport.read_requests(), []
        for r in asked:
            held = self._held.get(r.request_id)
            if held is not None and r.request_id not in self._sending:
                ids = held[0]
                if r.first_block < 0 or r.num_blocks < 0 or \
                        r.first_block + r.num_blocks > len(ids):
                    self.transport.answer(r, STATUS_GONE, [])
                    continue
                buffers = self._gather(ids[r.first_block:r.first_block + r.num_blocks]) \
                    if r.num_blocks else []
                self._sending[r.request_id] = self.transport.answer(r, STATUS_OK, buffers)
                self._event("send", r.request_id)
            elif held is not None or r.request_id in self._reqs_to_send:
                self._asked.append(r)      # being sent, or held from the next step on
            else:                          # freed, or thrown away by a recovery
                self.transport.answer(r, STATUS_GONE, [])

    def _start_read(self, spec: RecvSpec) -> None:
        """Decode side: the read request of ``spec`` (no block: a release, not followed)."""
        layout, n = self.layout, len(spec.block_ids)
        where = self.transport.staging_device(self.kv_caches[0][0].device)
        buffers = [torch.empty((2, n, layout.block_size, layout.num_kv_heads, layout.head_dim),
                               dtype=self.kv_caches[0][0].dtype, device=where)
                   for _ in range(layout.num_layers)] if n else []
        t = self.transport.read(spec.remote_rank, spec.remote_request_id, spec.first_block, n,
                                buffers)
        if n:
            self._recving[spec.seq_id] = (spec, t)
        self._event("read request" if n else "release", spec.seq_id)

    def _gather(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Per layer, K and V of ``block_ids`` in one contiguous tensor ``[2, n, bs, h, d]``,
        on the transport's staging device (``.to`` is a no-op where the cache already is)."""
        out = []
        where = self.transport.staging_device(self.kv_caches[0][0].device)
        for k, v in self.kv_caches:
            i = torch.tensor(block_ids, dtype=torch.int64, device=k.device)
            out.append(torch.stack([k.index_select(0, i), v.index_select(0, i)]).to(where))
        return out

    # ------------------------------------------------------------------ recovery
    def reset_cache(self) -> None:
        """After a failed step (module docstring, *Recovery*; the contract:
        :meth:`~course_lib.scheduler.kv_connector.KVConnectorScheduler.reset_cache`). Prefill
        side: the requests held, or about to be, are forgotten (a read request for one is
        then answered that its blocks are gone), their sends under way left to finish
        unwatched; the read requests received stay, to be answered. Decode side: every load
        whose read request has not left becomes a release (a failed step's too, built but
        never bound), every load under way is let go, and their requests are remembered as
        abandoned: they are computed here, even where the recovery gave them back the
        ``do_remote_prefill`` of their last completed step. The counters keep their
        totals."""
        super().reset_cache()
        self._held, self._reqs_to_send, self._sending, self._released = {}, {}, {}, []
        unsent = self._reqs_to_recv + self._to_start
        if self._built is not None and self._built is not self._bound:
            unsent += self._built.reqs_to_recv          # built by the failed step, not bound
        self._to_start = list({s.seq_id: _release(s) for s in unsent}.values())
        self._abandoned.update(s.seq_id for s in unsent)
        self._abandoned.update(self._recving)
        self._reqs_to_recv, self._reqs_to_drop, self._lookup = [], [], {}
        self._built = self._bound = None
        self._recving, self._load_errors = {}, set()

    def _event(self, what: str, seq_id: int) -> None:
        self.events.append((time.monotonic(), what, seq_id))

    def check_invariants(self) -> None:
        """A request held for sending keeps its blocks in the manager until reported sent;
        a send under way is a held request's."""
        assert self._sending.keys() <= self._held.keys(), "a send for a request not held"
        if self.kv_cache_manager is not None:
            kept = set(self.kv_cache_manager.delayed_frees)
            assert set(self._held) <= kept, \
                f"held requests {sorted(set(self._held) - kept)} have no blocks kept"


def _release(spec: RecvSpec) -> RecvSpec:
    """The release of ``spec``'s remote blocks: a read request for no block."""
    return RecvSpec(spec.seq_id, spec.remote_rank, spec.remote_request_id, 0, [])
