"""Chapter 01's exercises: what the checkers accept and what they say, beyond
tests/test_exercises.py."""

from __future__ import annotations

import pytest
import torch

from course_lib.exercises import ch01
from course_lib.exercises.ch01_batch import (
    WRONG_IDEAS,
    batch_cases,
    check_max_batch_size,
    reference_max_batch_size,
    reference_num_params,
)

pytestmark = pytest.mark.ch01


def vectorised(x, Wq, Wk, Wv, num_heads, num_kv_heads):
    """A correct answer written another way: all steps at once, under a causal mask."""
    n, d = len(x), Wq.shape[1] // num_heads
    q = (x @ Wq).view(n, num_heads, d).transpose(0, 1)
    k, v = (x @ Wk).view(n, num_kv_heads, d), (x @ Wv).view(n, num_kv_heads, d)
    g = num_heads // num_kv_heads
    kk, vv = (t.repeat_interleave(g, dim=1).transpose(0, 1) for t in (k, v))
    scores = q @ kk.transpose(1, 2) / d ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    out = (torch.softmax(scores, -1) @ vv).transpose(0, 1).reshape(n, num_heads * d)
    return out, k, v


def test_gqa_checker_accepts_any_correct_answer():
    assert ch01.check_gqa_decode(vectorised).ok


def test_gqa_checker_names_the_mistake():
    round_robin = ch01.EXERCISES["1.2"].rule("reads KV head").wrong
    future = ch01.EXERCISES["1.2"].rule("0..t only").wrong
    assert "h // (num_heads // num_kv_heads)" in ch01.check_gqa_decode(round_robin).first_problem
    assert "only the cache as it is" in ch01.check_gqa_decode(future).first_problem

    def cache_per_query_head(x, Wq, Wk, Wv, num_heads, num_kv_heads):
        out, k, v = vectorised(x, Wq, Wk, Wv, num_heads, num_kv_heads)
        g = num_heads // num_kv_heads
        return out, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    verdict = ch01.check_gqa_decode(cache_per_query_head)
    assert "per KV head (not per query head)" in verdict.first_problem


def test_config_cases_leave_keys_out_as_real_configs_do():
    cases = ch01.config_cases()
    assert any("num_key_value_heads" not in c for c, _ in cases)
    assert any(c.get("head_dim", 0) is None for c, _ in cases)
    assert any(c.get("kv_lora_rank") and tp > 1 for c, tp in cases)
    assert any(tp > (c.get("num_key_value_heads") or 0) and not c.get("kv_lora_rank")
               for c, tp in cases)


# ---------------------------------------------------------------- 1.3: the largest batch

def test_1_3_parameter_counts_are_the_published_ones():
    from course_lib.exercises.ch01_batch import CONFIGS as configs
    from course_lib.sizing.models import get_preset

    for name in ("Llama-2-7B", "Llama-3-8B", "Llama-3-70B"):
        assert reference_num_params(configs[name]) == get_preset(name).num_params
    assert reference_num_params(configs["Llama-3.2-1B"]) == 1_235_814_400   # tied head
    assert reference_num_params(configs["Gemma-2B"]) == 2_506_172_416       # MQA, tied


def test_1_3_cases_have_exact_fits_and_models_that_do_not_load():
    cases = batch_cases()
    answers = [reference_max_batch_size(*c) for c in cases]
    assert answers.count(0) >= 4 and max(answers) > 100
    exact = [(c, a) for c, a in zip(cases, answers, strict=True)
             if a == reference_max_batch_size(c[0], c[1] - 1 / 2**30, c[2], c[3]) + 1]
    assert len(exact) >= 3                          # one byte less: one request fewer
    assert any(c[0].get("tie_word_embeddings") for c in cases)
    assert any("num_key_value_heads" not in c[0] for c in cases)


def test_1_3_feedback_names_the_part_of_the_model_that_was_miscounted():
    for wrong, idea in WRONG_IDEAS:
        v = check_max_batch_size(wrong)
        assert not v.ok and idea in v.first_problem, (wrong.__name__, v)

    def reads_every_key(config, gib, prompt_len, output_len):
        assert config["num_key_value_heads"] and config["head_dim"]   # KeyError if missing
        return reference_max_batch_size(config, gib, prompt_len, output_len)

    v = check_max_batch_size(reads_every_key)
    assert "KeyError" in v.first_problem and "means MHA" in v.first_problem
