"""What comes into the engine (engine/inputs.py): every bad argument of ``add_request`` /
``generate`` names itself in a ``ValueError`` before anything is queued."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.engine.inputs import (
    check_params,
    generate_inputs,
    prompt_token_ids,
    request_params,
)
from course_lib.model.tokenizer import ByteTokenizer
from course_lib.sequence import SamplingParams

pytestmark = pytest.mark.ch10
torch.set_num_threads(1)
TOK = ByteTokenizer()


def ids(prompt):
    return prompt_token_ids(prompt, TOK, TOK.vocab_size)


@pytest.mark.parametrize("prompt, kind", [(None, "NoneType"), (5, "int"), (2.5, "float"),
                                          (b"ab", "bytes"), (object(), "object"),
                                          (torch.tensor(5), "Tensor"),
                                          (np.array(5), "ndarray")])
def test_a_prompt_that_is_not_text_or_token_ids_names_itself(prompt, kind):
    """A 0-d tensor or array is one number, not a sequence of ids: before, iterating it raised
    a bare ``TypeError`` ("iteration over a 0-d tensor")."""
    with pytest.raises(ValueError, match=rf"prompt token ids must be a sequence of ints in "
                                         rf"0\.\.258, got {kind}"):
        ids(prompt)


def test_token_ids_of_any_integer_kind_are_python_ints():
    got = ids(np.array([1, 2], dtype=np.int32))
    assert got == (1, 2) and {type(t) for t in got} == {int}
    with pytest.raises(ValueError, match=r"item 0 is tensor\(1\)"):
        ids(torch.tensor([1, 2]))            # a tensor's items are tensors: refused, named


@pytest.mark.parametrize("prompt", [{1, 2}, {1: 2}, frozenset([3])])
def test_an_unordered_prompt_is_refused(prompt):
    with pytest.raises(ValueError, match="the prompt must be text or a sequence of token ids "
                                         r"in 0\.\.258, got a .* \(no order\)"):
        ids(prompt)


def test_a_lone_surrogate_in_a_text_prompt_names_the_prompt():
    with pytest.raises(ValueError, match=r"the prompt text must be valid Unicode .* got "
                                         r"'\\ud800' at index 2: surrogates not allowed"):
        ids("ab\ud800c")
    assert ids("é") == (TOK.bos_id, 0xC3, 0xA9)
    assert ids((1, 2)) == (1, 2)


@pytest.mark.parametrize("params", [5, "greedy", {"temperature": 0}])
def test_params_that_are_not_sampling_params_name_themselves(params):
    with pytest.raises(ValueError, match=r"params must be None or a SamplingParams, got"):
        request_params(params, frozenset())
    assert check_params(None) == SamplingParams()


def check_prompt(p):
    return ids(p)


@pytest.mark.parametrize("prompts, kind", [(None, "NoneType"), (5, "int"),
                                           ((p for p in ["a"]), "generator"), (b"ab", "bytes")])
def test_generate_prompts_that_are_not_a_list_name_themselves(prompts, kind):
    with pytest.raises(ValueError, match=rf"^prompts must be a str or a list of prompts .*, "
                                         rf"got {kind}"):
        generate_inputs(prompts, None, check_prompt)


@pytest.mark.parametrize("params, kind", [(5, "int"), ("p", "str"), ({1: 2}, "dict")])
def test_generate_params_that_are_not_a_list_name_themselves(params, kind):
    with pytest.raises(ValueError, match=rf"^params must be None, a SamplingParams or a list "
                                         rf"of them \(one per prompt\), got {kind}"):
        generate_inputs(["a"], params, check_prompt)


def test_generate_checks_every_params_and_on_step_before_queueing():
    with pytest.raises(ValueError, match=r"^params 1: params must be None or a SamplingParams"):
        generate_inputs(["a", "b"], [SamplingParams(), 7], check_prompt)
    with pytest.raises(ValueError, match=r"^prompt 1: prompt token ids must be a sequence"):
        generate_inputs(["a", None], None, check_prompt)
    with pytest.raises(ValueError, match=r"^on_step must be None or a callable"):
        generate_inputs(["a"], None, check_prompt, on_step=3)
    prompts, params = generate_inputs("a", None, check_prompt, on_step=print)
    assert prompts == ["a"] and params == [SamplingParams()]


@pytest.fixture(scope="module")
def engine():
    from course_lib.engine.llm_engine import LLMEngine

    return LLMEngine()


@pytest.mark.parametrize("call, match", [
    (lambda e: e.add_request(None), "prompt token ids must be a sequence of ints"),
    (lambda e: e.add_request(5), "prompt token ids must be a sequence of ints"),
    (lambda e: e.add_request("x\udcff"), "the prompt text must be valid Unicode"),
    (lambda e: e.add_request("x", 5), "params must be None or a SamplingParams"),
    (lambda e: e.add_request("x", request_id=-1), "request_id must be an int >= 0"),
    (lambda e: e.add_request("x", arrival_time=float("nan")), "arrival_time must be a finite"),
    (lambda e: e.add_request("x", cache_salt=3), "cache_salt must be a str or None"),
    (lambda e: e.generate(None), "prompts must be a str or a list"),
    (lambda e: e.generate(["a", "b"], 5), "params must be None, a SamplingParams or a list"),
    (lambda e: e.generate(["a", "b"], [None, "x"]), "params 1: params must be None or a"),
    (lambda e: e.generate(["a", None]), "prompt 1: prompt token ids must be a sequence"),
])
def test_engine_inputs_name_themselves_and_queue_nothing(engine, call, match):
    with pytest.raises(ValueError, match=match):
        call(engine)
    assert not engine.has_unfinished_requests()
