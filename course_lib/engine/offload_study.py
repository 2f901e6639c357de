"""The CPU offload tier measured on the real engine: two workloads whose reused prefixes
outgrow the GPU pool, each run with no offload, with the tier
(:class:`~course_lib.engine.cpu_offload.CPUOffloadConnector`) and with V0's swap space of the
same CPU bytes; a sweep over GPU pool sizes x tier sizes; and requests run one at a time with
where each one's prompt came from (``bench/offload.py``, chapter 13 and its widget
:mod:`course_lib.viz.offload`, ``tests/test_offload_study.py``).

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

What is measured (:class:`OffloadRow`): where the prompt tokens looked up came from, as shares
of the same denominator, so that they add up: found in the GPU prefix cache
(``gpu_hit_rate``) or loaded from the CPU tier (``cpu_hit_rate``), the rest computed. The
denominator is every admission's lookup, re-admissions after a preemption included (vLLM
0.33.0's exported ``vllm:prefix_cache_queries`` / ``_hits`` leave those out,
``PrefixCacheStats.record`` in ``vllm/v1/metrics/stats.py``; here they count, because the tier
serves them too). Then the prompt tokens the model computed (``vllm:prompt_tokens_total``,
recomputations after a preemption included) and how many fewer than with no offload; TTFT
(arrival to first token on the engine's clock, wall-clock seconds by default, ``clock=`` for
another: real seconds of this machine, so machine-dependent; a request waits for the others of
its round, as it would behind a busy server); and whether every answer's tokens are those of
the run with no offload (they must be: a loaded block is a bit copy of the one computed
before; greedy and seeded sampling).

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
from .outputs import RequestOutput

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
        # random.Random takes any hashable, but the sampling seeds are 1000 * seed + key
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")


class WorkloadRun(NamedTuple):
    """One engine's run of a workload: every answer's tokens in the order sent, every
    request's TTFT (s), and what V0's swap moved (blocks swapped out and in)."""

    answers: tuple[tuple[int, ...], ...]
    ttfts: tuple[float, ...]
    swapped_out: int
    swapped_in: int


class PromptRun(NamedTuple):
    """One request run alone (:func:`run_prompts`): its generated tokens, and its prompt's
    tokens found in the GPU prefix cache, loaded from the CPU tier, and computed (prefill)."""

    tokens: tuple[int, ...]
    gpu_hit_tokens: int
    tier_hit_tokens: int
    computed_tokens: int


class OffloadRow(NamedTuple):
    """One configuration on one workload at one GPU pool size (module docstring).
    ``cpu_blocks``: the tier's or V0's swap space's blocks, 0 with no offload;
    ``gpu_hit_rate`` and ``cpu_hit_rate`` share one denominator (they add up); ``cpu_hit_rate``
    is None without a tier; ``prefill_saved`` and ``same_tokens`` are against the V1 run with
    no offload at the same GPU pool size."""

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


# ------------------------------------------------------------------------- the engines
def make_engine(model: TinyLlama, gpu_blocks: int, *,
                tier: int | CPUOffloadConnector | None = None, swap_blocks: int = 0,
                max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                clock: Callable[[], float] | None = None,
                offload_prompt_only: bool = True) -> LLMEngine:
    """An engine of ``gpu_blocks`` blocks of :data:`BLOCK_SIZE` tokens, its prefix cache on, no
    watermark, no stop token (every answer has ``max_tokens`` tokens):

    * V1 (hash prefix cache) with no offload (the default);
    * V1 with a CPU tier: ``tier`` blocks of :class:`CPUOffloadConnector`, or ``tier`` itself
      when it is a connector (chapter 13's ``TracingConnector``);
    * V0 with ``swap_blocks`` of swap space and swap preemption (``swap_blocks`` > 0).

    ``clock``: the engine's (TTFT's), ``time.perf_counter`` by default.
    ``offload_prompt_only``: for a tier given as a number of blocks, the tier's option (True,
    vLLM's default: prompt blocks only; False: generated blocks too)."""
    if isinstance(tier, int) and not isinstance(tier, bool):
        if tier < 1:
            raise ValueError(f"tier must be a number of CPU blocks >= 1 (None: no tier), "
                             f"got {tier}")
        tier = CPUOffloadConnector(tier, offload_prompt_only=offload_prompt_only)
    elif tier is not None and not isinstance(tier, CPUOffloadConnector):
        raise ValueError(f"tier must be None, a number of CPU blocks or a "
                         f"CPUOffloadConnector, got {tier!r}")
    if isinstance(swap_blocks, bool) or not isinstance(swap_blocks, int) or swap_blocks < 0:
        raise ValueError(f"swap_blocks must be an int >= 0, got {swap_blocks!r}")
    v0 = swap_blocks > 0
    if v0 and tier is not None:
        raise ValueError("a CPU tier is V1's, swap space V0's: give tier or swap_blocks, "
                         "not both")
    cc = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=gpu_blocks, watermark=0.0,
                     enable_prefix_caching=True, num_cpu_blocks=swap_blocks)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=model.config.max_position,
                         preemption_mode="swap" if v0 else "recompute")
    kwargs = {} if clock is None else {"clock": clock}
    return LLMEngine(model, sc, cc, design="v0" if v0 else "v1", kv_connector=tier,
                     stop_token_ids=(), **kwargs)


