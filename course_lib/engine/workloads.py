"""Workloads for the real engine: traces scaled to the tiny model, a trace replay, the static
baseline, and the memory saved by sharing (used by ``bench/engine.py``, the CLI and chapter 10).

* :func:`model_trace`: a ShareGPT-like or Alpaca-like trace whose lengths fit the model's
  256-token context (ShareGPT lengths scaled by 256 / 2048; Alpaca's already fit) and whose
  prompt tokens are bytes.
* :func:`run_trace`: feed a trace to an :class:`~course_lib.engine.llm_engine.LLMEngine` at
  its arrival times (engine clock) and run it to completion.
* :func:`run_static`: the systems before paging -- each request reserves a contiguous cache of
  ``max_len`` slots, and requests run in static batches (a batch starts when the previous one
  has fully finished) -- with the same model and kernels, at the same KV memory.
* :func:`sharing_savings`: blocks saved by sharing (parallel sampling, beam search) over a run:
  ``1 - held blocks / blocks without sharing``, summed over steps (the vLLM paper's measure).
* :func:`simulated_sharing_savings`: the same measure without a model (the V0 scheduler and
  block manager with ``sim.fake_sampler``), for traces at the paper's lengths (chapter 05);
  :data:`PAPER_SHARING_SAVINGS` holds the paper's figures to compare with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import CacheConfig, SchedulerConfig
from ..kernels.backends import get_attn_backend
from ..model.attention import make_attention_metadata
from ..model.llama import TinyLlama, allocate_kv_caches
from ..scheduler.scheduler import Scheduler
from ..sequence import SamplingParams
from ..sim.fake_sampler import fake_samples
from ..sim.traces import TraceRequest, alpaca_lengths, poisson_arrivals, sharegpt_lengths
from .llm_engine import LLMEngine
from .outputs import RequestOutput

TRACES = ("sharegpt", "alpaca")


def model_trace(kind: str, num_requests: int, *, seed: int = 0, max_len: int = 256,
                rate: float = float("inf")) -> list[TraceRequest]:
    """A trace for the tiny model: prompt + output <= ``max_len`` tokens, prompt tokens are
    random bytes (1..255). ``kind``: "sharegpt" (lengths of a 2,048-token server scaled by
    ``max_len / 2048``) or "alpaca" (short instructions; lengths kept)."""
    if kind not in TRACES:
        raise ValueError(f"trace must be one of {TRACES}, got {kind!r}")
    if max_len < 4:
        raise ValueError(f"max_len must be >= 4, got {max_len}")
    if kind == "sharegpt":
        lens = sharegpt_lengths(num_requests, seed=seed, max_total_len=2048)
        scale = max_len / 2048
        ins = np.maximum(1, np.rint(lens.input_lens * scale)).astype(int)
        outs = np.maximum(1, np.rint(lens.output_lens * scale)).astype(int)
    else:
        lens = alpaca_lengths(num_requests, seed=seed, max_total_len=max_len)
        ins, outs = lens.input_lens, lens.output_lens
    outs = np.minimum(outs, max_len - ins)            # keep every request inside the context
    rng = np.random.default_rng([seed, 7])
    times = poisson_arrivals(num_requests, rate, seed)
    return [TraceRequest(i, t, tuple(rng.integers(1, 256, size=int(p)).tolist()), int(o))
            for i, (t, p, o) in enumerate(zip(times, ins, outs, strict=True))]


@dataclass
class TraceRun:
    outputs: list[RequestOutput]
    duration_s: float
    generated_tokens: int
    num_steps: int
    num_preemptions: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.duration_s if self.duration_s else 0.0


def run_trace(engine: LLMEngine, trace: Sequence[TraceRequest], *,
              params: SamplingParams | None = None, progress: bool = False,
              on_step=None) -> TraceRun:
    """Add each request when the engine clock passes its arrival time (all at once for an
    infinite rate), step until everything finished. ``params`` overrides the sampling (its
    ``max_tokens`` is replaced by each request's ``output_len``); default greedy."""
    base = params or SamplingParams(temperature=0.0)
    pending = sorted(trace, key=lambda t: (t.arrival_time, t.request_id))
    gen0, steps0, pre0 = engine.num_generated_tokens, engine.num_steps, \
        engine.scheduler.num_preemptions
    start, i, outputs = engine.now(), 0, []
    bar = tqdm(total=len(pending), disable=not progress, desc="replay", unit="req")
    while i < len(pending) or engine.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_time <= engine.now() - start:
            t = pending[i]
            sp = replace(base, max_tokens=t.output_len, n=max(base.n, t.n),
                         beam_width=max(base.beam_width, t.beam_width))
            engine.add_request(list(t.prompt_token_ids), sp, arrival_time=start + t.arrival_time)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[i].arrival_time - (engine.now() - start))))
            continue
        done = engine.step()
        outputs += done
        bar.update(len(done))
        if on_step is not None:
            on_step(engine, engine.last_output)
    bar.close()
    return TraceRun(sorted(outputs, key=lambda o: o.request_id), engine.now() - start,
                    engine.num_generated_tokens - gen0, engine.num_steps - steps0,
                    engine.scheduler.num_preemptions - pre0)


