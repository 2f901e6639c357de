"""Twins for the CPU offload tier (tests/fidelity/harness.py): the course's
``course_lib.engine.cpu_offload.CPUOffloadConnector`` under the course's ``SchedulerV1``, and
vLLM 0.33.0's offloading connector, scheduler side (``OffloadingConnectorScheduler`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``, with its CPU manager,
``CPUOffloadingManager`` in ``vllm/v1/kv_offload/cpu/manager.py``, default ``lru`` policy) under
vLLM's own ``Scheduler`` (upstream.load_vllm_offloading), driven by one :class:`OffloadTrace`.

**Both sides as shipped.** The course's tier is the class the engine builds
(``load_async=True``: vLLM's offloading connector loads asynchronously by default, its
``sync_load_budget_bytes`` being 0; ``offload_prompt_only`` at its default, True, as vLLM's).
vLLM's is its real ``OffloadingConnectorScheduler`` over its real ``CPUOffloadingManager``,
behind a connector that forwards the scheduler's calls as ``OffloadingConnector``
(``offloading_connector.py``) does for a model with one full-attention group (no bounding
group: ``max_num_new_tokens`` None). Its spec (:func:`real_connector_class`) is vLLM's
``OffloadingSpec`` base with ``get_manager`` building the manager as ``CPUOffloadingSpec``
(``vllm/v1/kv_offload/cpu/spec.py``) does with an empty ``extra_config`` (``lru``,
``store_threshold`` 0, one block a chunk, a hash a block), sized in chunks rather than bytes.

**The worker side, simulated.** Every transfer a step plans is reported done at that step's
end: vLLM's, through ``KVConnectorOutput`` (``OffloadingWorkerMetadata.completed_jobs``, and the
asynchronous loads' requests in ``finished_recving``); the course's through its own worker
side (``wait_for_save`` then ``get_finished``, the copies themselves left out: no tensors).
That is the course's timing (its copies run inside the step, declared in cpu_offload.py);
vLLM's worker defers a step's stores to the next step's submission, so there a store becomes
visible a step or more later: the comparison is of the two scheduler sides' decisions on the
same completions, not of the overlap.

**What is compared** after every operation: the scheduler's answer (requests scheduled with
their tokens, preempted, finished), the running queue, the waiting requests (as a set: the
scheduler harness compares the queues in full) and their computed tokens; and the tier's:
every lookup since the last operation (request, GPU hit, tokens answered: the hit lengths),
the blocks each request loads this step, the blocks the step stores, the blocks the tier
evicted this step, and every block the tier holds. A block is named by the tokens it closes
the prefix of (the two codes hash differently; :class:`Names` gives a tuple of tokens one
short id for both).
"""

from __future__ import annotations

import logging
import random
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

from harness import Mismatch, first_difference
from scheduler_twins import (
    _in_course_order,
    _StructuredOutputManager,
    random_ops,
    real_add_or_abort,
    scheduler_side_connector_base,
    token,
    vllm_config,
)

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.cpu_offload import CPUOffloadConnector
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams


# ------------------------------------------------------------------------------ the trace
@dataclass
class OffloadTrace:
    block_size: int
    num_blocks: int             # the course's GPU pool (vLLM's has one more: its null block)
    num_cpu_blocks: int         # the tier
    budget: int                 # max_num_batched_tokens
    max_num_seqs: int
    prompts: dict[int, list[int]]
    max_tokens: dict[int, int]
    ops: list[tuple]            # ("add", rid) | ("abort", rid) | ("step",)
    max_model_len: int = 256


