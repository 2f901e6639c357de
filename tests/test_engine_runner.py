"""The engine's parts: batched CPU attention == the reference, the sampler, the model runner's
cache ops, traces scaled to the model, and the static baseline."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from course_lib.config import CacheConfig
from course_lib.engine import model_runner
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.model_runner import ModelRunner
from course_lib.engine.sampler import sample_one, sample_seed, top_p_probs
from course_lib.engine.workloads import model_trace, run_static
from course_lib.kernels.batched import paged_attention_batched
from course_lib.kernels.reference import paged_attention_ref
from course_lib.memory.v0.manager import BlockManager
from course_lib.model.loader import load_tiny_model
from course_lib.scheduler.output import SchedulerOutput
from course_lib.sequence import SamplingParams
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6),
       st.sampled_from([1, 4, 16]), st.sampled_from([(4, 4), (8, 2), (4, 1)]), st.integers(0, 99))
def test_batched_attention_equals_the_reference(seqs, block_size, heads, seed) -> None:
    """Any mix of decodes and (chunked) prefills, GQA, permuted block tables, NaN garbage in
    unused slots: the batched path gives the reference's output."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    per_seq = [cdiv(c + q, block_size) for c, q in seqs]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(perm[at:at + n])
        at += n
    width = max(per_seq)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    kc = torch.full((num_blocks, block_size, num_kv_heads, 8), float("nan"))
    vc = kc.clone()
    for t, (c, q) in zip(tables, seqs, strict=True):
        for p in range(c + q):
            kc[t[p // block_size], p % block_size] = torch.randn(num_kv_heads, 8, generator=gen)
            vc[t[p // block_size], p % block_size] = torch.randn(num_kv_heads, 8, generator=gen)
    q_lens = [q for _, q in seqs]
    query = torch.randn(sum(q_lens), num_heads, 8, generator=gen)
    loc = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    lens = torch.tensor([c + q for c, q in seqs], dtype=torch.int32)
    got = paged_attention_batched(query, kc, vc, bt, lens, loc, 0.35)
    ref = paged_attention_ref(query, kc, vc, bt, lens, loc, 0.35)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = top_p_probs(logits, 1.0, 0.7)
    assert (probs > 0).tolist() == [True, True, False, False]
    assert (top_p_probs(logits, 1.0, 0.01) > 0).tolist() == [True, False, False, False]
    assert (top_p_probs(logits, 1.0, 1.0) > 0).all()


def test_sampler_is_greedy_at_zero_and_seeded_otherwise() -> None:
    logits = torch.randn(259, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    tok, lp = sample_one(logits, greedy, 1, 0, 5)
    assert tok == int(logits.argmax()) and lp == pytest.approx(
        float(torch.log_softmax(logits, -1)[tok]))
    hot = SamplingParams(temperature=1.5)
    draws = [sample_one(logits, hot, 7, i, 5)[0] for i in range(8)]
    assert draws == [sample_one(logits, hot, 7, i, 5)[0] for i in range(8)]   # reproducible
    assert len(set(draws)) > 1                                                 # indices differ
    assert len({sample_seed(0, i, p) for i in range(4) for p in range(50)}) == 200


def test_runner_executes_swaps_and_copies_in_order() -> None:
    model = load_tiny_model()
    runner = ModelRunner(model, CacheConfig(block_size=4, num_gpu_blocks=6, num_cpu_blocks=4),
                         attn_impl="reference")
    for i, (k, v) in enumerate(runner.gpu_caches):
        for b in range(6):
            k[b] = b + 10 * i
            v[b] = -(b + 10 * i)
    # swap block 2 out to cpu 1, block 5 in from cpu 1 (what block 2 held), copy 0 -> 2
    out = SchedulerOutput(0, blocks_to_swap_out=[(2, 1)], blocks_to_swap_in=[(1, 5)],
                          blocks_to_copy=[(0, 2)])
    runner.execute_cache_ops(out)
    for i, (k, v) in enumerate(runner.gpu_caches):
        assert float(k[5].mean()) == 2 + 10 * i and float(v[5].mean()) == -(2 + 10 * i)
        assert float(k[2].mean()) == 10 * i                # the copy ran after the swap-out
        assert float(runner.cpu_caches[i][0][1].mean()) == 2 + 10 * i
    assert runner.num_swapped_blocks == 2 and runner.num_copied_blocks == 1
    no_swap = ModelRunner(model, CacheConfig(4, 6, 0), "reference")
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        no_swap.execute_cache_ops(out)
    assert runner.kv_bytes_per_block == 2 * 4 * 4 * 2 * 32 * 4
    BlockManager(4, 6)   # the runner holds no bookkeeping of its own


def test_runner_builds_its_inputs_from_the_scheduler_output_alone() -> None:
    """Block ids travel in ScheduledSeq: the runner's metadata are the scheduler's tables, and
    an entry whose block ids cannot hold its tokens is refused with the reason."""
    from dataclasses import replace

    from course_lib.config import SchedulerConfig
    from course_lib.scheduler.scheduler import Scheduler

    model = load_tiny_model()
    sched = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(4, 16, watermark=0.0))
    sched.add_request(0, list(range(1, 11)), SamplingParams(max_tokens=3))
    sched.add_request(1, list(range(20, 26)), SamplingParams(max_tokens=3))
    out = sched.schedule()
    runner = ModelRunner(model, CacheConfig(block_size=4, num_gpu_blocks=16),
                         attn_impl="reference")
    ids, pos, meta = runner.prepare_inputs(out.scheduled)
    bm = sched.block_manager
    for row, e in zip(meta.block_tables.tolist(), out.scheduled, strict=True):
        assert e.block_ids == bm.get_block_table(e.seq.seq_id)
        assert row[:len(e.block_ids)] == e.block_ids
    assert ids.tolist() == list(range(1, 11)) + list(range(20, 26))
    assert pos.tolist() == list(range(10)) + list(range(6))
    short = replace(out.scheduled[0], block_ids=out.scheduled[0].block_ids[:2])
    with pytest.raises(ValueError, match="2 blocks of 4 cannot hold tokens 0..9"):
        runner.prepare_inputs([short])


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_engine_refuses_kv_tensors_whose_blocks_differ_from_the_block_managers(
        monkeypatch, design) -> None:
    """The runner sizes its tensors from the CacheConfig, and the engine checks, when it is
    built, that dimension 1 of each KV cache tensor is the block manager's block_size."""
    model = load_tiny_model()
    cache = CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=2)
    engine = LLMEngine(model, cache_config=cache, attn_impl="reference", design=design)
    assert {c.shape[1] for layer in engine.runner.gpu_caches for c in layer} == {4}
    assert engine.runner.block_size == engine.block_manager.block_size == 4
    # the runner's swap space is the block manager's CPU pool: V1's manager has none
    assert len(engine.runner.cpu_caches) == (model.config.num_layers if design == "v0" else 0)
    allocate = model_runner.allocate_kv_caches
    monkeypatch.setattr(model_runner, "allocate_kv_caches",
                        lambda cfg, n, block_size, *a: allocate(cfg, n, 2 * block_size, *a))
    with pytest.raises(ValueError, match=r"block_size=4, but .* hold 8 tokens per block"):
        LLMEngine(model, cache_config=cache, attn_impl="reference", design=design)


def test_model_trace_fits_the_context_and_uses_bytes() -> None:
    for kind in ("sharegpt", "alpaca"):
        trace = model_trace(kind, 300, seed=1)
        assert len(trace) == 300
        assert all(1 <= r.prompt_len and 1 <= r.output_len and r.prompt_len + r.output_len
                   <= 256 for r in trace)
        assert all(1 <= t <= 255 for r in trace for t in r.prompt_token_ids)
    assert model_trace("sharegpt", 50, seed=1) == model_trace("sharegpt", 50, seed=1)
    with pytest.raises(ValueError, match="trace must be one of"):
        model_trace("lmsys", 3)


def test_static_baseline_generates_exactly_the_requested_tokens() -> None:
    model = load_tiny_model()
    trace = model_trace("sharegpt", 6, seed=2)
    padded = run_static(model, trace, num_slots=2 * 256)
    kind = run_static(model, trace, num_slots=2 * 256, pad_finished=False)
    want = sum(r.output_len for r in trace)
    assert padded.generated_tokens == kind.generated_tokens == want
    # batches of 2: each batch runs as many steps as its longest request
    steps = sum(max(r.output_len for r in trace[i:i + 2]) for i in range(0, 6, 2))
    assert padded.num_steps == kind.num_steps == steps
    with pytest.raises(ValueError, match="cannot hold"):
        run_static(model, trace, num_slots=100)
