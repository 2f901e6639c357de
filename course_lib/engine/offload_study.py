"""The CPU offload tier measured on the real engine: two workloads whose reused prefixes
outgrow the GPU pool, each run with no offload, with the tier
(:class:`~course_lib.engine.cpu_offload.CPUOffloadConnector`) and with V0's swap space of the
same CPU bytes; and a sweep of the tier's hit rate as the GPU pool shrinks (used by
``bench/offload.py``, chapter 13's widget and ``tests/test_offload_study.py``).

* **The multi-turn chat** (``kind="chat"``, chapter 12's case): ``num`` conversations after one
  short shared system prompt; a round sends one turn of every conversation at once, each
  prompt the whole conversation so far (its earlier prompts, the model's answers, a new user
  line). Between two turns of a conversation the others' turns fill the GPU pool, so its
  prefix has been evicted by the time it returns, unless the pool holds every conversation.
* **The RAG-like trace** (``kind="rag"``): ``num`` requests, ``concurrency`` at a time, each
  one or two of ``num_docs`` shared documents plus a short question. A document comes back
  after the others pushed it out of the GPU pool. Only a request's *first* document is a
  prefix another request can share in full: the second one's blocks hash with the first's
  (a prefix cache keys a block by everything before it), so a pair is reused only whole.

What is measured (:class:`OffloadRow`): the GPU prefix-cache hit rate (prompt tokens found
in the GPU pool / prompt tokens looked up, vLLM's ``vllm:prefix_cache_hits`` /
``_queries``); the CPU tier's hit rate (tokens loaded from it / tokens looked up past the GPU
hit); the prompt tokens the model computed (``vllm:prompt_tokens_total``, recomputations
after a preemption included) and how many fewer than with no offload; TTFT (arrival to first
token on the engine's clock, wall-clock seconds by default, ``compare(clock=...)`` for another:
real seconds of this machine, so machine-dependent; a request waits for the others of its
round, as it would behind a busy server); and whether every answer's tokens
are those of the run with no offload (they must be: a loaded block is a bit copy of the one
computed before; greedy and seeded sampling).

V0's swap (``preemption_mode="swap"``, ``CacheConfig.num_cpu_blocks``) is the paper's use of
CPU memory, and it is for something else: it keeps the blocks of a *preempted running*
sequence until it can come back, instead of recomputing them. It never serves a prefix to
another request (V0's prefix cache is the GPU pool alone), and a finished request's blocks
never go there. On these workloads it only matters when a round's requests overflow the pool
mid-decode; its row shows what that buys, beside the tier's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..config import CacheConfig, SchedulerConfig
from ..model.llama import TinyLlama
from ..sequence import SamplingParams
from .cpu_offload import CPUOffloadConnector
from .llm_engine import LLMEngine

BLOCK_SIZE = 4              # tokens per block: small, so the tiny model's prompts fill pools
KINDS = ("chat", "rag")
CONFIGS = ("V1, no offload", "V1 + CPU tier", "V0 + swap")
SYSTEM_PROMPT = "S: be brief.\n"


@dataclass(frozen=True)
class OffloadWorkload:
    """One of the two workloads (module docstring). ``num``: conversations (chat) or requests
    (rag); ``turns``: per conversation (chat); ``num_docs``, ``doc_len`` (tokens),
    ``concurrency`` (requests sent at once): rag; ``max_tokens`` per answer; ``seed`` picks
    the documents, the questions and the sampling seeds."""

    kind: str
    num: int = 6
    turns: int = 4
    num_docs: int = 6
    doc_len: int = 28
    concurrency: int = 3
    max_tokens: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("num", "turns", "num_docs", "doc_len", "concurrency", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class WorkloadRun(NamedTuple):
    """One engine's run of a workload: every answer's tokens in the order sent, every
    request's TTFT (s), and what V0's swap moved (blocks swapped out and in)."""

    answers: tuple[tuple[int, ...], ...]
    ttfts: tuple[float, ...]
    swapped_out: int
    swapped_in: int


class OffloadRow(NamedTuple):
    """One configuration on one workload (module docstring). ``cpu_hit_rate`` is None without
    a tier; ``prefill_saved`` is against the V1 run with no offload; ``same_tokens``: every
    answer equals that run's."""

    workload: str
    config: str
    gpu_blocks: int
    cpu_blocks: int
    gpu_hit_rate: float
    cpu_hit_rate: float | None
    prefill_tokens: int
    prefill_saved: int
    ttft_mean: float
    ttft_p99: float
    steps: int                  # engine steps the whole workload took
    preemptions: int
    swapped_blocks: int         # V0: blocks swapped out + in
    cpu_stored: int             # tier: blocks stored / loaded / evicted
    cpu_loaded: int
    cpu_evictions: int
    same_tokens: bool


