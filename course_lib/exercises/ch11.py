"""Chapter 11 (capstone) exercises: the block manager's append, the step's cache operations.

* 11.1 ``append_slots(bm, seq_id, token_ids)``: reserve slots for new tokens on the real
  :class:`~course_lib.memory.v0.manager.BlockManager`, copying a shared partial last block first
  (copy-on-write); the learner fixes :func:`shown_append_slots`, the broken one the notebook
  shows. The checker routes every append of the engine's block manager through it.
* 11.2 ``cache_ops(eng, out)``: run a step's ``blocks_to_swap_out``, ``blocks_to_swap_in`` and
  ``blocks_to_copy`` on ``eng.gpu_caches`` / ``eng.cpu_caches`` (one ``(key, value)`` pair per
  layer), in the order the block manager's contract requires. The checker tries it on cache
  states where the order matters, then plugs it into the engine.
* 11.3 ``serving_metrics(records, percentile)``: TTFT, TPOT, ITL and end-to-end latency of a
  served workload, means and percentiles as vLLM's benchmark client reports them (checker in
  :mod:`course_lib.exercises.ch11_serving`, with :class:`TokenTimes` to record a run).

11.1 and 11.2's checkers run the greedy step loop (:func:`run_loop`) on :data:`WORKLOADS`
(forks with copy-on-write, swap and recompute preemption) and compare it step by step with the
loop run on the library's parts; a difference names the step and what that step did to the
cache.
``tests/test_engine_chapters.py`` checks that the reference loop equals ``LLMEngine``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Exercise, Exercises, Rule, Verdict
from course_lib.exercises import capstone_checks as checks
from course_lib.exercises import ch11_serving as serving
from course_lib.exercises.ch11_serving import check_serving_metrics
from course_lib.exercises.solutions import ch11 as solutions
from course_lib.kernels.cache_ops import swap_blocks
from course_lib.kernels.reference import copy_blocks_ref
from course_lib.memory.v0.manager import BlockManager
from course_lib.model.attention import make_attention_metadata
from course_lib.model.llama import TinyLlama, allocate_kv_caches
from course_lib.scheduler.output import SchedulerOutput
from course_lib.scheduler.scheduler import Scheduler
from course_lib.sequence import Request, SamplingParams
from course_lib.sizing.models import ModelSpec

AppendFn = Callable[[BlockManager, int, list[int]], list[tuple[int, int]]]
CacheOpsFn = Callable[[object, SchedulerOutput], None]


_THIS = sys.modules[__name__]   # handed to capstone_checks, which cannot import this module


def tiny_spec(model: TinyLlama) -> ModelSpec:
    """The tiny model as a capacity ``ModelSpec`` (float32 cache)."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return ModelSpec("tiny-llama", c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                         params, dtype_bytes=4, param_bytes=4.0)


def plug_append(bm: BlockManager, append: AppendFn) -> None:
    """Route every append of ``bm`` through ``append(bm, seq_id, token_ids)``: the decode
    call takes the plain ``BlockManager.append_decode`` (the room check, then
    ``append_slots`` per sequence), not the scheduler twin's fused path."""
    bm.append_slots = lambda seq_id, token_ids: append(bm, seq_id, list(token_ids))
    bm.append_decode = functools.partial(BlockManager.append_decode, bm)


def library_cache_ops(eng: MiniEngine, out: SchedulerOutput) -> None:
    """Reference of 11.2: swap-out, then swap-in, then the copy-on-write copies, every layer."""
    for pairs, src, dst in ((out.blocks_to_swap_out, eng.gpu_caches, eng.cpu_caches),
                            (out.blocks_to_swap_in, eng.cpu_caches, eng.gpu_caches)):
        if pairs:
            mapping = torch.tensor(pairs)
            for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
                swap_blocks(sk, dk, mapping)
                swap_blocks(sv, dv, mapping)
    if out.blocks_to_copy:
        for k, v in eng.gpu_caches:
            copy_blocks_ref(k, v, torch.tensor(out.blocks_to_copy))


@dataclass
class MiniEngine:
    """What a step needs: the scheduler (with its block manager), the model, the caches
    (``gpu_caches``, ``cpu_caches``: one ``(key, value)`` pair per layer, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``), and the cache operations to run."""

    sched: Scheduler
    model: TinyLlama
    gpu_caches: list
    cpu_caches: list
    cache_ops: CacheOpsFn = library_cache_ops

    @staticmethod
    def build(model: TinyLlama, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
              mode: str, append: AppendFn | None = None,
              cache_ops: CacheOpsFn = library_cache_ops) -> MiniEngine:
        sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                          max_model_len=model.config.max_position,
                                          preemption_mode=mode),
                          CacheConfig(block_size, num_gpu_blocks, num_cpu_blocks))
        if append is not None:
            plug_append(sched.block_manager, append)
        cpu = allocate_kv_caches(model.config, num_cpu_blocks, block_size) \
            if num_cpu_blocks else []
        return MiniEngine(sched, model, allocate_kv_caches(model.config, num_gpu_blocks,
                                                           block_size), cpu, cache_ops)


