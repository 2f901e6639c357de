"""The CPU offload tier measured on the real engine: a multi-turn chat whose conversations
outgrow the GPU pool, at several GPU pool sizes, with and without a tier (chapter 13's widget,
:mod:`course_lib.viz.offload`).

* :func:`run_prompts`: requests one at a time through an engine, each one's tokens and where
  its prompt came from: the GPU prefix cache, the CPU tier, or computed.
* :func:`chat_prompts_run`: the chat (:data:`CHAT`): ``num_convs`` conversations taking turns,
  each prompt the whole conversation so far plus a new line, so that between two turns of one
  conversation the others evict it from a small GPU pool.
* :func:`offload_sweep`: the chat at each GPU pool size, without a tier and with each tier
  size: one :class:`OffloadRow` per run, tokens compared with the run without a tier.

Every rate is over the same denominator, the prompt tokens looked up (vLLM's
``vllm:prefix_cache_queries``), so that GPU hits + CPU-tier hits + computed = 1 minus the
last token of each prompt (always computed, for the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..config import CacheConfig, SchedulerConfig
from ..model.llama import TinyLlama
from ..sequence import SamplingParams
from .cpu_offload import CPUOffloadConnector
from .llm_engine import LLMEngine

BLOCK_SIZE = 4


class PromptRun(NamedTuple):
    """One request run alone: its generated tokens, and its prompt's tokens found in the GPU
    prefix cache, loaded from the CPU tier, and computed (prefill)."""
    tokens: tuple[int, ...]
    gpu_hit_tokens: int
    tier_hit_tokens: int
    computed_tokens: int


def make_engine(model: TinyLlama, num_gpu_blocks: int,
                connector: CPUOffloadConnector | None = None) -> LLMEngine:
    """A V1 engine with the hash prefix cache, blocks of :data:`BLOCK_SIZE` tokens,
    ``num_gpu_blocks`` of them, and ``connector`` (None: no tier)."""
    cc = CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, watermark=0.0,
                     enable_prefix_caching=True)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                         max_model_len=model.config.max_position)
    return LLMEngine(model, sc, cc, design="v1", kv_connector=connector, stop_token_ids=(),
                     clock=lambda: 0.0)


def run_prompts(engine: LLMEngine, prompts: Sequence[Sequence[int]],
                params: SamplingParams) -> list[PromptRun]:
    """Each prompt alone, in order (the next added once the last finished), with the engine's
    invariants checked after every step; one :class:`PromptRun` each."""
    return [_run_one(engine, list(p), params) for p in prompts]


def _run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> PromptRun:
    conn, kvm, sched = engine.kv_connector, engine.block_manager, engine.scheduler
    hits0, tier0 = kvm.prefix_cache_stats.hits, conn.num_hit_tokens if conn else 0
    computed0 = sched.num_prompt_tokens
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.check_invariants()
    (out,) = outs
    return PromptRun(tuple(out.outputs[0].token_ids), kvm.prefix_cache_stats.hits - hits0,
                     (conn.num_hit_tokens if conn else 0) - tier0,
                     sched.num_prompt_tokens - computed0)


@dataclass(frozen=True)
class Chat:
    """A multi-turn chat for the tiny model: ``num_convs`` conversations, ``turns`` turns
    each, taken in turn (turn 0 of each, then turn 1 of each ...); each answer
    ``max_tokens`` long, greedy."""
    num_convs: int = 4
    turns: int = 3
    max_tokens: int = 6


CHAT = Chat()


def chat_prompts_run(engine: LLMEngine, chat: Chat = CHAT) -> list[PromptRun]:
    """The chat through ``engine``: each prompt is the conversation so far (its earlier
    prompts and answers) and a new line; one :class:`PromptRun` per turn, in order."""
    tok = engine.tokenizer
    history = {c: tok.encode(f"Conversation {c}: tell me about the sea")
               for c in range(chat.num_convs)}
    params = SamplingParams(max_tokens=chat.max_tokens, temperature=0.0)
    runs = []
    for turn in range(chat.turns):
        for c in range(chat.num_convs):
            run = _run_one(engine, history[c], params)
            runs.append(run)
            history[c] = history[c] + list(run.tokens) + tok.encode(f" and then {turn}",
                                                                     add_bos=False)
    return runs


@dataclass(frozen=True)
class OffloadRow:
    """One run of the chat: the GPU pool and tier sizes (blocks; 0: no tier), the share of
    prompt tokens looked up that the GPU prefix cache found and that the tier loaded, the
    prompt tokens computed (prefill), and whether its tokens are the run without a tier's."""
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu_hit_rate: float
    cpu_hit_rate: float
    prefill_tokens: int
    tokens_match: bool


def offload_sweep(model: TinyLlama, gpu_blocks: Sequence[int] = (64, 40, 24),
                  tier_blocks: Sequence[int] = (24, 96), chat: Chat = CHAT
                  ) -> list[OffloadRow]:
    """The chat at each of ``gpu_blocks`` without a tier (``num_cpu_blocks`` 0) and with a
    tier of each of ``tier_blocks`` blocks: one :class:`OffloadRow` per run, GPU sizes in the
    order given. The smallest GPU pool must hold one conversation's longest prompt."""
    if not gpu_blocks or any(n < 1 for n in gpu_blocks):
        raise ValueError(f"gpu_blocks must be GPU pool sizes >= 1, got {list(gpu_blocks)}")
    if any(n < 1 for n in tier_blocks):
        raise ValueError(f"tier_blocks must be tier sizes >= 1 (no tier is always run), "
                         f"got {list(tier_blocks)}")
    rows = []
    for n in gpu_blocks:
        base = None
        for cpu in (0, *tier_blocks):
            conn = CPUOffloadConnector(cpu) if cpu else None
            engine = make_engine(model, n, conn)
            runs = chat_prompts_run(engine, chat)
            tokens = [r.tokens for r in runs]
            base = tokens if base is None else base
            queries = engine.block_manager.prefix_cache_stats.queries
            rows.append(OffloadRow(n, cpu, sum(r.gpu_hit_tokens for r in runs) / queries,
                                   sum(r.tier_hit_tokens for r in runs) / queries,
                                   sum(r.computed_tokens for r in runs), tokens == base))
    return rows