class SweepRow(NamedTuple):
    """The tier at one GPU pool size: its hit rate and the prefill it saves (chapter 13)."""

    gpu_blocks: int
    gpu_hit_rate: float          # with the tier (the same as without: it sits behind)
    cpu_hit_rate: float
    prefill_no_offload: int
    prefill_with_tier: int
    prefill_saved: int
    same_tokens: bool


# ------------------------------------------------------------------------- the workloads
def _sampling(workload: OffloadWorkload, sampled: bool, key: int) -> SamplingParams:
    return SamplingParams(max_tokens=workload.max_tokens, temperature=0.8 if sampled else 0.0,
                          seed=1000 * workload.seed + key)


def _chat_rounds(engine: LLMEngine, w: OffloadWorkload, sampled: bool,
                 run_round: Callable) -> None:
    tok = engine.tokenizer
    history = [tok.encode(f"{SYSTEM_PROMPT}U{c}: the sea?\n") for c in range(w.num)]
    for turn in range(w.turns):
        answers = run_round([(history[c], _sampling(w, sampled, 10 * c + turn))
                             for c in range(w.num)])
        for c, answer in enumerate(answers):
            history[c] = history[c] + list(answer) + tok.encode(f"\nU: {turn}?\n",
                                                                 add_bos=False)


def rag_prompts(w: OffloadWorkload) -> list[list[int]]:
    """The RAG-like prompts: BOS, one or two documents (printable bytes, ``doc_len`` each),
    a question of 4-12 bytes; the documents drawn by ``w.seed``."""
    from ..model.tokenizer import BOS_ID

    rng = random.Random(w.seed)
    docs = [[rng.randrange(32, 127) for _ in range(w.doc_len)] for _ in range(w.num_docs)]
    prompts = []
    for _ in range(w.num):
        chosen = rng.sample(range(w.num_docs), rng.choice((1, 2)) if w.num_docs > 1 else 1)
        question = [rng.randrange(32, 127) for _ in range(rng.randint(4, 12))]
        prompts.append([BOS_ID] + [t for d in chosen for t in docs[d]] + question)
    return prompts


def run_workload(engine: LLMEngine, workload: OffloadWorkload, *, sampled: bool = False,
                 check: bool = False) -> WorkloadRun:
    """Send ``workload`` to ``engine`` round by round (a round's requests at once, the next
    round once all finished); ``check``: ``engine.check_invariants()`` after every step."""
    answers: list[tuple[int, ...]] = []
    ttfts: list[float] = []
    swaps = [0, 0]

    def run_round(requests: Sequence[tuple[list[int], SamplingParams]]
                  ) -> list[tuple[int, ...]]:
        ids = [engine.add_request(prompt, params) for prompt, params in requests]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
            last = engine.last_output
            swaps[0] += len(last.blocks_to_swap_out)
            swaps[1] += len(last.blocks_to_swap_in)
            if check:
                engine.check_invariants()
        got = []
        for rid in ids:
            out = done[rid]
            if out.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request {rid} finished with {out.finish_reason!r}: "
                                   f"{out.finish_detail}")
            got.append(tuple(out.outputs[0].token_ids))
            ttfts.append(out.ttft)
        answers.extend(got)
        return got

    if workload.kind == "chat":
        _chat_rounds(engine, workload, sampled, run_round)
    else:
        prompts = rag_prompts(workload)
        for start in range(0, len(prompts), workload.concurrency):
            run_round([(p, _sampling(workload, sampled, i))
                       for i, p in enumerate(prompts[start:start + workload.concurrency],
                                             start)])
    return WorkloadRun(tuple(answers), tuple(ttfts), *swaps)


