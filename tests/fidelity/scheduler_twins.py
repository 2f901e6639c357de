"""Twins for the V1 scheduler with a KV connector (tests/fidelity/harness.py): the course's
``course_lib.scheduler.v1.SchedulerV1`` and vLLM 0.33.0's own ``Scheduler``
(``vllm/v1/core/sched/scheduler.py``, over its real ``KVCacheManager``, ``Request`` and request
queues: upstream.load_vllm_scheduler) driven by one :class:`Trace`.

**One scripted connector.** Each side gets a connector of its own kind (the course's
``KVConnectorScheduler``, a subclass of vLLM's ``KVConnectorBase_V1``) whose answers come from
the same script (:class:`Answer`, the k-th lookup of request ``rid`` getting
``trace.answers[rid][k]``, the last one kept): the tokens it holds from token 0 (it reports those
past the local hit, as NIXL's decode side counts them; the whole prompt allowed), ``None`` (ask
again), synchronous or asynchronous. Both connectors record every call the scheduler makes
(method, request, arguments, block ids in the course's numbering).

**The worker side, simulated** (:class:`_Worker`, one per side, the same rules): an asynchronous
load started in step ``t`` (``update_state_after_alloc`` with external tokens) is reported done
at the end of step ``t + delay - 1`` (``finished_recving``), and if the script says so, with one
of its blocks failed (``invalid_block_ids``: the first external block plus ``fail``, clipped to
the last). A request aborted while its load is in flight: vLLM keeps its blocks until the load
reports done, whatever the connector says (``finish_requests``); the course frees them when
``request_finished`` says so, so its connector says "keep them" for such a request and the
worker reports it done *sending* at the same step (a declared difference:
test_scheduler_declared_differences.py). Tokens are sampled by the harness, a fixed function of
the request and position (:func:`token`), and fed to both sides' update paths: vLLM's
``update_from_output`` with a ``ModelRunnerOutput`` (and its ``KVConnectorOutput``), the
course's ``update`` then ``update_from_kv_xfer_finished`` (as ``LLMEngine._step``).

**What is compared** after every operation (``add``, ``abort``, ``step``): the step's
scheduled requests in order with their tokens, the preempted requests, the requests finished;
the queues (running; waiting; waiting for remote K/V with each one's status, vLLM's
``PREEMPTED`` read as the course's ``WAITING``), every queued request's computed tokens and
block table (vLLM's block ``i + 1`` is the course's ``i``: vllm_twins.py), the free blocks, and
the connector calls made since the last operation.
"""

from __future__ import annotations

import logging
import random
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.scheduler.kv_connector import KVConnectorScheduler
from course_lib.scheduler.output import KVConnectorMetadata
from course_lib.scheduler.v1 import SchedulerV1
from course_lib.sequence import SamplingParams, SequenceStatus


# ------------------------------------------------------------------------------ the script
@dataclass(frozen=True)
class Answer:
    """One answer of the scripted connector to ``get_num_new_matched_tokens``."""
    tokens: int | None          # held from token 0 (None: ask again)
    load_async: bool = False
    delay: int = 1              # asynchronous: reported done after this many steps (>= 1)
    fail: int | None = None     # this external block (from the first) fails (asynchronous;
    #                             synchronous too with Trace.fail_sync_loads)


@dataclass
class Trace:
    block_size: int
    num_blocks: int             # the course's pool (vLLM's has one more: its null block)
    budget: int                 # max_num_batched_tokens
    max_num_seqs: int
    prompts: dict[int, list[int]]
    max_tokens: dict[int, int]
    answers: dict[int, list[Answer]]
    ops: list[tuple]            # ("add", rid) | ("abort", rid) | ("step",)
    max_model_len: int = 256
    # a synchronous load fails too (reported at the end of its step): the course's connectors
    # report failed asynchronous loads only (declared)
    fail_sync_loads: bool = False

    def answer(self, rid: int, k: int) -> Answer:
        script = self.answers.get(rid) or [Answer(0)]
        return script[min(k, len(script) - 1)]


