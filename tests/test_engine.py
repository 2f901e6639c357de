"""LLMEngine: paged generation equals the contiguous reference; sharing, preemption, metrics."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from interpreter_only import INTERPRETER_ONLY

from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.llm_engine import LLMEngine
from course_lib.model.generate import generate_contiguous
from course_lib.model.loader import load_tiny_model
from course_lib.model.tokenizer import EOS_ID, ByteTokenizer
from course_lib.scheduler.metrics import serve_metrics
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)

TOK = ByteTokenizer()
PROMPTS = ["And God said", "In the beginning God created", "Jesus wept.",
           "The LORD is my shepherd; I shall not want.", "Blessed are the"]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    return [generate_contiguous(model, TOK.encode(p), GREEDY.max_tokens) for p in PROMPTS]


def make_engine(model, *, block_size: int = 16, num_gpu_blocks: int = 128,
                num_cpu_blocks: int = 0, prefix: bool = False, mode: str = "recompute",
                max_num_seqs: int = 64, prefix_cache: str = "hash", **kwargs) -> LLMEngine:
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                         max_model_len=model.config.max_position, preemption_mode=mode)
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                     num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=prefix,
                     prefix_cache=prefix_cache)
    return LLMEngine(model, sc, cc, **kwargs)


def assert_all_blocks_back(engine: LLMEngine) -> None:
    engine.check_invariants()
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.seq_ids() == []
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- greedy == contiguous
@pytest.mark.parametrize("block_size", [4, 16])
def test_batched_greedy_equals_contiguous_generation(model, reference, block_size) -> None:
    engine = make_engine(model, block_size=block_size)
    outs = engine.generate(PROMPTS, GREEDY)
    assert tokens(outs) == reference
    # the prompts really were batched together, and EOS stops a sequence (kept, like the ref)
    assert engine.num_steps < sum(len(r) for r in reference)
    for o, ref in zip(outs, reference, strict=True):
        assert o.outputs[0].finish_reason == ("stop" if ref[-1] == EOS_ID else "length")
        assert o.text == TOK.decode(ref)
    assert_all_blocks_back(engine)


def test_prefix_caching_gives_the_same_tokens_and_hits_on_shared_prompts(model,
                                                                        reference) -> None:
    off = make_engine(model, block_size=4)
    on = make_engine(model, block_size=4, prefix=True)
    assert tokens(on.generate(PROMPTS, GREEDY)) == tokens(off.generate(PROMPTS, GREEDY))
    assert on.block_manager.prefix_cache_stats.hits == 0       # nothing shared yet
    # the same prompt again: its full blocks are hits, the tokens are unchanged
    again = on.generate(PROMPTS[3], GREEDY)[0]
    assert again.num_cached_tokens >= 4 * (len(TOK.encode(PROMPTS[3])) // 4 - 1) > 0
    assert again.outputs[0].token_ids == reference[3]
    # multi-turn: turn 2's prompt starts with turn 1's prompt and reply
    turn1 = TOK.encode(PROMPTS[1]) + reference[1]
    turn2 = turn1 + list(b" And he said")
    got = on.generate([turn2], GREEDY)[0]
    assert got.num_cached_tokens >= 4 * (len(turn1) // 4 - 1)
    assert got.outputs[0].token_ids == generate_contiguous(model, turn2, GREEDY.max_tokens)
    assert on.metrics.value("vllm:gpu_prefix_cache_hit_rate") > 0       # V0's gauge
    assert_all_blocks_back(on)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_a_tiny_pool_keeps_the_tokens(model, reference, mode) -> None:
    """30 blocks of 4 tokens cannot hold 5 sequences of up to ~85 tokens: requests are
    preempted (recomputed or swapped to the CPU pool) and still produce the same tokens."""
    engine = make_engine(model, block_size=4, num_gpu_blocks=30, num_cpu_blocks=64, mode=mode)
    outs = engine.generate(PROMPTS, GREEDY)
    assert tokens(outs) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.metrics.value("vllm:num_preemptions_total") == engine.scheduler.num_preemptions
    assert sum(o.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    if mode == "swap":
        assert engine.runner.num_swapped_blocks > 0
    else:
        assert engine.runner.num_swapped_blocks == 0
    assert_all_blocks_back(engine)


def test_seeded_sampling_is_unchanged_by_preemption_and_batching(model) -> None:
    params = SamplingParams(max_tokens=50, temperature=0.8, top_p=0.9, seed=3)
    alone = [make_engine(model, stop_token_ids=()).generate(p, params)[0].outputs[0].token_ids
             for p in PROMPTS]
    tight = make_engine(model, block_size=4, num_gpu_blocks=30, num_cpu_blocks=64, mode="swap",
                        stop_token_ids=())
    assert tokens(tight.generate(PROMPTS, params)) == alone
    assert tight.scheduler.num_preemptions > 0


# ---------------------------------------------------------------- sharing
def test_parallel_sampling_shares_the_prompt_and_gives_n_reproducible_samples(model) -> None:
    prompt = "In the beginning God created the heaven and the earth. And the earth"  # 70 tok
    params = SamplingParams(max_tokens=24, temperature=0.9, n=4, seed=11)
    engine = make_engine(model, block_size=16)
    shared = []

    def watch(e: LLMEngine, out) -> None:
        if e.block_manager.seq_ids():
            shared.append((e.block_manager.usage().num_held_blocks,
                           e.block_manager.usage().num_table_entries))

    out = engine.generate(prompt, params, on_step=watch)[0]
    samples = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) == 4   # all different
    # the 4 samples hold the prompt's 4 full blocks once, not 4 times
    held, unshared = shared[0]
    assert unshared - held >= 3 * (len(TOK.encode(prompt)) // 16)
    assert all(h < u for h, u in shared)
    assert engine.runner.num_copied_blocks > 0       # the shared partial block was copied
    again = make_engine(model).generate(prompt, params)[0]
    assert [c.token_ids for c in again.outputs] == samples
    other = make_engine(model).generate(prompt, SamplingParams(max_tokens=24, temperature=0.9,
                                                               n=4, seed=12))[0]
    assert [c.token_ids for c in other.outputs] != samples
    assert_all_blocks_back(engine)


def test_beam_search_returns_width_beams_by_score_sharing_blocks(model) -> None:
    engine = make_engine(model, block_size=4)
    seen = []
    out = engine.generate("And God said", SamplingParams(max_tokens=20, beam_width=4),
                          on_step=lambda e, o: seen.append((e.block_manager.usage().num_held_blocks,
                                                            e.block_manager.usage()
                                                            .num_table_entries)))[0]
    assert len(out.outputs) == 4
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert all(len(c.token_ids) == 20 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    # the best beam scores at least as well as greedy decoding (its logprob is a candidate)
    greedy = make_engine(model).generate("And God said", SamplingParams(
        max_tokens=20, temperature=0.0, ))[0].outputs[0]
    if len(greedy.token_ids) == 20:
        assert scores[0] >= greedy.cumulative_logprob - 1e-4
    live = [(h, u) for h, u in seen if u]
    assert live and all(h < u for h, u in live)     # beams share their common prefix blocks
    assert_all_blocks_back(engine)


# ---------------------------------------------------------------- abort, metrics, errors
def test_abort_frees_the_blocks_at_once(model) -> None:
    engine = make_engine(model, block_size=4)
    a = engine.add_request("And God said", GREEDY)
    b = engine.add_request("Jesus wept. And", SamplingParams(max_tokens=30, n=3, seed=0))
    engine.step()
    engine.step()
    assert engine.block_manager.usage().num_held_blocks > 0
    held = engine.block_manager.usage().num_held_blocks
    assert engine.abort_request(b) and not engine.abort_request(b)
    assert 0 < engine.block_manager.usage().num_held_blocks < held   # b gave its blocks back
    engine.step()                                       # a keeps running alone
    assert [r.request_id for r in engine.scheduler.running] == [a]
    assert engine.abort_request(a)
    engine.check_invariants()
    assert engine.block_manager.usage().num_held_blocks == 0
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(a, "abort")]
    assert not engine.has_unfinished_requests()
    assert_all_blocks_back(engine)


def test_metrics_are_scraped_over_http(model) -> None:
    engine = make_engine(model)
    engine.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0.0))
    server, port = serve_metrics(engine.metrics)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        server.shutdown()
    text = text.decode()
    prompt_tokens = sum(len(TOK.encode(p)) for p in PROMPTS[:3])
    assert f'vllm:prompt_tokens_total{{model_name="tiny-llama"}} {float(prompt_tokens)}' in text
    gen = engine.metrics.value("vllm:generation_tokens_total")
    assert gen == engine.num_generated_tokens > 0
    assert 'vllm:time_to_first_token_seconds_count{model_name="tiny-llama"} 3.0' in text
    assert 'vllm:num_requests_running{model_name="tiny-llama"} 0.0' in text


def test_bad_input_is_rejected_without_changing_state(model) -> None:
    engine = make_engine(model)
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(model, SchedulerConfig(max_model_len=1024, max_num_batched_tokens=1024))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 2, 999])
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([])
    with pytest.raises(ValueError, match="attn_impl"):
        make_engine(model, attn_impl="fast")
    rid = engine.add_request("x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", request_id=rid)
    with pytest.raises(ValueError, match="one SamplingParams per prompt"):
        engine.generate(["a", "b"], [GREEDY])
    assert len(engine.scheduler.waiting) == 1


def test_prompt_longer_than_the_context_is_refused_at_the_door_in_v1(model) -> None:
    """vLLM 0.33.0's input processor refuses a prompt of max_model_len tokens or more before
    it is queued, with these messages; generate() then queues none of its prompts."""
    engine = make_engine(model, design="v1")
    limit = engine.scheduler.config.max_model_len
    with pytest.raises(ValueError, match=rf"\(length {limit + 1}\) is longer than the maximum "
                                         rf"model length of {limit}\."):
        engine.add_request([65] * (limit + 1))
    with pytest.raises(ValueError, match=r"plus the number of requested output tokens "
                                         r"\(at least 1\)"):
        engine.generate([TOK.encode("And"), [65] * limit], SamplingParams(max_tokens=3))
    assert not engine.has_unfinished_requests()
    out = engine.generate([[65] * (limit - 1)], SamplingParams(max_tokens=3, temperature=0.0))
    assert out[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 1
    assert_all_blocks_back(engine)


def test_prompt_longer_than_the_context_is_ignored_not_run_in_v0(model) -> None:
    engine = make_engine(model)
    out = engine.generate([[65] * 300, TOK.encode("And")], SamplingParams(max_tokens=3,
                                                                          temperature=0.0))
    assert out[0].outputs[0].finish_reason == "ignored" and out[0].outputs[0].token_ids == []
    assert out[0].finish_reason == "ignored" and "max_model_len" in out[0].finish_detail
    assert len(out[1].outputs[0].token_ids) == 3
    assert_all_blocks_back(engine)


@INTERPRETER_ONLY    # a CPU model; compiled: test_engine_on_cuda_gives_the_contiguous_tokens_...
def test_triton_kernels_path_gives_the_reference_tokens(model, reference) -> None:
    """The interpreted Triton kernels (reshape_and_cache, prefill, decode, copy_blocks) run
    the same engine step; a few tokens only (the interpreter is slow)."""
    engine = make_engine(model, block_size=4, attn_impl="triton")
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))
    assert out[0].outputs[0].token_ids == reference[0][:3]
    assert_all_blocks_back(engine)


@pytest.mark.gpu
def test_engine_on_cuda_gives_the_contiguous_tokens_with_swap_and_forks() -> None:
    """Compiled Triton kernels: reshape_and_cache, prefill, decode, copy_blocks, and swaps
    between the GPU cache and the CPU swap space."""
    cuda_model = load_tiny_model(device="cuda")
    ref = [generate_contiguous(cuda_model, TOK.encode(p), GREEDY.max_tokens) for p in PROMPTS]
    engine = make_engine(cuda_model, block_size=4, num_gpu_blocks=30, num_cpu_blocks=64,
                         mode="swap")
    assert engine.runner.attn.name == "triton"
    assert tokens(engine.generate(PROMPTS, GREEDY)) == ref
    assert engine.runner.num_swapped_blocks > 0
    fork = engine.generate("And God said unto Moses, I", SamplingParams(max_tokens=8, n=3,
                                                                         temperature=0.0))
    assert len({tuple(c.token_ids) for c in fork[0].outputs}) == 1
    assert engine.runner.num_copied_blocks > 0
    assert_all_blocks_back(engine)


# ------------------------------------------------------------------- the V1 design
@pytest.mark.parametrize("blocks, prefix, index", [(128, False, "hash"), (128, True, "hash"),
                                                   (14, True, "hash"), (128, True, "radix"),
                                                   (14, True, "radix")])
def test_v1_design_gives_the_contiguous_tokens_and_v0s_samples(model, reference, blocks,
                                                               prefix, index) -> None:
    """vLLM V1's KVCacheManager and scheduler under the same model, runner and sampler:
    greedy equals the contiguous cache (with preemption by recompute at 14 blocks), and seeded
    parallel samples (V1: child sequences) are V0's samples token for token; the same with
    SGLang's radix tree as the prefix cache."""
    v1 = make_engine(model, block_size=4, num_gpu_blocks=blocks, prefix=prefix, design="v1",
                     prefix_cache=index)
    outs = v1.generate(PROMPTS, GREEDY)
    done = [o for o in outs if o.finish_detail is None]
    assert len(done) >= 4
    assert all(o.outputs[0].token_ids == reference[PROMPTS.index(TOK.decode(
        o.prompt_token_ids[1:]))] for o in done)
    sampled = SamplingParams(max_tokens=12, n=3, temperature=0.9, seed=4)
    v0 = make_engine(model, block_size=4, design="v0").generate("And God said unto", sampled)
    again = v1.generate("And God said unto", sampled)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in v0[0].outputs]
    assert_all_blocks_back(v1)
    if blocks == 14:
        assert v1.scheduler.num_preemptions > 0
    if prefix:
        assert v1.block_manager.prefix_cache_stats.hits > 0     # the children's prompt
    with pytest.raises(ValueError, match="beam search"):
        v1.add_request("x", SamplingParams(beam_width=2))
    with pytest.raises(ValueError, match="design must be one of"):
        make_engine(model, design="v2")