def random_offload_trace(rng: random.Random, *, aligned_prompts: bool = False,
                         tight_tier: bool = False) -> OffloadTrace:
    """Requests sharing prefixes (a few bases; now and then a prompt sent again whole),
    arriving over time, a GPU pool small enough that cached blocks are evicted and asked for
    again, a tier that holds them all or (``tight_tier``) 8 to 20 blocks. A prompt's length is
    never a multiple of the block size unless ``aligned_prompts``: the course's tier looks up
    one token short (declared: ``test_the_course_tier_looks_up_one_token_short``), which
    shows only when a prompt's last block is full and held (a prompt sent again)."""
    bs = rng.choice((2, 4))
    n = rng.randint(2, 8)
    bases = [[rng.randint(1, 50) for _ in range(32)] for _ in range(rng.randint(1, 3))]
    prompts, max_tokens = {}, {}
    for rid in range(n):
        length = rng.randint(bs + 1, 28)
        if length % bs == 0 and not aligned_prompts:
            length += 1
        shared = min(length - 1, rng.randint(0, 24)) if rng.random() < 0.8 else 0
        prompts[rid] = rng.choice(bases)[:shared] + \
            [rng.randint(51, 99) for _ in range(length - shared)]
        if rid and rng.random() < 0.2:
            prompts[rid] = list(prompts[rng.randrange(rid)])       # the same prompt again
        max_tokens[rid] = rng.randint(1, 6)
    ops = random_ops(rng, n, max_ops=50, abort_below=0.34)
    max_len = max(len(p) + max_tokens[r] for r, p in prompts.items())
    num_blocks = max(rng.randint(4, 24), -(-max_len // bs))      # each request fits alone
    num_cpu_blocks = rng.randint(8, 20) if tight_tier else 200
    return OffloadTrace(bs, num_blocks, num_cpu_blocks, rng.randint(4, 48),
                        rng.choice((1, 2, 4, 8)), prompts, max_tokens, ops)


class Names:
    """One short name per block content, shared by both twins of a trace: the token prefix a
    full block closes (block ``i`` of a sequence names its first ``(i + 1) * block_size``
    tokens; the cache salt and the multimodal inputs are absent in both)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, ...], int] = {}

    def __call__(self, prefix) -> int:
        return self.ids.setdefault(tuple(prefix), len(self.ids))


# ------------------------------------------------------------------------------ the course
class _RecordingCPUOffloadConnector(CPUOffloadConnector):
    """The course's tier, its lookups recorded (the answers unchanged)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookups: list[tuple] = []
        self.rid_of: dict[int, int] = {}

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        answer = super().get_num_new_matched_tokens(seq, num_computed_tokens)
        self.lookups.append((self.rid_of[seq.seq_id], num_computed_tokens, answer[0]))
        return answer


class CourseOffloadTwin:
    """The course's ``SchedulerV1`` with its CPU tier (``connector_cls``: a broken variant)."""

    def __init__(self, trace: OffloadTrace, names: Names,
                 connector_cls=CPUOffloadConnector) -> None:
        self.trace, self.names = trace, names
        recording = type("Recording", (_RecordingCPUOffloadConnector, connector_cls), {})
        self.conn = recording(trace.num_cpu_blocks, load_async=True)
        self.s = SchedulerV1(
            SchedulerConfig(max_num_seqs=trace.max_num_seqs,
                            max_num_batched_tokens=trace.budget,
                            max_model_len=trace.max_model_len),
            CacheConfig(trace.block_size, trace.num_blocks, 0, 0.0, True, "hash"),
            kv_connector=self.conn)
        self.seqs: dict[int, Any] = {}
        self.hash_name: dict[Any, int] = {}
        self.step_record: dict = {"loads": [], "stores": [], "evicted": []}
        self.seen: Counter = Counter()           # what the trace exercised

    def _name_hashes(self) -> None:
        bs = self.trace.block_size
        for seq in self.seqs.values():
            tokens = list(seq.token_ids)
            for i, h in enumerate(self.s.kv_cache_manager.req_to_block_hashes.get(seq.seq_id,
                                                                              ())):
                self.hash_name.setdefault(h, self.names(tokens[:(i + 1) * bs]))

    def apply(self, op: tuple) -> Any:
        kind = op[0]
        self.step_record = {"loads": [], "stores": [], "evicted": []}
        if kind == "add":
            rid = op[1]
            req = self.s.add_request(rid, self.trace.prompts[rid],
                                     SamplingParams(max_tokens=self.trace.max_tokens[rid]))
            self.seqs[rid] = req.seqs[0]
            self.conn.rid_of[req.seqs[0].seq_id] = rid
            return "added"
        if kind == "abort":
            return self.s.abort_request(op[1])
        pool, conn = self.conn.cpu_pool, self.conn
        before = set(pool.hash_to_block)
        out = self.s.schedule()
        self._name_hashes()
        meta = out.kv_connector_metadata
        block_hash = {b: h for h, b in pool.hash_to_block.items()}
        loads: dict[int, list[int]] = {}
        for cpu, gpu in meta.loads:             # loads go to blocks of a request not scheduled
            rid = next(r for r, s in self.seqs.items()
                       if gpu in self.s.kv_cache_manager.req_to_block_ids.get(s.seq_id, ()))
            loads.setdefault(rid, []).append(self.hash_name[block_hash[cpu]])
        after = set(pool.hash_to_block)
        stored = {block_hash[cpu] for _, cpu in meta.stores}
        evicted = (before | stored) - after
        self.step_record = {
            "loads": sorted((r, sorted(v)) for r, v in loads.items()),
            "stores": sorted(self.hash_name[block_hash[cpu]] for _, cpu in meta.stores),
            "evicted": sorted(self.hash_name[h] for h in evicted)}
        conn.bind_connector_metadata(meta)      # the worker side: every copy done this step
        conn.wait_for_save()
        conn.clear_connector_metadata()
        samples = {e.seq.seq_id: [(token(e.request.request_id, len(e.seq)), 0.0)]
                   for e in out.scheduled if e.num_candidates}
        finished = self.s.update(out, samples, 0.0)
        self.seen["preemption"] += len(out.preempted)
        self.s.update_from_kv_xfer_finished(
            *conn.get_finished({s.seq_id for r in finished for s in r.seqs}),
            conn.get_block_ids_with_load_errors() or None)
        self.s.check_invariants()
        conn.check_invariants()
        return {"scheduled": [(e.request.request_id, e.num_tokens) for e in out.scheduled],
                "preempted": sorted(rid for rid, _ in out.preempted),
                "finished": sorted(r.request_id for r in finished)}

    def state(self) -> dict:
        rid = self.conn.rid_of
        queued = [*self.s.running, *self.s.waiting, *self.s.waiting_for_remote]
        lookups, self.conn.lookups = self.conn.lookups, []
        seen = self.seen
        for key in ("loads", "stores", "evicted"):
            seen[key] += bool(self.step_record[key])
        seen["tier hit after a GPU hit"] += sum(1 for _, local, hit in lookups if local and hit)
        return {
            "running": [rid[s.seq_id] for s in self.s.running],
            "waiting": sorted(rid[s.seq_id] for s in [*self.s.waiting,
                                                     *self.s.waiting_for_remote]),
            "computed": {rid[s.seq_id]: s.num_computed_tokens for s in queued},
            "lookups": lookups,
            **self.step_record,
            "held": sorted(self.hash_name[h] for h in self.conn.cpu_pool.hash_to_block),
        }


# ------------------------------------------------------------------------------ vLLM's
def real_connector_class(vllm):
    """A subclass of vLLM's ``KVConnectorBase_V1`` that is ``OffloadingConnector``'s scheduler
    role (``offloading_connector.py``): each call forwarded to its real
    ``OffloadingConnectorScheduler``; ``lookups`` records the answers."""
    kv_base, cfg = vllm.kv_offload_base, vllm.offloading_config

    class CPUSpec(kv_base.OffloadingSpec):
        """vLLM's ``CPUOffloadingSpec.get_manager`` with an empty ``extra_config``."""

        def __init__(self, config, num_chunks: int) -> None:
            super().__init__(config)
            self.num_chunks = num_chunks
            self._manager = None

        def get_manager(self):
            if not self._manager:
                self._manager = vllm.manager.CPUOffloadingManager(
                    num_chunks=self.num_chunks, cache_policy="lru",
                    cache_policy_module_path=None,
                    enable_events=self.kv_events_config.enable_kv_cache_events,
                    store_threshold=0, max_tracker_size=64_000, info=None)
            return self._manager

        def get_worker(self, kv_caches):
            raise AssertionError("worker side")

    class OffloadingConnector(scheduler_side_connector_base(vllm)):
        def __init__(self, vllm_config, role, kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)
            trace = vllm_config.kv_transfer_config.worker
            bs = trace.block_size
            config = cfg.OffloadingConfig(
                groups=(cfg.OffloadingGroupConfig(tokens_per_block=bs, layer_names=("layer",),
                                                  group_id=0),),
                worker_kv_bytes_per_block=8 * bs, enable_kv_cache_events=False,
                extra_config={}, engine_id="0",
                model=cfg.OffloadingModelConfig(name="tiny", dtype="float32"),
                cache=cfg.OffloadingCacheConfig(tokens_per_hash=bs, blocks_per_chunk=1),
                parallel=cfg.OffloadingParallelConfig(
                    rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                    data_parallel_index=0, data_parallel_size=1,
                    data_parallel_rank_local=None, is_parallelism_agnostic=False))
            self.spec = CPUSpec(config, trace.num_cpu_blocks)
            self.scheduler = vllm.offloading_scheduler.OffloadingConnectorScheduler(
                self.spec, vllm_config, kv_cache_config)
            self.lookups: list[tuple] = []

        def on_new_request(self, request):
            self.scheduler.on_new_request(request)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            answer = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens,
                                                               max_num_new_tokens=None)
            self.lookups.append((int(request.request_id), num_computed_tokens, answer[0]))
            return answer

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return self.scheduler.update_state_after_alloc(request, blocks,
                                                           num_external_tokens)

        def build_connector_meta(self, scheduler_output):
            return self.scheduler.build_connector_meta(scheduler_output)

        def has_pending_push_work(self):
            return self.scheduler.has_pending_push_work()

        def update_connector_output(self, connector_output):
            self.scheduler.update_connector_output(connector_output)

        def request_finished(self, request, block_ids):
            return self.scheduler.request_finished(request)

        def take_events(self):
            return self.scheduler.take_events()

    return OffloadingConnector


class RealOffloadTwin:
    """vLLM 0.33.0's ``Scheduler`` with its offloading connector's scheduler side
    (``vllm``: upstream.load_vllm_offloading)."""

    def __init__(self, trace: OffloadTrace, names: Names, vllm) -> None:
        self.trace, self.names, self.vllm = trace, names, vllm
        logging.getLogger("vllm").setLevel(logging.ERROR)
        # the manager's CachePolicyFactory imports its policy's module by name
        # (policies/factory.py), and another loader may have taken vllm.* out of sys.modules
        sys.modules[vllm.lru.__name__] = vllm.lru
        utils, iface = vllm.kv_cache_utils, vllm.kv_cache_interface
        hash_fn = vllm.hashing.get_hash_fn_by_name("sha256")
        utils.init_none_hash(hash_fn)
        self.hasher = utils.get_request_block_hasher(trace.block_size, hash_fn)
        spec = iface.FullAttentionSpec(block_size=trace.block_size, num_kv_heads=1,
                                       head_size=1, dtype="float32", state_content_bytes=8)
        kv_cache_config = iface.KVCacheConfig(
            num_blocks=trace.num_blocks + 1, kv_cache_tensors=[],
            kv_cache_groups=[iface.KVCacheGroupSpec(["layer"], spec)])
        # (the config's kv_transfer_config.worker carries the trace to the connector)
        config = vllm_config(trace, trace, real_connector_class(vllm))
        config.parallel_config.world_size = 1
        config.cache_config.prefix_cache_retention_interval = None
        self.s = vllm.scheduler.Scheduler(config, kv_cache_config, _StructuredOutputManager(),
                                          block_size=trace.block_size)
        self.conn = self.s.connector
        self.manager = self.conn.scheduler.manager
        self.refused: set[int] = set()          # requests whose offer the tier refused, ever
        self.refused_now: set[int] = set()      # this step
        prepare_store = self.manager.prepare_store

        def recording_prepare_store(keys, req_context):     # the answer unchanged
            out = prepare_store(keys, req_context)
            if out is None:
                self.refused.add(int(req_context.req_id))
                self.refused_now.add(int(req_context.req_id))
            return out

        self.manager.prepare_store = recording_prepare_store
        self.status = vllm.request.RequestStatus
        self.key_name: dict[bytes, int] = {}
        self.step_record: dict = {"loads": [], "stores": [], "evicted": []}
        self.stores_by_request: dict[int, list[int]] = {}     # this step's, by request

    def _name_keys(self) -> None:
        bs, make_key = self.trace.block_size, self.vllm.kv_offload_base.make_offload_key
        for req in self.s.requests.values():
            tokens = list(req.all_token_ids)
            for i, h in enumerate(req.block_hashes):
                self.key_name.setdefault(make_key(h, 0), self.names(tokens[:(i + 1) * bs]))

    def apply(self, op: tuple) -> Any:
        kind, v = op[0], self.vllm
        self.step_record = {"loads": [], "stores": [], "evicted": []}
        if kind in ("add", "abort"):
            return real_add_or_abort(self, op)
        policy = self.manager._policy
        before = set(policy.chunks)
        self.refused_now = set()
        out = self.s.schedule()
        self._name_keys()
        meta, jobs = out.kv_connector_metadata, self.conn.scheduler._jobs
        loads = {int(j.req_id): sorted(self.key_name[k] for k in jobs[i].keys)
                 for i, j in meta.load_jobs.items()}
        self.stores_by_request: dict[int, list[int]] = {}
        stored = set()
        for i, j in meta.store_jobs.items():
            self.stores_by_request.setdefault(int(j.req_id), []).extend(
                self.key_name[k] for k in jobs[i].keys)
            stored |= jobs[i].keys
        after = set(policy.chunks)
        self.step_record = {
            "loads": sorted(loads.items()),
            "stores": sorted(self.key_name[k] for k in stored),
            "evicted": sorted(self.key_name[k] for k in (before | stored) - after)}
        # the worker side: every job planned this step done at its end
        done = {i: 1 for i in [*meta.load_jobs, *meta.store_jobs]}
        recving = {int(j.req_id) for j in meta.load_jobs.values() if not j.sync}
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for r in req_ids:
            req = self.s.requests[r]
            sampled.append([] if req.is_prefill_chunk else [token(int(r), req.num_tokens)])
        kv_out = v.outputs.KVConnectorOutput(
            finished_recving=_in_course_order(recving),
            kv_connector_worker_meta=v.common.OffloadingWorkerMetadata(completed_jobs=done))
        runner_out = v.outputs.ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_out)
        outputs = self.s.update_from_output(out, runner_out)
        finished = sorted(int(o.request_id) for eco in outputs.values()
                          for o in getattr(eco, "outputs", ()) if o.finish_reason is not None)
        return {"scheduled": [(int(r), n) for r, n in out.num_scheduled_tokens.items()],
                "preempted": sorted(int(r) for r in out.preempted_req_ids),
                "finished": finished}

    def state(self) -> dict:
        s = self.s
        queued = [*s.running, *s.waiting, *s.kv_holding_waiting]
        lookups, self.conn.lookups = self.conn.lookups, []
        return {
            "running": [int(r.request_id) for r in s.running],
            "waiting": sorted(int(r.request_id) for r in [*s.waiting, *s.kv_holding_waiting]),
            "computed": {int(r.request_id): r.num_computed_tokens for r in queued},
            "lookups": lookups,
            **self.step_record,
            "held": sorted(self.key_name[k] for k in self.manager._policy.chunks),
        }