def token(rid: int, pos: int) -> int:
    """The token the harness samples for request ``rid`` at position ``pos``."""
    return 1 + (rid * 1_000_003 + pos * 7919) % 30_000


def random_ops(rng: random.Random, n: int, max_ops: int, abort_below: float) -> list[tuple]:
    """A trace's operations on requests ``0 .. n - 1``: ``n`` to ``max_ops`` random ones (add
    the next request with probability 0.3, abort a random one below ``abort_below``, else
    step), then every request not added yet, then 40 steps to drain."""
    ops: list[tuple] = []
    pending = list(range(n))
    for _ in range(rng.randint(n, max_ops)):
        r = rng.random()
        if pending and r < 0.3:
            ops.append(("add", pending.pop(0)))
        elif r < abort_below:
            ops.append(("abort", rng.randrange(n)))
        else:
            ops.append(("step",))
    return ops + [("add", rid) for rid in pending] + [("step",)] * 40


def random_trace(rng: random.Random, *, sync_whole_prompt: bool = False) -> Trace:
    """A small random trace: few blocks (preemptions), a binding ``max_num_seqs`` now and
    then, prompts sharing prefixes (local hits), every kind of answer. A synchronous answer
    of the whole prompt only with ``sync_whole_prompt`` (vLLM asserts on it: declared)."""
    bs = rng.choice((2, 4))
    n = rng.randint(1, 6)
    bases = [[rng.randint(1, 50) for _ in range(24)] for _ in range(2)]
    prompts, max_tokens, answers = {}, {}, {}
    for rid in range(n):
        length = rng.randint(2, 20)     # (one token, loaded whole: declared)
        shared = rng.randint(0, length) if rng.random() < 0.6 else 0
        base = rng.choice(bases)
        prompts[rid] = base[:shared] + [rng.randint(51, 99) for _ in range(length - shared)]
        max_tokens[rid] = rng.randint(1, 6)
        script = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.15:
                script.append(Answer(None))
                continue
            choices = list(range(0, length + 1, bs)) + [length]
            tokens = rng.choice(choices)
            load_async = rng.random() < 0.5
            if tokens == length and not load_async and not sync_whole_prompt:
                tokens -= tokens % bs if tokens % bs else bs
            fail = None if rng.random() < 0.7 else rng.randint(0, 2)
            script.append(Answer(max(tokens, 0), load_async, rng.randint(1, 3), fail))
        answers[rid] = script
    ops = random_ops(rng, n, max_ops=40, abort_below=0.36)
    num_blocks = rng.randint(4, 40)
    max_len = max(len(p) + max_tokens[r] for r, p in prompts.items())
    num_blocks = max(num_blocks, -(-max_len // bs))       # each request fits alone
    return Trace(bs, num_blocks, rng.randint(4, 64), rng.choice((1, 2, 3, 8)), prompts,
                 max_tokens, answers, ops)


# ------------------------------------------------------------------------------ the worker
@dataclass
class _Load:
    due: int                    # the step at whose end it is reported
    bad_block: int | None       # this side's id of the block that failed
    aborted: bool = False
    sync: bool = False          # a synchronous load: only its failure is reported


@dataclass
class _Worker:
    """The worker side of one twin: the loads in flight, what each step's end reports."""
    trace: Trace
    keep_aborted_loads: bool    # the course's connector: request_finished keeps them
    step: int = 0
    loads: dict[int, _Load] = field(default_factory=dict)
    lookups: dict[int, int] = field(default_factory=dict)
    last: dict[int, Answer] = field(default_factory=dict)
    local_hit: dict[int, int] = field(default_factory=dict)   # looked up, not yet allocated
    readmissions: list[int] = field(default_factory=list)
    seen: Counter = field(default_factory=Counter)     # what the trace exercised
    calls: list[tuple] = field(default_factory=list)

    def lookup(self, rid: int, num_tokens: int, num_computed: int) -> tuple[int | None, bool]:
        k = self.lookups.get(rid, 0)
        self.lookups[rid] = k + 1
        a = self.trace.answer(rid, k)
        self.calls.append(("get_num_new_matched_tokens", rid, num_computed))
        self.local_hit[rid] = num_computed
        if a.tokens is None:
            self.seen["None answer"] += 1
            return None, False
        self.last[rid] = a
        tokens = max(0, min(a.tokens, num_tokens) - num_computed)
        if tokens and num_computed + tokens == num_tokens:
            self.seen["whole-prompt answer"] += 1
        return tokens, a.load_async and tokens > 0

    def alloc(self, rid: int, ids: list[int], course_ids: list[int], num_external: int
              ) -> None:
        if rid not in self.local_hit:
            # no lookup before it: vLLM admitting a request whose load is done (declared:
            # test_vllm_tells_the_connector_again_when_a_loaded_request_is_admitted)
            assert num_external == 0
            self.readmissions.append(rid)
            return
        self.calls.append(("update_state_after_alloc", rid, course_ids, num_external))
        a, hit = self.last.get(rid), self.local_hit.pop(rid)
        if num_external and a is not None and a.load_async:
            bs = self.trace.block_size
            first, last = hit // bs, (hit + num_external - 1) // bs
            bad = None if a.fail is None else ids[min(first + a.fail, last)]
            self.loads[rid] = _Load(self.step + a.delay - 1, bad)
            self.seen["async load"] += 1
            if a.fail is not None:
                self.seen["failed from its first block" if min(first + a.fail, last) == first
                          else "failed from a later block"] += 1
        elif num_external:
            self.seen["sync load"] += 1
            if a is not None and a.fail is not None and self.trace.fail_sync_loads:
                bs = self.trace.block_size
                first, last = hit // bs, (hit + num_external - 1) // bs
                self.loads[rid] = _Load(self.step, ids[min(first + a.fail, last)], sync=True)

    def finished(self, rid: int, course_ids: list[int]) -> bool:
        self.calls.append(("request_finished", rid, course_ids))
        load = self.loads.get(rid)
        if load is None:
            return False
        load.aborted = True
        self.seen["aborted while loading"] += 1
        return self.keep_aborted_loads

    def build_meta(self) -> None:
        self.calls.append(("build_connector_meta",))

    def report(self) -> tuple[set[int], set[int], set[int]]:
        """The end of this step: (finished sending, finished recving, invalid block ids)."""
        sending, recving, invalid = set(), set(), set()
        for rid, load in list(self.loads.items()):
            if load.due > self.step:
                continue
            del self.loads[rid]
            if load.aborted and self.keep_aborted_loads:
                sending.add(rid)
                continue
            if not load.sync:
                recving.add(rid)
            if load.bad_block is not None and not load.aborted:
                invalid.add(load.bad_block)
        self.step += 1
        return sending, recving, invalid

    def take_calls(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


# ------------------------------------------------------------------------------ the course
class CourseConnector(KVConnectorScheduler):
    def __init__(self, worker: _Worker) -> None:
        super().__init__()
        self.worker = worker
        self.rid_of: dict[int, int] = {}            # seq id -> request id

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        return self.worker.lookup(self.rid_of[seq.seq_id], len(seq), num_computed_tokens)

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        ids = list(block_ids)
        self.worker.alloc(self.rid_of[seq.seq_id], ids, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        self.worker.build_meta()
        return KVConnectorMetadata()

    def request_finished(self, seq, block_ids):
        return self.worker.finished(self.rid_of[seq.seq_id], list(block_ids)), None


class CourseTwin:
    """The course's ``SchedulerV1`` (or ``scheduler_cls``, a broken variant) under the script."""

    def __init__(self, trace: Trace, scheduler_cls=SchedulerV1,
                 keep_aborted_loads: bool = True) -> None:
        self.trace = trace
        self.worker = _Worker(trace, keep_aborted_loads=keep_aborted_loads)
        self.conn = CourseConnector(self.worker)
        self.s = scheduler_cls(
            SchedulerConfig(max_num_seqs=trace.max_num_seqs,
                            max_num_batched_tokens=trace.budget,
                            max_model_len=trace.max_model_len),
            CacheConfig(trace.block_size, trace.num_blocks, 0, 0.0, True, "hash"),
            kv_connector=self.conn)
        self.seqs: dict[int, Any] = {}                # rid -> its one sequence

    def apply(self, op: tuple) -> Any:
        kind = op[0]
        if kind == "add":
            rid = op[1]
            req = self.s.add_request(rid, self.trace.prompts[rid],
                                     SamplingParams(max_tokens=self.trace.max_tokens[rid]))
            self.seqs[rid] = req.seqs[0]
            self.conn.rid_of[req.seqs[0].seq_id] = rid
            return "added"
        if kind == "abort":
            return self.s.abort_request(op[1])
        out = self.s.schedule()
        scheduled = [(e.request.request_id, e.num_tokens) for e in out.scheduled]
        seen = self.worker.seen
        seen["preemption"] += len(out.preempted)
        if len(self.s.running) == self.trace.max_num_seqs and (
                self.s.waiting or any(s.status == SequenceStatus.WAITING
                                      for s in self.s.waiting_for_remote)):
            seen["max_num_seqs binding"] += 1
        if self.s.waiting_for_remote and len(self.s.running) >= self.trace.max_num_seqs:
            seen["loading beyond max_num_seqs"] += 1
        samples = {e.seq.seq_id: [(token(e.request.request_id, len(e.seq)), 0.0)]
                   for e in out.scheduled if e.num_candidates}
        finished = self.s.update(out, samples, 0.0)
        sending, recving, invalid = self.worker.report()
        seq_id = {rid: s.seq_id for rid, s in self.seqs.items()}
        self.s.update_from_kv_xfer_finished({seq_id[r] for r in sending} or None,
                                            {seq_id[r] for r in recving} or None,
                                            invalid or None)
        self.s.check_invariants()             # the course's own, after every step
        return {"scheduled": scheduled,
                "preempted": sorted(rid for rid, _ in out.preempted),
                "finished": sorted(r.request_id for r in finished)}

    def state(self) -> dict:
        kvm, rid = self.s.kv_cache_manager, self.conn.rid_of
        status = {SequenceStatus.RUNNING: "RUNNING", SequenceStatus.WAITING: "WAITING",
                  SequenceStatus.WAITING_FOR_REMOTE_KVS: "WAITING_FOR_REMOTE_KVS"}
        queued = [*self.s.running, *self.s.waiting, *self.s.waiting_for_remote]
        return {
            "running": [rid[s.seq_id] for s in self.s.running],
            "waiting": [rid[s.seq_id] for s in self.s.waiting],
            "waiting_for_remote": [(rid[s.seq_id], status[s.status])
                                   for s in self.s.waiting_for_remote],
            "computed": {rid[s.seq_id]: s.num_computed_tokens for s in queued},
            "tables": {rid[s.seq_id]: list(kvm.req_to_block_ids.get(s.seq_id, ()))
                       for s in queued},
            "num_free_blocks": kvm.num_free_gpu_blocks,
            "calls": self.worker.take_calls(),
        }


# ------------------------------------------------------------------------------ vLLM's
def scheduler_side_connector_base(vllm):
    """vLLM's own ``KVConnectorBase_V1`` with its worker-side methods, which the harness's
    connectors never reach (the scheduler alone runs), failing if called."""

    class SchedulerSideConnector(vllm.base.KVConnectorBase_V1):
        def start_load_kv(self, forward_context, **kwargs):
            raise AssertionError("worker side")

        def wait_for_layer_load(self, layer_name):
            raise AssertionError("worker side")

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            raise AssertionError("worker side")

        def wait_for_save(self):
            raise AssertionError("worker side")

    return SchedulerSideConnector


def real_connector_class(vllm):
    """A subclass of vLLM's own ``KVConnectorBase_V1`` (scheduler role) over a :class:`_Worker`
    (the config's ``kv_transfer_config.worker``)."""
    base = vllm.base

    class ScriptedConnector(scheduler_side_connector_base(vllm)):
        def __init__(self, vllm_config, role, kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)
            self.worker: _Worker = vllm_config.kv_transfer_config.worker

        # scheduler side
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return self.worker.lookup(int(request.request_id), request.num_tokens,
                                      num_computed_tokens)

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            (ids,) = blocks.get_block_ids()
            self.worker.alloc(int(request.request_id), list(ids), [b - 1 for b in ids],
                              num_external_tokens)

        def build_connector_meta(self, scheduler_output):
            self.worker.build_meta()
            return base.KVConnectorMetadata()

        def request_finished(self, request, block_ids):
            return self.worker.finished(int(request.request_id), [b - 1 for b in block_ids]), \
                None

    return ScriptedConnector


class _StructuredOutputManager:
    """What ``update_from_output`` asks of vLLM's ``StructuredOutputManager``: no request of
    the harness has a grammar, so every token is accepted (as the real one does then)."""

    def accept_tokens(self, request, tokens) -> bool:
        assert not request.use_structured_output
        return True


def _in_course_order(rids: set[int]):
    """A set of request ids as vLLM's ``KVConnectorOutput`` carries it, iterated in the order
    the course iterates its set of sequence ids (ascending): vLLM's is a set of strings, whose
    order changes with ``PYTHONHASHSEED``, and the order in which finished requests are freed
    is the order of their blocks in the free queue."""
    return dict.fromkeys(str(r) for r in sorted(rids)).keys() if rids else None


def _ns(**fields) -> types.SimpleNamespace:
    return types.SimpleNamespace(**fields)


def vllm_config(trace: Trace, worker: _Worker, connector_class,
                kv_load_failure_policy: str = "recompute") -> types.SimpleNamespace:
    """The fields of ``VllmConfig`` the ``Scheduler`` reads, at vLLM's defaults for a plain
    decoder model with one KV connector (a namespace: a field it reads and this lacks fails)."""
    return _ns(
        scheduler_config=_ns(
            max_num_seqs=trace.max_num_seqs, max_num_active_seqs=None,
            max_num_scheduled_tokens=None, max_num_batched_tokens=trace.budget,
            long_prefill_token_threshold_adaptive=False, long_prefill_token_threshold=0,
            policy="fcfs", enable_chunked_prefill=True, watermark=0.0,
            prefill_schedule_interval=1, scheduler_reserve_full_isl=False),
        cache_config=_ns(enable_prefix_caching=True, num_gpu_blocks=trace.num_blocks + 1,
                         mamba_cache_mode="none", enable_mamba_shared_prefix_checkpoint=False),
        lora_config=None,
        model_config=_ns(uses_mrope=False, max_model_len=trace.max_model_len,
                         runner_type="generate", is_diffusion=False, is_encoder_decoder=False,
                         supports_multimodal_inputs=False, return_sampling_mask=False),
        kv_events_config=None,
        parallel_config=_ns(data_parallel_index=0, decode_context_parallel_size=1,
                            prefill_context_parallel_size=1, pipeline_parallel_size=1,
                            data_parallel_size=1),
        observability_config=_ns(per_request_spec_decode_metrics="none",
                                 kv_cache_metrics=False, enable_mfu_metrics=False,
                                 enable_logging_iteration_details=False),
        is_mm_encoder_only=False,
        # kv_load_failure_policy "recompute": the course's only policy (declared)
        kv_transfer_config=_ns(kv_load_failure_policy=kv_load_failure_policy,
                               is_kv_consumer=True,
                               is_kv_producer=False, connector_class=connector_class,
                               worker=worker),
        max_concurrent_batches=1,
        ec_transfer_config=None,
        ec_manager_config=_ns(get_encoder_cache_manager_obj=lambda: None),
        speculative_config=None, num_speculative_tokens=0, num_lookahead_tokens=0,
        num_prefill_lookahead_tokens=0, use_v2_model_runner=False,
        num_hash_lookahead_tokens=0, max_in_flight_tokens=None,
        aux_output_config=_ns(enabled=False),
    )


def real_add_or_abort(twin, op: tuple) -> Any:
    """An ``("add", rid)`` or ``("abort", rid)`` on a real twin's vLLM ``Scheduler``
    (``twin.s``, ``twin.vllm``, ``twin.trace``, ``twin.hasher``, ``twin.status``)."""
    rid = op[1]
    if op[0] == "add":
        params = _ns(max_tokens=twin.trace.max_tokens[rid], extra_args=None,
                     structured_outputs=None, skip_reading_prefix_cache=None,
                     eos_token_id=None, stop_token_ids=None, min_tokens=0,
                     repetition_detection=None, num_logprobs=None)
        req = twin.vllm.request.Request(str(rid), list(twin.trace.prompts[rid]), params, None,
                                        arrival_time=0.0, block_hasher=twin.hasher)
        twin.s.add_request(req)
        return "added"
    req = twin.s.requests.get(str(rid))
    if req is None or req.is_finished():
        return False
    return bool(twin.s.finish_requests(str(rid), twin.status.FINISHED_ABORTED))


class RealTwin:
    """vLLM 0.33.0's ``Scheduler`` under the script (``vllm``: upstream.load_vllm_scheduler)."""

    def __init__(self, trace: Trace, vllm, kv_load_failure_policy: str = "recompute") -> None:
        self.trace, self.vllm = trace, vllm
        logging.getLogger("vllm").setLevel(logging.ERROR)    # its connector-API notice
        self.worker = _Worker(trace, keep_aborted_loads=False)
        utils, iface = vllm.kv_cache_utils, vllm.kv_cache_interface
        hash_fn = vllm.hashing.get_hash_fn_by_name("sha256")
        utils.init_none_hash(hash_fn)
        self.hasher = utils.get_request_block_hasher(trace.block_size, hash_fn)
        spec = iface.FullAttentionSpec(block_size=trace.block_size, num_kv_heads=1,
                                       head_size=1, dtype="float32")
        kv_cache_config = iface.KVCacheConfig(
            num_blocks=trace.num_blocks + 1, kv_cache_tensors=[],
            kv_cache_groups=[iface.KVCacheGroupSpec(["layer"], spec)])
        config = vllm_config(trace, self.worker, real_connector_class(vllm),
                             kv_load_failure_policy)
        self.s = vllm.scheduler.Scheduler(config, kv_cache_config, _StructuredOutputManager(),
                                          block_size=trace.block_size)
        self.status = vllm.request.RequestStatus

    def apply(self, op: tuple) -> Any:
        kind, v = op[0], self.vllm
        if kind in ("add", "abort"):
            return real_add_or_abort(self, op)
        out = self.s.schedule()
        scheduled = [(int(r), n) for r, n in out.num_scheduled_tokens.items()]
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for r in req_ids:
            req = self.s.requests[r]
            sampled.append([] if req.is_prefill_chunk else [token(int(r), req.num_tokens)])
        sending, recving, invalid = self.worker.report()
        kv_out = v.outputs.KVConnectorOutput(
            finished_sending=_in_course_order(sending),
            finished_recving=_in_course_order(recving),
            invalid_block_ids=invalid)
        runner_out = v.outputs.ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_out)
        outputs = self.s.update_from_output(out, runner_out)
        finished = sorted(int(o.request_id) for eco in outputs.values()
                          for o in getattr(eco, "outputs", ()) if o.finish_reason is not None)
        return {"scheduled": scheduled,
                "preempted": sorted(int(r) for r in out.preempted_req_ids),
                "finished": finished}

    def state(self) -> dict:
        s, st = self.s, self.status
        blocks = s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        name = {st.RUNNING: "RUNNING", st.WAITING: "WAITING", st.PREEMPTED: "WAITING",
                st.WAITING_FOR_REMOTE_KVS: "WAITING_FOR_REMOTE_KVS"}
        queued = [*s.running, *s.waiting, *s.kv_holding_waiting]
        return {
            "running": [int(r.request_id) for r in s.running],
            "waiting": [int(r.request_id) for r in s.waiting],
            "waiting_for_remote": [(int(r.request_id), name[r.status])
                                   for r in s.kv_holding_waiting],
            "computed": {int(r.request_id): r.num_computed_tokens for r in queued},
            "tables": {int(r.request_id): [b.block_id - 1
                                           for b in blocks.get(r.request_id, ())]
                       for r in queued},
            "num_free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks(),
            "calls": self.worker.take_calls(),
        }