# ------------------------------------------------------------------------- the engines
def make_engine(model: TinyLlama, config: str, gpu_blocks: int, cpu_blocks: int, *,
                max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                clock: Callable[[], float] | None = None) -> LLMEngine:
    """An engine for one of :data:`CONFIGS`: V1 (hash prefix cache) with no offload or with a
    CPU tier of ``cpu_blocks``, or V0 (its prefix cache on) with ``cpu_blocks`` of swap space
    and swap preemption. Blocks of :data:`BLOCK_SIZE` tokens, no watermark, no stop token
    (every answer has ``max_tokens`` tokens)."""
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")
    v0 = config == "V0 + swap"
    cc = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=gpu_blocks, watermark=0.0,
                     enable_prefix_caching=True, num_cpu_blocks=cpu_blocks if v0 else 0)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=model.config.max_position,
                         preemption_mode="swap" if v0 else "recompute")
    conn = CPUOffloadConnector(cpu_blocks) if config == "V1 + CPU tier" else None
    kwargs = {} if clock is None else {"clock": clock}
    return LLMEngine(model, sc, cc, design="v0" if v0 else "v1", kv_connector=conn,
                     stop_token_ids=(), **kwargs)


def _row(workload: OffloadWorkload, config: str, engine: LLMEngine, run: WorkloadRun,
         gpu_blocks: int, cpu_blocks: int, base: tuple[int, tuple] | None) -> OffloadRow:
    stats = engine.block_manager.prefix_cache_stats
    conn = engine.kv_connector
    prefill = engine.scheduler.num_prompt_tokens
    ttfts = np.asarray(run.ttfts, dtype=float)
    base_prefill, base_answers = base if base is not None else (prefill, run.answers)
    return OffloadRow(
        workload.kind, config, gpu_blocks, cpu_blocks,
        stats.hits / stats.queries if stats.queries else 0.0,
        None if conn is None else conn.hit_rate, prefill, base_prefill - prefill,
        float(ttfts.mean()), float(np.percentile(ttfts, 99)), engine.num_steps,
        engine.scheduler.num_preemptions,
        run.swapped_out + run.swapped_in,
        0 if conn is None else conn.num_stored_blocks,
        0 if conn is None else conn.num_loaded_blocks,
        0 if conn is None else conn.cpu_pool.num_evictions,
        run.answers == base_answers)


def compare(model: TinyLlama, workload: OffloadWorkload, gpu_blocks: int, cpu_blocks: int, *,
            sampled: bool = False, check: bool = False, configs: Sequence[str] = CONFIGS,
            clock: Callable[[], float] | None = None) -> list[OffloadRow]:
    """``workload`` through each of ``configs`` (the first must be ``"V1, no offload"``, the
    reference for the prefill saved and the tokens), one row each. ``clock``: the engines'
    (TTFT's) clock, ``time.perf_counter`` by default."""
    if not configs or configs[0] != CONFIGS[0]:
        raise ValueError(f"configs must start with {CONFIGS[0]!r} (the reference), got "
                         f"{list(configs)!r}")
    rows, base = [], None
    for config in configs:
        engine = make_engine(model, config, gpu_blocks, cpu_blocks, clock=clock)
        run = run_workload(engine, workload, sampled=sampled, check=check)
        row = _row(workload, config, engine, run, gpu_blocks, cpu_blocks, base)
        if base is None:
            base = (row.prefill_tokens, run.answers)
        rows.append(row)
    return rows


def sweep(model: TinyLlama, workload: OffloadWorkload, gpu_blocks: Sequence[int],
          cpu_blocks: int, *, sampled: bool = False) -> list[SweepRow]:
    """The CPU tier's hit rate and the prefill it saves at each GPU pool size (chapter 13's
    widget plots them as the pool shrinks): no offload beside the tier, per size."""
    rows = []
    for n in gpu_blocks:
        plain, tier = compare(model, workload, n, cpu_blocks, sampled=sampled,
                              configs=CONFIGS[:2])
        rows.append(SweepRow(n, tier.gpu_hit_rate, tier.cpu_hit_rate or 0.0,
                             plain.prefill_tokens, tier.prefill_tokens, tier.prefill_saved,
                             tier.same_tokens))
    return rows