def test_beam_search_outside_the_core_completes_eos_candidates_as_vllm_does(model) -> None:
    """vLLM 0.33.0's ``_beam_search_step``: a candidate ending in an end-of-sequence token goes
    to the completed list whatever its rank, and ``beam_width`` live non-EOS beams go on, so
    every step after the first runs exactly ``beam_width`` requests. Here a space is the EOS
    (common in the text): before, EOS candidates took live places and steps shrank."""
    from course_lib.engine.beam_search import beam_search

    space = TOK.encode(" ")[-1]
    eng = make_engine(model, block_size=4, prefix=True, design="v1", stop_token_ids=[space])
    width, max_tokens, per_step = 3, 8, []         # requests per step of the search
    add = eng.add_request

    def counting_add(*args, **kwargs):
        if not eng.has_unfinished_requests():         # the first request of a step
            per_step.append(0)
        per_step[-1] += 1
        return add(*args, **kwargs)

    eng.add_request = counting_add
    best = beam_search(eng, "And God said", width, max_tokens, length_penalty=1.0)
    assert per_step[0] == 1 and all(n == width for n in per_step[1:]), per_step
    ended = [b for b in best if b.tokens[-1] == space]
    assert ended and all(b.finished for b in ended)              # EOS beams were completed
    assert all(b.finished or len(b.tokens) == max_tokens for b in best)
    scores = [b.score(1.0) for b in best]
    assert scores == sorted(scores, reverse=True) and len(best) == width
    assert_all_blocks_back(eng)