def _config_engine(model: TinyLlama, config: str, gpu_blocks: int, cpu_blocks: int,
                   clock: Callable[[], float] | None, offload_prompt_only: bool = True
                   ) -> LLMEngine:
    """:func:`make_engine` for one of :data:`CONFIGS` (checked by the caller), ``cpu_blocks``
    the tier's or the swap space's."""
    return make_engine(model, gpu_blocks, clock=clock,
                       tier=cpu_blocks if config == CONFIGS[1] else None,
                       swap_blocks=cpu_blocks if config == CONFIGS[2] else 0,
                       offload_prompt_only=offload_prompt_only)


def _lookups(engine: LLMEngine) -> tuple[int, int, int]:
    """``(looked up, found on the GPU, loaded from the tier)``, prompt tokens so far, every
    admission counted (re-admissions after a preemption too: V1 counts them apart)."""
    bm, conn = engine.block_manager, engine.kv_connector
    stats = bm.prefix_cache_stats
    # V1's manager keeps re-admissions apart (vLLM's PrefixCacheStats); V0's counts them 0
    queried = stats.queries + stats.preempted_queries
    hits = stats.hits + stats.preempted_hits
    return queried, hits, 0 if conn is None else conn.num_hit_tokens


# ------------------------------------------------------------------------- running requests
def _run_round(engine: LLMEngine, requests: Sequence[tuple[list[int], SamplingParams]], *,
               check: bool = False, swaps: list[int] | None = None) -> list[RequestOutput]:
    """Add ``requests`` at once and step until all finished; their outputs in order.
    ``check``: ``engine.check_invariants()`` after every step; ``swaps``: V0's blocks swapped
    out and in, added to it. RuntimeError if a request ends otherwise than by its length."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        if swaps is not None:
            swaps[0] += len(engine.last_output.blocks_to_swap_out)
            swaps[1] += len(engine.last_output.blocks_to_swap_in)
        if check:
            engine.check_invariants()
    outs = [done[rid] for rid in ids]
    for out in outs:
        if out.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"request {out.request_id} finished with "
                               f"{out.finish_reason!r}: {out.finish_detail}")
    return outs


def run_prompts(engine: LLMEngine, prompts: Sequence[Sequence[int]],
                params: SamplingParams) -> list[PromptRun]:
    """Each prompt alone, in order (the next added once the last finished), with the engine's
    invariants checked after every step; one :class:`PromptRun` each (chapter 13, sections 1
    and 2: where each prompt's tokens came from)."""
    runs = []
    for prompt in prompts:
        _, gpu0, tier0 = _lookups(engine)
        computed0 = engine.scheduler.num_prompt_tokens
        (out,) = _run_round(engine, [(list(prompt), params)], check=True)
        _, gpu, tier = _lookups(engine)
        runs.append(PromptRun(tuple(out.outputs[0].token_ids), gpu - gpu0, tier - tier0,
                              engine.scheduler.num_prompt_tokens - computed0))
    return runs


def _sampling(workload: OffloadWorkload, sampled: bool, key: int) -> SamplingParams:
    return SamplingParams(max_tokens=workload.max_tokens, temperature=0.8 if sampled else 0.0,
                          seed=1000 * workload.seed + key)


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

    def run_round(requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[int, ...]]:
        outs = _run_round(engine, requests, check=check, swaps=swaps)
        ttfts.extend(out.ttft for out in outs)
        got = [tuple(out.outputs[0].token_ids) for out in outs]
        answers.extend(got)
        return got

    w = workload
    if w.kind == "chat":
        tok = engine.tokenizer
        history = [tok.encode(f"{SYSTEM_PROMPT}U{c}: the sea?\n") for c in range(w.num)]
        for turn in range(w.turns):
            got = run_round([(history[c], _sampling(w, sampled, 10 * c + turn))
                             for c in range(w.num)])
            for c, answer in enumerate(got):
                history[c] = history[c] + list(answer) + tok.encode(f"\nU: {turn}?\n",
                                                                    add_bos=False)
    else:
        prompts = rag_prompts(w)
        for start in range(0, len(prompts), w.concurrency):
            run_round([(p, _sampling(w, sampled, i))
                       for i, p in enumerate(prompts[start:start + w.concurrency], start)])
    return WorkloadRun(tuple(answers), tuple(ttfts), *swaps)


# ------------------------------------------------------------------------- the measurements
def _measure(model: TinyLlama, workload: OffloadWorkload, config: str, gpu_blocks: int,
             cpu_blocks: int, base: OffloadRow | None, base_answers: tuple | None, *,
             sampled: bool, check: bool, clock: Callable[[], float] | None,
             offload_prompt_only: bool = True) -> tuple[OffloadRow, WorkloadRun]:
    """One run of ``workload`` through ``config``, as a row against ``base`` (the no-offload
    row at this pool size and its answers; None: this run is that reference)."""
    engine = _config_engine(model, config, gpu_blocks, cpu_blocks, clock, offload_prompt_only)
    run = run_workload(engine, workload, sampled=sampled, check=check)
    queried, gpu_hits, tier_hits = _lookups(engine)
    conn = engine.kv_connector
    prefill = engine.scheduler.num_prompt_tokens
    ttfts = np.asarray(run.ttfts, dtype=float)
    row = OffloadRow(
        workload.kind, config, gpu_blocks, 0 if config == CONFIGS[0] else cpu_blocks,
        gpu_hits / queried if queried else 0.0,
        None if conn is None else (tier_hits / queried if queried else 0.0),
        prefill, 0 if base is None else base.prefill_tokens - prefill,
        float(ttfts.mean()), float(np.percentile(ttfts, 99)), engine.num_steps,
        engine.scheduler.num_preemptions, run.swapped_out + run.swapped_in,
        0 if conn is None else conn.num_stored_blocks,
        0 if conn is None else conn.num_loaded_blocks,
        0 if conn is None else conn.cpu_pool.num_evictions,
        base_answers is None or run.answers == base_answers)
    return row, run


def compare(model: TinyLlama, workload: OffloadWorkload, gpu_blocks: int, cpu_blocks: int, *,
            sampled: bool = False, check: bool = False, configs: Sequence[str] = CONFIGS,
            clock: Callable[[], float] | None = None) -> list[OffloadRow]:
    """``workload`` through each of ``configs`` at one GPU pool size, ``cpu_blocks`` for the
    tier and the swap space alike (the first config must be ``"V1, no offload"``, the
    reference for the prefill saved and the tokens), one row each. ``clock``: the engines'
    (TTFT's) clock, ``time.perf_counter`` by default."""
    if not configs or configs[0] != CONFIGS[0]:
        raise ValueError(f"configs must start with {CONFIGS[0]!r} (the reference), got "
                         f"{list(configs)!r}")
    for config in configs:
        if config not in CONFIGS:
            raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")
    if len(set(configs)) != len(configs):
        raise ValueError(f"configs must not repeat a config, got {list(configs)!r}")
    rows: list[OffloadRow] = []
    base_answers = None
    for config in configs:
        row, run = _measure(model, workload, config, gpu_blocks, cpu_blocks,
                            rows[0] if rows else None, base_answers, sampled=sampled,
                            check=check, clock=clock)
        base_answers = run.answers if base_answers is None else base_answers
        rows.append(row)
    return rows


def sweep(model: TinyLlama, workload: OffloadWorkload, gpu_blocks: Sequence[int],
          tier_blocks: Sequence[int], *, sampled: bool = False, check: bool = False,
          clock: Callable[[], float] | None = None,
          offload_prompt_only: bool = True) -> list[OffloadRow]:
    """``workload`` at each GPU pool size of ``gpu_blocks``, without a tier (``cpu_blocks`` 0)
    and with a tier of each of ``tier_blocks``: one :class:`OffloadRow` per run, GPU sizes in
    the order given, the run without a tier first (each tier's prefill saved and tokens are
    against it). The bench's sweep is one tier size; chapter 13's widget draws several.
    ``offload_prompt_only``: the tiers' option (a bool; True, vLLM's default, stores prompt
    blocks only, so a chat's answers are computed again at its next turn when the GPU lost
    them; False stores them too)."""
    if not isinstance(offload_prompt_only, bool):
        raise ValueError(f"offload_prompt_only must be a bool, got {offload_prompt_only!r}")
    if not gpu_blocks or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                             for n in gpu_blocks):
        raise ValueError(f"gpu_blocks must be GPU pool sizes >= 1, got {list(gpu_blocks)}")
    if not tier_blocks or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                              for n in tier_blocks):
        raise ValueError(f"tier_blocks must be tier sizes >= 1 (no tier is always run), "
                         f"got {list(tier_blocks)}")
    rows = []
    for n in gpu_blocks:
        plain, run = _measure(model, workload, CONFIGS[0], n, 0, None, None, sampled=sampled,
                              check=check, clock=clock)
        rows.append(plain)
        for cpu in tier_blocks:
            rows.append(_measure(model, workload, CONFIGS[1], n, cpu, plain, run.answers,
                                 sampled=sampled, check=check, clock=clock,
                                 offload_prompt_only=offload_prompt_only)[0])
    return rows
