"""Chapter 11 (capstone) exercises: size the pool for a budget, then write the engine step.

* ``pool_blocks``: GPU blocks of the tiny model that fit a KV budget in bytes; the reference
  goes through ``course_lib.capacity`` (a :class:`ModelSpec` of the tiny model).
* ``mini_step``: one engine step built from the library's parts -- schedule, swap-out, swap-in,
  copy-on-write copies, forward through the paged cache, greedy candidates, update. The checker
  runs the learner's step in a loop (:func:`run_loop`) on workloads that fork samples (CoW
  copies) and preempt by swap and by recompute, and compares every token with the reference
  loop; ``tests/test_ch11.py`` checks that the reference loop equals ``LLMEngine``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib import capacity as cap
from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.exercises import Verdict, check
from course_lib.kernels.cache_ops import swap_blocks
from course_lib.kernels.reference import copy_blocks_ref
from course_lib.model import TinyLlama, allocate_kv_caches, make_attention_metadata
from course_lib.scheduler import Scheduler
from course_lib.sequence import Request, SamplingParams


def tiny_spec(model: TinyLlama) -> cap.ModelSpec:
    """The tiny model as a capacity ``ModelSpec`` (float32 cache)."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return cap.ModelSpec("tiny-llama", c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                         params, dtype_bytes=4, param_bytes=4.0)


def pool_blocks(budget_bytes: int, block_size: int, num_layers: int, num_kv_heads: int,
                head_dim: int, dtype_bytes: int) -> int:
    """Reference: blocks of ``block_size`` tokens (K and V, every layer) in ``budget_bytes``."""
    spec = cap.ModelSpec("x", num_layers, num_kv_heads, num_kv_heads, head_dim, 1,
                         dtype_bytes=dtype_bytes)
    return cap.num_gpu_blocks(budget_bytes, cap.block_bytes(spec, block_size))


def check_pool_blocks(fn: Callable[[int, int, int, int, int, int], int]) -> Verdict:
    cases = [(1 << 20, 16, 4, 2, 32, 4), (0, 16, 4, 2, 32, 4), (32767, 16, 4, 2, 32, 4),
             (32768, 16, 4, 2, 32, 4), (8 << 30, 16, 32, 8, 128, 2), (10 ** 9, 1, 80, 8, 128, 2),
             (123456789, 256, 61, 1, 576, 1), (5000, 4, 2, 1, 8, 2)]
    return check("11.1 pool_blocks", fn, pool_blocks, cases)


@dataclass
class MiniEngine:
    """What a step needs: the scheduler (with its block manager), the model, the caches."""

    sched: Scheduler
    model: TinyLlama
    gpu_caches: list
    cpu_caches: list

    @staticmethod
    def build(model: TinyLlama, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
              mode: str) -> MiniEngine:
        sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                          max_model_len=model.config.max_position,
                                          preemption_mode=mode),
                          CacheConfig(block_size, num_gpu_blocks, num_cpu_blocks))
        cpu = allocate_kv_caches(model.config, num_cpu_blocks, block_size) \
            if num_cpu_blocks else []
        return MiniEngine(sched, model, allocate_kv_caches(model.config, num_gpu_blocks,
                                                           block_size), cpu)


@torch.no_grad()
def mini_step(eng: MiniEngine) -> list[Request]:
    """Reference: one greedy engine step; returns the requests finished in it."""
    out = eng.sched.schedule()
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
             num_gpu_blocks: int, num_cpu_blocks: int, mode: str,
             max_steps: int = 2000) -> list[list[list[int]]]:
    """Run ``step`` until every prompt is done; the tokens of each sample of each prompt."""
    eng = MiniEngine.build(model, block_size, num_gpu_blocks, num_cpu_blocks, mode)
    reqs = [eng.sched.add_request(i, p, SamplingParams(max_tokens=max_tokens, n=n,
                                                       temperature=0.0))
            for i, p in enumerate(prompts)]
    for _ in range(max_steps):
        if not eng.sched.has_unfinished_requests():
            break
        step(eng)
    else:
        raise RuntimeError(f"not done after {max_steps} steps")
    eng.sched.check_invariants()
    bm = eng.sched.block_manager
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks, "blocks were not given back"
    return [r.outputs() for r in reqs]


WORKLOADS = [  # prompts, max_tokens, n, block_size, gpu blocks, cpu blocks, preemption
    (["And God said"], 12, 1, 4, 32, 0, "recompute"),
    (["And God said", "Jesus wept. And", "In the beginning"], 20, 1, 16, 32, 0, "recompute"),
    (["And God said unto Moses, I"], 10, 3, 4, 32, 0, "recompute"),     # fork + CoW
    (["And God said", "Blessed are the", "The LORD is my"], 40, 1, 4, 20, 40, "swap"),
    (["And God said", "Blessed are the", "The LORD is my"], 40, 1, 4, 20, 0, "recompute"),
    (["And the", "For God so loved"], 24, 2, 4, 24, 48, "swap"),
]


def check_mini_step(fn: Callable[[MiniEngine], list[Request]], model: TinyLlama) -> Verdict:
    """Runs ``fn`` as the step of a loop on each workload of :data:`WORKLOADS`."""
    from course_lib.model import ByteTokenizer

    tok = ByteTokenizer()
    cases = [([tok.encode(p) for p in w[0]], *w[1:]) for w in WORKLOADS]
    return check("11.2 mini_step", lambda *c: run_loop(fn, model, *c),
                 lambda *c: run_loop(mini_step, model, *c), cases)