@torch.no_grad()
def mini_step(eng: MiniEngine) -> list[Request]:
    """One greedy engine step (``eng.cache_ops`` then the forward); returns the requests
    finished in it."""
    out = eng.sched.schedule()
    eng.cache_ops(eng, out)
    samples = {}
    if out.scheduled:
        bs = eng.sched.cache_config.block_size
        ids, pos, tables, ctxs, qs = [], [], [], [], []
        for e in out.scheduled:
            ctx, q = e.seq.num_computed_tokens, e.num_tokens
            ids += e.seq.token_ids[ctx:ctx + q]
            pos += range(ctx, ctx + q)
            tables.append(e.block_ids)
            ctxs.append(ctx)
            qs.append(q)
        meta = make_attention_metadata(tables, ctxs, qs, bs)
        logits = eng.model(torch.tensor(ids), torch.tensor(pos), eng.gpu_caches, meta,
                           impl="torch")
        last = logits[meta.last_token_indices()]
        logprobs = torch.log_softmax(last, dim=-1)
        for i, e in enumerate(out.scheduled):
            if e.num_candidates:
                token = int(last[i].argmax())
                samples[e.seq.seq_id] = [(token, float(logprobs[i, token]))] * e.num_candidates
    return eng.sched.update(out, samples)


def run_loop(step: Callable[[MiniEngine], list[Request]], model: TinyLlama,
             prompts: list[list[int]], max_tokens: int, n: int, block_size: int,
             num_gpu_blocks: int, num_cpu_blocks: int, mode: str, max_steps: int = 2000,
             append: AppendFn | None = None, cache_ops: CacheOpsFn = library_cache_ops,
             on_step: Callable[[MiniEngine, list[Request]], None] | None = None
             ) -> list[list[list[int]]]:
    """Run ``step`` until every prompt is done; the tokens of each sample of each prompt.
    ``on_step(eng, requests)`` is called after every step."""
    eng = MiniEngine.build(model, block_size, num_gpu_blocks, num_cpu_blocks, mode, append,
                           cache_ops)
    reqs = [eng.sched.add_request(i, p, SamplingParams(max_tokens=max_tokens, n=n,
                                                       temperature=0.0))
            for i, p in enumerate(prompts)]
    for _ in range(max_steps):
        if not eng.sched.has_unfinished_requests():
            break
        step(eng)
        if on_step is not None:
            on_step(eng, reqs)
    else:
        raise RuntimeError(f"not done after {max_steps} steps")
    eng.sched.check_invariants()
    bm = eng.sched.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks, "blocks were not given back"
    return [r.outputs() for r in reqs]


WORKLOADS = [  # prompts, max_tokens, n, block_size, gpu blocks, cpu blocks, preemption
    (["And God said"], 12, 1, 4, 32, 0, "recompute"),
    (["And God said unto Moses, I"], 10, 3, 4, 32, 0, "recompute"),     # fork + CoW
    (["And God said", "Blessed are the", "The LORD is my"], 40, 1, 4, 20, 40, "swap"),
    (["And God said", "Blessed are the", "The LORD is my"], 40, 1, 4, 20, 0, "recompute"),
    (["And the", "For God so loved"], 24, 2, 4, 24, 48, "swap"),
    (["Jesus wept. And", "And God said", "In the beginning God"], 16, 3, 4, 20, 64, "swap"),
]


@functools.cache
def tiny_model() -> TinyLlama:
    """The course's tiny model, loaded once for the checkers."""
    from course_lib.model.loader import load_tiny_model

    return load_tiny_model()


def check_append_slots(fn: AppendFn, model: TinyLlama | None = None) -> Verdict:
    """11.1: every workload with ``fn`` as the block manager's append, step by step against
    the library (tokens, free GPU blocks, copies asked, the manager's invariants)."""
    return checks.compare_runs("11.1 append_slots", model or tiny_model(), _THIS, append=fn)


def check_cache_ops(fn: CacheOpsFn, model: TinyLlama | None = None) -> Verdict:
    """11.2: cache states where the order of the operations matters, then every workload
    with ``fn`` as the step's cache operations, step by step against the library."""
    small = checks.order_cases("11.2 cache_ops", fn, library_cache_ops)
    if not small.attempted:
        return small
    runs = checks.compare_runs("11.2 cache_ops", model or tiny_model(), _THIS, cache_ops=fn)
    problem = runs.first_problem
    if small.first_problem:
        problem = (f"{problem}; on a small cache: " if problem else "") + small.first_problem
    return Verdict("11.2 cache_ops", small.passed + runs.passed, small.total + runs.total,
                   problem, cases=small.cases + runs.cases, failed=small.failed + runs.failed)


def check_capstone(append: AppendFn, cache_ops: CacheOpsFn,
                   model: TinyLlama | None = None) -> Verdict:
    """Both of yours in the engine at once, token for token."""
    return checks.compare_runs("11 capstone", model or tiny_model(), _THIS, append=append,
                               cache_ops=cache_ops)