@torch.no_grad()
def run_static(model: TinyLlama, trace: Sequence[TraceRequest], num_slots: int, *,
               max_len: int = 256, attn_impl: str = "auto", pad_finished: bool = True,
               progress: bool = False) -> TraceRun:
    """Static batching with contiguous max-length caches (FasterTransformer / Orca-Max style).

    ``num_slots // max_len`` requests fit the KV memory at once; each gets one contiguous
    region of ``max_len`` slots (a block of size ``max_len``). A batch of that many requests
    (arrival order) is prefilled together, then decoded one token per step until its longest
    request is done; a finished request keeps its region until the batch ends and, with
    ``pad_finished`` (what a static batch of a fixed shape does, e.g. FasterTransformer or a
    padded ``generate``), keeps being computed as padding; without it, it stops computing (a
    kinder baseline). Greedy, no stop token: request ``r`` generates ``output_len`` tokens,
    and only those are counted."""
    batch_size = num_slots // max_len
    if batch_size < 1:
        raise ValueError(f"num_slots={num_slots} cannot hold one {max_len}-slot region")
    device = next(model.parameters()).device
    attn = get_attn_backend(attn_impl, device)
    caches = allocate_kv_caches(model.config, batch_size, max_len,
                                next(model.parameters()).dtype, device)
    reqs = sorted(trace, key=lambda t: (t.arrival_time, t.request_id))
    start, generated, steps = time.perf_counter(), 0, 0
    bar = tqdm(total=len(reqs), disable=not progress, desc="static", unit="req")
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        seqs = [list(t.prompt_token_ids) for t in batch]
        ctx = [0] * len(batch)
        left = [t.output_len for t in batch]
        while any(left):
            live = [s for s in range(len(batch))
                    if left[s] or (pad_finished and len(seqs[s]) < max_len)]
            feed = [seqs[s][ctx[s]:] for s in live]
            meta = make_attention_metadata([[s] for s in live], [ctx[s] for s in live],
                                           [len(f) for f in feed], max_len, device)
            ids = torch.tensor([t for f in feed for t in f], device=device)
            pos = torch.tensor([p for s, f in zip(live, feed, strict=True)
                                for p in range(ctx[s], ctx[s] + len(f))], device=device)
            logits = model(ids, pos, caches, meta, impl=attn)
            nxt = logits.index_select(0, meta.last_token_indices().to(device)).argmax(-1)
            for s, f, tok in zip(live, feed, nxt.tolist(), strict=True):
                ctx[s] += len(f)
                seqs[s].append(tok)
                if left[s]:
                    left[s] -= 1
                    generated += 1
            steps += 1
        bar.update(len(batch))
    bar.close()
    return TraceRun([], time.perf_counter() - start, generated, steps, 0)


@dataclass
class SharingResult:
    held_block_steps: int        # sum over steps of GPU blocks held (shared blocks once)
    unshared_block_steps: int    # sum over steps of blocks if every sequence had its own

    @property
    def saving(self) -> float:
        """Fraction of KV blocks sharing saved (the vLLM paper's Fig. 15 measure)."""
        if not self.unshared_block_steps:
            return math.nan
        return 1 - self.held_block_steps / self.unshared_block_steps


def saving_of_tables(tables: Sequence[Sequence[int]]) -> float:
    """Share of block-table entries that sharing saves at one instant: ``1 - distinct
    physical blocks / entries`` (0.0 for no tables)."""
    entries = sum(len(t) for t in tables)
    return 1 - len({b for t in tables for b in t}) / entries if entries else 0.0


def sharing_savings(engine: LLMEngine, trace: Sequence[TraceRequest],
                    params: SamplingParams, *, progress: bool = False) -> SharingResult:
    """Run ``trace`` with ``params`` (n > 1 or beam_width > 1) and add up, after every step,
    the blocks held and the blocks the same sequences would hold without sharing."""
    acc = SharingResult(0, 0)

    def watch(e: LLMEngine, out) -> None:
        usage = e.block_manager.usage()
        acc.held_block_steps += usage.num_held_blocks
        acc.unshared_block_steps += usage.num_table_entries

    run_trace(engine, trace, params=params, progress=progress, on_step=watch)
    return acc


# The vLLM paper (Kwon et al., SOSP 2023), section 6.3, Fig. 15: memory saved by sharing,
# OPT-13B on the Alpaca trace, in percent, by number of samples / beam width.
PAPER_SHARING_SAVINGS: dict[str, dict[int, float]] = {
    "parallel sampling": {2: 6.09, 4: 8.53, 6: 9.79},
    "beam search": {2: 37.56, 4: 53.13, 6: 55.16},
}


def simulated_sharing_savings(trace: Sequence[TraceRequest], params: SamplingParams, *,
                              block_size: int = 16) -> SharingResult:
    """:func:`sharing_savings` without a model: every request of ``trace`` is queued at once
    with ``params`` (its ``max_tokens`` replaced by each request's ``output_len``), the V0
    scheduler runs it on a pool large enough that nothing is preempted, and
    ``fake_samples`` stands in for the model (every sample runs to its ``output_len``; beams
    get pseudo-random log-probabilities, so which beams survive is chance, not a model's)."""
    width = max(params.n, params.beam_width)
    need = sum(width * (math.ceil((t.prompt_len + t.output_len) / block_size) + 1)
               for t in trace)
    longest = max((t.prompt_len + t.output_len for t in trace), default=1)
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096,
                                      max_model_len=longest),
                      CacheConfig(block_size=block_size, num_gpu_blocks=need + 1, watermark=0.0))
    for t in trace:
        sched.add_request(t.request_id, t.prompt_token_ids,
                          replace(params, max_tokens=t.output_len))
    acc = SharingResult(0, 0)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, fake_samples(out))
        usage = sched.block_manager.usage()
        acc.held_block_steps += usage.num_held_blocks
        acc.unshared_block_steps += usage.num_table_entries
    if sched.num_preemptions:
        raise RuntimeError("the pool was too small: a preemption changed the measure")
    return acc
