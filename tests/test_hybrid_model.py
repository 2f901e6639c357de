"""The tiny model with sliding-window layers (issue 33 item 4, the model side): paged generation
through V1's ``KVCacheManager`` with one KV-cache group per kind of layer equals dense
generation with the same masks, token for token.

The driver below is a V1 scheduler cut to what the model side needs (the real one,
``scheduler/v1.py``, fills ``ScheduledSeq.block_tables`` the same way once it builds its
manager with the model's groups): each step it asks ``allocate_slots`` for a prefill chunk or a
decode token, hands the runner every group's table (``get_block_tables``), samples greedily and
frees finished sequences. Every cache slot nobody should read holds NaN: the null block (the
windowed group's stand-in for blocks that left the window) and every free block the prefix
cache does not keep are refilled with NaN before each step, so a layer that reads past its
window or through the wrong group's table produces NaN or other tokens; the last tests show
it does (the checks can fail). Blocks held are counted against an all-full-attention run.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from course_lib.config import CacheConfig
from course_lib.device import BACKEND
from course_lib.engine.model_runner import ModelRunner
from course_lib.kernels import interpreter_incompatibility
from course_lib.memory.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from course_lib.memory.v1.kv_cache_manager import KVCacheManager
from course_lib.model.attention import make_attention_metadata
from course_lib.model.config import ModelConfig
from course_lib.model.generate import generate_contiguous
from course_lib.model.llama import TinyLlama, allocate_kv_caches
from course_lib.model.loader import load_tiny_model
from course_lib.model.tokenizer import ByteTokenizer
from course_lib.scheduler.output import ScheduledSeq
from course_lib.sequence import Request, SamplingParams, Sequence
from course_lib.sizing.models import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    repeat_layer_pattern,
)
from course_lib.sizing.units import cdiv

pytestmark = pytest.mark.ch14
torch.set_num_threads(1)

TOK = ByteTokenizer()
TRITON_RUNS = BACKEND.uses_triton and interpreter_incompatibility() is None
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without "
        "form, and void; and darkness was upon the face of the deep.")
SLIDING_FIRST = (SLIDING_ATTENTION, FULL_ATTENTION)      # gpt-oss's order: group 0 windowed
FULL_FIRST = (FULL_ATTENTION, SLIDING_ATTENTION)         # group 0 full attention


def hybrid(window: int, pattern: tuple[str, str] = SLIDING_FIRST,
           device: torch.device | str = "cpu") -> TinyLlama:
    """The shipped weights, every other layer a sliding-window layer of ``window`` tokens."""
    return load_tiny_model(device, layer_types=repeat_layer_pattern(pattern, 4),
                           sliding_window=window)


def prompt(n: int, offset: int = 0) -> list[int]:
    return TOK.encode(TEXT)[offset:offset + n]


def nan_unread_blocks(runner: ModelRunner, kvm: KVCacheManager) -> None:
    """NaN in the null block and in every free block the prefix cache does not keep (a freed
    block that left a window included): no kernel may read them."""
    pool = kvm.block_pool
    ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()
           if b.block_hash is None]
    if pool.null_block is not None:
        ids.append(pool.null_block.block_id)
    if ids:
        rows = torch.tensor(ids, device=runner.device)
        for k, v in runner.gpu_caches:
            k[rows] = float("nan")
            v[rows] = float("nan")


def paged_generate(model: TinyLlama, prompts: list[list[int]], max_new: int, *,
                   block_size: int = 4, chunk: int = 16, num_blocks: int = 160,
                   attn: str = "torch", caching: bool = False, held: list | None = None
                   ) -> tuple[list[list[int]], bool]:
    """Greedy generation of ``prompts`` side by side through ``KVCacheManager`` (built with
    the model's KV-cache groups) and the model runner: prefill in chunks of ``chunk`` tokens,
    then one decode token a step. Returns each prompt's tokens and whether every logit was
    finite; ``held`` collects ``(tokens of each sequence, blocks in use)`` after each step's
    allocation, ``kvm.check_invariants()`` runs every step."""
    groups = model.config.kv_cache_groups(block_size)
    kvm = KVCacheManager(block_size, num_blocks, enable_caching=caching, kv_cache_groups=groups)
    runner = ModelRunner(model, CacheConfig(block_size, num_blocks, watermark=0.0), attn)
    for k, v in runner.gpu_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    seqs = [Sequence(i, tuple(p)) for i, p in enumerate(prompts)]
    reqs = [Request(i, tuple(p), SamplingParams(max_tokens=max_new), seqs=[s])
            for i, (p, s) in enumerate(zip(prompts, seqs, strict=True))]
    running, finite = list(range(len(seqs))), True
    while running:
        scheduled = []
        for i in running:
            seq = seqs[i]
            ctx = seq.num_computed_tokens
            hits, num_hit = ((), 0) if ctx else \
                kvm.get_computed_blocks(seq.seq_id, seq.token_ids)   # admitted: its hit first
            num_new = min(len(seq) - ctx - num_hit, chunk)
            ids = kvm.allocate_slots(seq.seq_id, seq.token_ids, ctx, num_new, hits)
            assert ids is not None, "the test's pool is too small"
            seq.num_computed_tokens = ctx + num_hit
            tables = kvm.get_block_tables(seq.seq_id)
            assert tables[0] == ids
            done = seq.num_computed_tokens + num_new == len(seq)
            scheduled.append(ScheduledSeq(reqs[i], seq, num_new, not seq.output_token_ids,
                                          1 if done else 0, ids,
                                          tables if len(groups) > 1 else ()))
        kvm.check_invariants()
        if held is not None:
            held.append(([e.seq.num_computed_tokens + e.num_tokens for e in scheduled],
                         kvm.num_gpu_blocks - int(kvm.block_pool.null_block is not None)
                         - kvm.num_free_gpu_blocks))
        nan_unread_blocks(runner, kvm)
        logits = runner.execute_model(scheduled)
        for e in scheduled:
            e.seq.num_computed_tokens += e.num_tokens
            if e.seq.seq_id in logits:
                row = logits[e.seq.seq_id]
                finite &= bool(torch.isfinite(row).all())
                e.seq.append_output_token_ids(int(torch.argmax(row)))
                if len(e.seq.output_token_ids) == max_new:
                    kvm.free(e.seq.seq_id)
                    running.remove(e.seq.seq_id)
    return [list(s.output_token_ids) for s in seqs], finite


def dense(model: TinyLlama, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    return [generate_contiguous(model, p, max_new, stop_at_eos=False) for p in prompts]


# ------------------------------------------------------------------ the configuration


def test_config_names_each_layers_attention_and_refuses_bad_values() -> None:
    cfg = ModelConfig(layer_types=list(repeat_layer_pattern(SLIDING_FIRST, 4)),
                      sliding_window=8)
    assert cfg.layer_types == repeat_layer_pattern(SLIDING_FIRST, 4)     # a list kept as tuple
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [8, None, 8, None]
    assert ModelConfig().per_layer_types == (FULL_ATTENTION,) * 4
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    bad = [(dict(layer_types=(FULL_ATTENTION,) * 3), "one per layer, num_layers=4"),
           (dict(layer_types=("sliding",) * 4, sliding_window=8), r"layer_types\[0\]='sliding'"),
           (dict(layer_types=(CHUNKED_ATTENTION,) * 4), "the tiny model runs full_attention"),
           (dict(layer_types=SLIDING_FIRST * 2), "sliding_window must be an integer >= 1"),
           (dict(layer_types=SLIDING_FIRST * 2, sliding_window=-2), "integer >= 0"),
           (dict(layer_types=SLIDING_FIRST * 2, sliding_window=True), "integer >= 0"),
           (dict(layer_types=SLIDING_FIRST * 2, sliding_window=8.0), "integer >= 0"),
           (dict(sliding_window=8), "no layer is 'sliding_attention'"),
           (dict(layer_types="full_attention"), "must be a sequence")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**kwargs)
    with pytest.raises(ValueError, match="power of two"):
        cfg.kv_cache_groups(3)
    with pytest.raises(ValueError, match="dtype_bytes"):
        cfg.kv_cache_groups(4, dtype_bytes=0)
    with pytest.raises(ValueError, match="sliding_window must be an integer >= 1"):
        load_tiny_model(layer_types=SLIDING_FIRST * 2)


def test_kv_cache_groups_one_for_full_attention_one_per_kind_for_a_hybrid() -> None:
    (only,) = ModelConfig().kv_cache_groups(16)
    assert only.layer_names == ModelConfig().layer_names
    assert only.kv_cache_spec == FullAttentionSpec(16, num_kv_heads=2, head_size=32,
                                                   dtype_bytes=4)
    assert ModelConfig().kv_cache_group_ids == (0, 0, 0, 0)
    cfg = ModelConfig(layer_types=repeat_layer_pattern(SLIDING_FIRST, 4), sliding_window=8)
    windowed, full = cfg.kv_cache_groups(4)
    assert windowed.layer_names == ("model.layers.0.self_attn", "model.layers.2.self_attn")
    assert windowed.kv_cache_spec == SlidingWindowSpec(4, num_kv_heads=2, head_size=32,
                                                       dtype_bytes=4, sliding_window=8)
    assert full.layer_names == ("model.layers.1.self_attn", "model.layers.3.self_attn")
    assert cfg.kv_cache_group_ids == (0, 1, 0, 1)
    # vLLM's group size: 3 full and 1 windowed layer are four groups of one layer
    three_one = ModelConfig(layer_types=(FULL_ATTENTION,) * 3 + (SLIDING_ATTENTION,),
                            sliding_window=8)
    assert [len(g.layer_names) for g in three_one.kv_cache_groups(4)] == [1, 1, 1, 1]
    assert three_one.kv_cache_group_ids == (0, 1, 2, 3)


def test_the_i_th_layers_of_the_groups_share_one_pair_of_tensors() -> None:
    cfg = ModelConfig(layer_types=repeat_layer_pattern(SLIDING_FIRST, 4), sliding_window=8)
    caches = allocate_kv_caches(cfg, 6, 4, kv_cache_groups=cfg.kv_cache_groups(4))
    assert caches[0] is caches[1] and caches[2] is caches[3] and caches[0] is not caches[2]
    alone = allocate_kv_caches(cfg, 6, 4)                    # no groups: one pair per layer
    assert len({id(k) for k, _ in alone}) == 4
    full = ModelConfig()
    assert len({id(k) for k, _ in allocate_kv_caches(
        full, 6, 4, kv_cache_groups=full.kv_cache_groups(4))}) == 4
    model = hybrid(8)
    runner = ModelRunner(model, CacheConfig(4, 6), "torch")
    all_full = ModelRunner(load_tiny_model(), CacheConfig(4, 6), "torch")
    assert 2 * runner.kv_bytes_per_block == all_full.kv_bytes_per_block == 2 * 4 * 4 * 2 * 32 * 4


# ------------------------------------------------------- paged == dense, token for token


@pytest.mark.parametrize("pattern", [SLIDING_FIRST, FULL_FIRST], ids=["sliding0", "full0"])
@pytest.mark.parametrize("window", [12, 40, 64], ids=["W<prompt", "W=prompt", "W>prompt"])
def test_paged_generation_equals_dense_with_the_same_masks(pattern, window) -> None:
    """Three prompts side by side (40, 27 and 33 tokens), prefill in chunks of 16, then 30
    decode steps; a window smaller than, equal to and larger than the longest prompt."""
    model = hybrid(window, pattern)
    prompts = [prompt(40), prompt(27, 3), prompt(33, 10)]
    got, finite = paged_generate(model, prompts, 30)
    assert finite
    assert got == dense(model, prompts, 30)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_any_chunking_and_the_reference_kernels_agree_too(chunk) -> None:
    model = hybrid(9)
    prompts = [prompt(37), prompt(21, 5)]
    got, finite = paged_generate(model, prompts, 12, chunk=chunk, block_size=2,
                                 attn="reference")
    assert finite and got == dense(model, prompts, 12)


def test_a_prefix_cache_hit_with_a_window_equals_dense() -> None:
    """Prefix caching on: the second request reuses the first's blocks (its windowed group
    only the blocks its window reads, null before), then generates as dense does."""
    model = hybrid(10, FULL_FIRST)
    first, second = prompt(44), prompt(44)[:40] + prompt(6, 60)
    want = dense(model, [first, second], 10)
    got_first, finite = paged_generate(model, [first], 10, caching=True)
    assert finite and got_first == want[:1]
    # one manager for both: the second arrives after the first finished
    groups = model.config.kv_cache_groups(4)
    kvm = KVCacheManager(4, 160, enable_caching=True, kv_cache_groups=groups)
    kvm.get_computed_blocks(0, first)
    assert kvm.allocate_slots(0, first, 0, len(first)) is not None
    kvm.free(0)
    hits, num_hit = kvm.get_computed_blocks(1, second)
    assert num_hit == 40
    windowed, full = hits[1], hits[0]
    assert len(full) == len(windowed) == 10 and not any(b.is_null for b in full)
    # window 10: the next token reads 9 earlier ones, cdiv(9, 4) = 3 blocks
    assert [b.is_null for b in windowed] == [True] * 7 + [False] * 3
    got, finite = paged_generate(model, [first, second], 10, caching=True)
    assert finite and got == want


@pytest.mark.skipif(not TRITON_RUNS, reason=interpreter_incompatibility() or "needs Triton")
def test_the_triton_kernels_skip_the_null_block() -> None:
    """The Triton kernels (Triton's interpreter on a CPU: few tokens; compiled on a GPU),
    window 6 over blocks of 4: the decode steps' tables start with null blocks."""
    model = hybrid(6, device=BACKEND.device)
    prompts = [prompt(13), prompt(9, 3)]
    got, finite = paged_generate(model, prompts, 4, chunk=8, attn="triton")
    assert finite and got == dense(model, prompts, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", [SLIDING_FIRST, FULL_FIRST], ids=["sliding0", "full0"])
def test_paged_equals_dense_on_cuda(pattern) -> None:
    """The compiled Triton kernels on a GPU ("auto"), the prompts and windows of the CPU test."""
    for window in (12, 40, 64):
        model = hybrid(window, pattern, device="cuda")
        prompts = [prompt(40), prompt(27, 3), prompt(33, 10)]
        got, finite = paged_generate(model, prompts, 30, attn="auto")
        assert finite and got == dense(model, prompts, 30), window


@settings(max_examples=examples(25), deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 48), st.integers(1, 40),
       st.integers(1, 24), st.sampled_from([SLIDING_FIRST, FULL_FIRST]))
def test_paged_equals_dense_for_any_block_size_window_chunk(block_size, window, prompt_len,
                                                            chunk, pattern) -> None:
    model = hybrid(window, pattern)
    prompts = [prompt(prompt_len)]
    got, finite = paged_generate(model, prompts, 8, block_size=block_size, chunk=chunk,
                                 num_blocks=64 // block_size * 2 + 2)
    assert finite and got == dense(model, prompts, 8)


# ------------------------------------------------------------------------- blocks held


def test_blocks_held_against_an_all_full_attention_run() -> None:
    """One sequence, 80 tokens prompt + 48 generated, blocks of 4, window 8: the full group
    holds every block, the windowed one the blocks its window can read (vLLM's
    ``remove_skipped_blocks`` at each step's start); the all-full run one group of every
    block. A hybrid block is two layers' pages, an all-full one four."""
    window, bs = 8, 4
    model, full_model = hybrid(window), load_tiny_model()
    prompts = [prompt(80)]
    held: list = []
    got, finite = paged_generate(model, prompts, 48, chunk=32, held=held)
    assert finite and got == dense(model, prompts, 48)
    full_held: list = []
    paged_generate(full_model, prompts, 48, chunk=32, held=full_held)
    ctx = 0
    for ([total], hybrid_blocks), ([same], full_blocks) in zip(held, full_held, strict=True):
        assert total == same
        skipped = max(0, ctx - window + 1) // bs      # left the window before this step
        assert full_blocks == cdiv(total, bs)
        assert hybrid_blocks == 2 * cdiv(total, bs) - skipped
        ctx = total
    block_bytes = ModelRunner(model, CacheConfig(bs, 4), "torch").kv_bytes_per_block
    full_bytes = ModelRunner(full_model, CacheConfig(bs, 4), "torch").kv_bytes_per_block
    last_hybrid, last_full = held[-1][1], full_held[-1][1]
    assert last_hybrid * block_bytes < 0.6 * last_full * full_bytes   # 34 x 2 vs 32 x 4 pages


# ---------------------------------------------------------- the checks can fail


def test_a_layer_that_ignores_its_window_is_caught() -> None:
    """A windowed layer whose paged path forgets the window reads the NaN null block."""
    model = hybrid(12)
    prompts = [prompt(40)]
    model.model.layers[2].self_attn.sliding_window = None
    got, finite = paged_generate(model, prompts, 10)
    model.model.layers[2].self_attn.sliding_window = 12
    assert not (finite and got == dense(model, prompts, 10))


def test_a_layer_that_reads_another_groups_table_is_caught() -> None:
    model = hybrid(12)
    prompts = [prompt(40), prompt(30, 5)]
    model.model.layers[1].self_attn.kv_cache_group_id = 0   # a full layer on the window's
    got, finite = paged_generate(model, prompts, 10)
    model.model.layers[1].self_attn.kv_cache_group_id = 1
    assert not (finite and got == dense(model, prompts, 10))


def test_the_windows_change_the_tokens() -> None:
    """Not vacuous: with a window shorter than the prompt the hybrid model predicts other
    tokens than the all-full one, so a dense path without the window would not match."""
    prompts = [prompt(40)]
    assert dense(hybrid(12), prompts, 30) != dense(load_tiny_model(), prompts, 30)
    # a window as long as the whole run changes nothing
    assert dense(hybrid(200), prompts, 30) == dense(load_tiny_model(), prompts, 30)


# ------------------------------------------------------------------------ the doors


def test_metadata_and_entries_must_carry_one_table_per_group() -> None:
    model = hybrid(8)
    cfg = model.config
    caches = allocate_kv_caches(cfg, 8, 4, kv_cache_groups=cfg.kv_cache_groups(4))
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    with pytest.raises(ValueError, match="2 KV-cache groups"):
        model(ids, pos, caches, make_attention_metadata([[1]], [0], [3], 4), impl="torch")
    meta = make_attention_metadata([[1]], [0], [3], 4, more_group_tables=[[[2]]])
    assert meta.num_kv_cache_groups == 2
    assert meta.group_slot_mappings[1].tolist() == [8, 9, 10]
    assert torch.isfinite(model(ids, pos, caches, meta, impl="torch")).all()
    with pytest.raises(ValueError, match="KV-cache group 1: one block table per sequence"):
        make_attention_metadata([[1]], [0], [3], 4, more_group_tables=[[]])
    with pytest.raises(ValueError, match="must be in 0..7"):
        make_attention_metadata([[1]], [0], [3], 4, num_blocks=8, more_group_tables=[[[9]]])
    runner = ModelRunner(model, CacheConfig(4, 8), "torch")
    seq = Sequence(0, (1, 2, 3))
    entry = ScheduledSeq(Request(0, (1, 2, 3), SamplingParams(), seqs=[seq]), seq, 3, True, 1,
                         [1])
    with pytest.raises(ValueError, match="2 KV-cache groups"):
        runner.prepare_inputs([entry])
    with pytest.raises(ValueError, match=r"0 blocks of 4 cannot hold tokens 0..2 "
                                         r"\(KV-cache group 1\)"):
        runner.prepare_inputs([replace(entry, block_tables=([1], []))])
    _, _, meta = runner.prepare_inputs([replace(entry, block_tables=([1], [2]))])
    assert [t.tolist() for t in meta.group_block_tables] == [[[1]], [[2]]]