def shown_append_slots(bm: BlockManager, seq_id: int, token_ids: list[int]
                       ) -> list[tuple[int, int]]:
    """11.1's broken append, as the notebook shows it: two bugs (the learner returns it
    fixed)."""
    table = bm.get_table(seq_id)
    blocks = table.blocks
    bs, n = bm.block_size, len(table.token_ids)
    copies = []
    if bm.gpu.ref_counts[blocks[-1]] > 1:                # shared: copy it before writing
        src = blocks[-1]
        blocks[-1] = bm.gpu.allocate()
        copies.append((src, blocks[-1]))
    while len(blocks) * bs < n + len(token_ids):         # then fresh blocks until all fit
        blocks.append(bm.gpu.allocate())
    table.token_ids.extend(token_ids)
    return copies


EXERCISES = Exercises(
    Exercise("11.1", "fix append_slots with copy-on-write", check_append_slots, hints=(
        "Follow the function above through a fork: parent and child share every block, "
        "count 2. The parent appends and copies its last block: what count does the old block "
        "keep, and who still points at it?",
        "Now let the last block be full when they fork. The new token cannot go into it "
        "anyway: is there anything to copy?",
        "Two fixes: copy only a last block that is partial (n % block_size != 0) and shared, "
        "and after taking the fresh block drop one reference to the old one.",
    ), solution=solutions.append_slots, wrong=(shown_append_slots,), rules=(
        Rule("a partial shared last block is replaced by a fresh one (copy-on-write)",
             "workload 1 (",
             checks.WRONG_APPENDS[0]),
        Rule("drop one reference to the old block",
             "workload 1 (",
             checks.WRONG_APPENDS[1]),
        Rule("only a partial last block is copied; a full one is not",
             "workload 4 (",
             checks.WRONG_APPENDS[2]),
    ),
        trivial=(lambda *a: None, lambda *a: []), compare_with=(
        "BlockManager.append_slots in course_lib/memory/v0/manager.py (and the scheduler's twin, "
        "FastBlockManager.append_decode, in course_lib/memory/v0/fast.py)")),
    Exercise("11.2", "the step's cache operations", check_cache_ops, hints=(
        "One layer at a time: key, value = eng.gpu_caches[layer]; block b is key[b] (all its "
        "slots and heads). Moving a block is an assignment, dst[d] = src[s]; do keys and "
        "values alike.",
        "Order: swap-out first (the GPU blocks it empties may already be the destination of "
        "a swap-in or a copy in this same step), then swap-in (a copy may copy from a block that "
        "just came back), then the copies.",
    ), solution=solutions.cache_ops, rules=(
        Rule("swap-out before swap-in (a swap-in may land in a block the swap-out empties)",
             "swap out [(2",
             checks.WRONG_CACHE_OPS[0]),
        Rule("copies last (a copy may read a block just swapped in)",
             "swap out [], swap in [(3",
             checks.WRONG_CACHE_OPS[1]),
        Rule("keys and values of every layer",
             "swap out [(1, 0)",
             checks.WRONG_CACHE_OPS[2]),
    ),
        trivial=(lambda *a: None,), compare_with=(
        "ModelRunner.execute_cache_ops in course_lib/engine/model_runner.py and swap_blocks / "
        "copy_blocks in course_lib/kernels/cache_ops.py")),
    Exercise("11.3", "serving_metrics", check_serving_metrics, hints=(
        "Per request: TTFT = times[0] - sent and E2EL = times[-1] - sent. The gaps "
        "between consecutive token times are its inter-token latencies; put every request's "
        "gaps in one list.",
        "A request's TPOT is (times[-1] - times[0]) / (len(times) - 1), and only requests "
        "with at least two tokens have one. Report np.mean(xs) and np.percentile(xs, "
        "percentile) (linear interpolation, not the nearest rank), times 1000 for "
        "milliseconds; an empty list counts as [0].",
    ), solution=solutions.serving_metrics, rules=(
        Rule("TPOT = (last token - first token) / (tokens - 1)",
             "1 request(s): records [(0, [0.25",
             serving.WRONG[0]),
        Rule("percentiles with np.percentile (linear interpolation)",
             "4 request(s): records [(0, [",
             serving.WRONG[1]),
        Rule("ITL pools every gap of all the requests in one list",
             "2 request(s): records [(0, [0.1,",
             serving.WRONG[2]),
    ),
        trivial=(lambda *a: None, lambda *a: {n: (0.0, 0.0) for n in serving.NAMES}), compare_with=(
        "calculate_metrics in vLLM's vllm/benchmarks/serve.py, then the course's "
        "Metrics.observe_step / observe_finished in course_lib/scheduler/metrics.py: the "
        "histograms vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds and "
        "vllm:request_time_per_output_token_seconds record the same quantities")),
)


hint = EXERCISES.print_hint            # ch11.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch11.solution("N.M"): a solution's code

