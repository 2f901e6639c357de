"""Chapters 10 and 11: each exercise checker passes the library's solution and fails a wrong
one; the capstone's reference step loop equals LLMEngine; the chapter drawings."""

from __future__ import annotations

import pytest
import torch

from course_lib import capacity as cap
from course_lib.config import CacheConfig, SchedulerConfig
from course_lib.engine.llm_engine import LLMEngine
from course_lib.engine.model_runner import ModelRunner
from course_lib.exercises import ch10, ch11
from course_lib.exercises.ch10_beams import beam_step, check_beam_step
from course_lib.model.loader import load_tiny_model
from course_lib.model.tokenizer import ByteTokenizer
from course_lib.sequence import SamplingParams
from course_lib.viz.serving import TableHistory, draw_sharing, draw_table_growth

pytestmark = [pytest.mark.ch10, pytest.mark.ch11]
torch.set_num_threads(1)
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def not_attempted(*args):
    raise NotImplementedError


# ---------------------------------------------------------------- chapter 10
def test_ch10_checkers_pass_the_library_and_fail_wrong_answers() -> None:
    assert ch10.check_flatten_step(ch10.flatten_step).ok
    assert check_beam_step(beam_step).ok
    assert ch10.check_sharing_predictions(lambda: {"a": 0.75, "b": 3 / 8, "c": 1 / 3,
                                                   "d": 0.5}).ok
    # wrong: sorts the new beams worst first / says no sharing ever
    worst = check_beam_step(lambda b, lg, w: beam_step(b, lg, w)[::-1])
    assert not worst.ok and "first difference" in str(worst)
    assert not ch10.check_sharing_predictions(lambda: dict.fromkeys("abcd", 0.0)).ok
    for checker in (ch10.check_flatten_step, check_beam_step, ch10.check_sharing_predictions):
        assert "not attempted yet" in str(checker(not_attempted))


def test_ch10_drawings_show_tables_and_sharing(model) -> None:
    engine = LLMEngine(model, cache_config=CacheConfig(block_size=4, num_gpu_blocks=48))
    history = TableHistory()
    engine.generate(["And God said", "In the"], SamplingParams(max_tokens=10, temperature=0.0),
                    on_step=history)
    assert history.request_ids() == [0, 1]
    n = len(TOK.encode("And God said"))
    assert [s[0][0] for s in history.steps[:3]] == [n, n + 1, n + 2]   # one slot per step
    fig = draw_table_growth(history, block_size=4)
    assert len(fig.axes) == 2 and fig.axes[0].get_title().startswith("request 0")
    beams = TableHistory()
    engine.generate("And God said", SamplingParams(max_tokens=8, beam_width=3), on_step=beams)
    assert any(h < u for h, u in beams.shared)
    assert draw_sharing(beams, "x").axes[0].get_ylabel() == "GPU blocks"


# ---------------------------------------------------------------- chapter 11
def test_ch11_tiny_spec_matches_the_runners_tensors(model) -> None:
    runner = ModelRunner(model, CacheConfig(block_size=16, num_gpu_blocks=2),
                         attn_impl="reference")
    assert cap.block_bytes(ch11.tiny_spec(model), 16) == runner.kv_bytes_per_block


def test_ch11_reference_loop_equals_llm_engine_and_preempts(model) -> None:
    for prompts, max_tokens, n, bs, gpu, cpu, mode in ch11.WORKLOADS:
        ids = [TOK.encode(p) for p in prompts]
        got = ch11.run_loop(ch11.mini_step, model, ids, max_tokens, n, bs, gpu, cpu, mode)
        engine = LLMEngine(model, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                                  max_model_len=256, preemption_mode=mode),
                           CacheConfig(bs, gpu, cpu), stop_token_ids=())
        outs = engine.generate(ids, SamplingParams(max_tokens=max_tokens, n=n,
                                                   temperature=0.0))
        assert got == [[c.token_ids for c in o.outputs] for o in outs]
        if gpu == 20:
            assert engine.scheduler.num_preemptions > 0
        if mode == "swap" and gpu == 20:
            assert engine.runner.num_swapped_blocks > 0
        if n > 1:
            assert engine.runner.num_copied_blocks > 0


def test_ch11_checkers_pass_the_library_and_catch_a_skipped_cache_op(model) -> None:
    assert ch11.check_cache_ops(ch11.library_cache_ops, model).ok
    assert ch11.check_append_slots(lambda bm, s, t: bm.__class__.append_slots(bm, s, t),
                                   model).ok
    assert "not attempted yet" in str(ch11.check_cache_ops(not_attempted, model))

    def no_swap_in(eng, out):               # forgets to bring swapped blocks back
        out.blocks_to_swap_in = []
        ch11.library_cache_ops(eng, out)

    verdict = ch11.check_cache_ops(no_swap_in, model)
    assert not verdict.ok and "swap" in verdict.first_problem