def test_logprobs_give_each_steps_top_k_and_beam_search_runs_outside_the_core(model) -> None:
    """vLLM V1 runs beam search as a loop over the engine (one token per beam per step, with
    logprobs = 2 x width): over the V1 design it finds the V0 scheduler's beams exactly, and
    the beams' common prefixes come from the prefix cache."""
    from course_lib.engine.beam_search import beam_search

    eng = make_engine(model, block_size=4, prefix=True, design="v1")
    out = eng.generate("And God said", SamplingParams(max_tokens=3, temperature=0.0,
                                                      logprobs=4))[0].outputs[0]
    assert len(out.logprobs) == 3 and all(len(step) == 4 for step in out.logprobs)
    assert [step[0][0] for step in out.logprobs] == out.token_ids        # greedy = the top
    assert all(step[i][1] >= step[i + 1][1] for step in out.logprobs for i in range(3))
    in_core = make_engine(model, block_size=4).generate(
        "And God said", SamplingParams(max_tokens=10, beam_width=3))[0].outputs
    outside = beam_search(eng, "And God said", 3, 10, ignore_eos=True)
    assert [b.tokens for b in outside] == [c.token_ids for c in in_core]
    assert [round(b.cum_logprob, 4) for b in outside] == \
        [round(c.cumulative_logprob, 4) for c in in_core]
    assert eng.block_manager.prefix_cache_stats.hits > 0
    assert_all_blocks_back(eng)
    with pytest.raises(ValueError, match="logprobs with beam_width"):
        make_engine(model).add_request("x", SamplingParams(beam_width=2, logprobs=2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop_token_ids=[999]), r"stop_token_ids must be ints in 0\.\.258; item 0 is 999"),
    (dict(stop_token_ids=["a"]), r"stop_token_ids must be ints in 0\.\.258; item 0 is 'a'"),
    (dict(stop_token_ids=None), r"stop_token_ids must be a sequence of ints"),
    (dict(clock=None), r"clock must be a callable"),
    (dict(scheduler_config={"max_num_seqs": 4}),
     r"scheduler_config must be None or a SchedulerConfig, got dict"),
    (dict(cache_config={"block_size": 4}), r"cache_config must be None or a CacheConfig"),
    (dict(cache_config=CacheConfig(num_gpu_blocks=10**12)),
     r"num_gpu_blocks=1000000000000 needs .* of KV cache \(.* per block\), more than"),
    (dict(cache_config=CacheConfig(num_gpu_blocks=8, num_cpu_blocks=10**12)),
     r"num_cpu_blocks=1000000000000 needs .* more than .* host memory left"),
    (dict(design="v1", cache_config=CacheConfig(num_gpu_blocks=8, enable_prefix_caching=True,
                                                kv_offloading_size=1e9)),
     r"kv_offloading_size=1000000000.0 needs .* more than .* host memory left")])
def test_constructor_arguments_name_themselves(model, kwargs, match) -> None:
    """Each failed deep inside (an ``AttributeError``, a stop token that can never be drawn
    accepted, or a billion-block free list built until the process was killed for memory)."""
    with pytest.raises(ValueError, match=match):
        LLMEngine(model, **kwargs)
    with pytest.raises(ValueError, match="model must be None or a TinyLlama, got str"):
        LLMEngine("tiny-llama")


@pytest.mark.parametrize("design", ["v0", "v1"])
def test_a_stop_token_past_the_vocabulary_fails_its_request_and_queues_nothing(model,
                                                                               design) -> None:
    """As vLLM 0.33.0 (``_validate_stop_token_ids`` in ``vllm/sampling_params.py``); in
    ``generate`` it fails before the first prompt is queued."""
    engine = make_engine(model, design=design)
    bad = SamplingParams(max_tokens=2, stop_token_ids=[10**6])
    with pytest.raises(ValueError, match=r"stop_token_ids must be ints in 0\.\.258"):
        engine.add_request("x", bad)
    with pytest.raises(ValueError, match=r"params 1: stop_token_ids must be ints"):
        engine.generate(["a", "b"], [GREEDY, bad])
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