# ------------------------------------------------------------------------- a tight tier
EVICTION_ORDER = "eviction order"
WHOLE_OFFER = "an offer stored whole or not at all"
FINISHED_OFFER = "a finished request's offer made again"


def run_tight(name: str, trace: OffloadTrace, course: CourseOffloadTwin,
              real: RealOffloadTwin) -> str:
    """:func:`harness.run_lockstep` for a tier that evicts: identical step by step up to the
    first difference, which must be one of the declared ones (and ends the comparison, the
    tiers holding different blocks from there on); returns "identical" or which one. In each
    the step is the same (scheduling, queues, lookups, loads), and

    * :data:`EVICTION_ORDER`: both tiers evict in it and hold as many blocks after it, only
      not the same ones (vLLM's LRU ranks a request's blocks together, its tail first:
      test_scheduler_declared_differences.py ``test_vllm_evicts_a_requests_tail_first``);
    * :data:`FINISHED_OFFER`: vLLM stores blocks of a request that has finished
      (``test_vllm_offers_a_finished_requests_blocks_once_more``);
    * :data:`WHOLE_OFFER`: vLLM's tier refused an offer it could not take whole, this step
      (the course's stored part of it) or before (vLLM offers it again now):
      ``test_vllm_stores_an_offer_whole_or_not_at_all``.

    Anything else raises :class:`harness.Mismatch`."""
    done = []
    for op in trace.ops:
        done.append(op)
        a = {"answer": course.apply(op), "state": course.state()}
        b = {"answer": real.apply(op), "state": real.state()}
        where = first_difference(a, b)
        if where is None:
            continue
        sa, sb = a["state"], b["state"]
        same_step = a["answer"] == b["answer"] and all(
            sa[k] == sb[k] for k in ("running", "waiting", "computed", "lookups", "loads"))
        if same_step and sa["evicted"] and sb["evicted"] and len(sa["held"]) == len(sb["held"]):
            return EVICTION_ORDER
        live = set(sb["computed"])
        if same_step and any(r not in live for r in real.stores_by_request):
            return FINISHED_OFFER
        if same_step and (real.refused_now or real.refused & set(real.stores_by_request)):
            return WHOLE_OFFER
        raise Mismatch(f"{name}: the course and the real code differ after operation "
                       f"{len(done) - 1} ({op!r})\n  operations: {done!r}\n"
                       f"  first difference: {where}\n  course: {a!r}\n  real:   {b!r}")
    return "identical"
