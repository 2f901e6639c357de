"""Checking what comes into the engine before anything is queued, so that bad input fails at
once and names itself (``ValueError``) instead of failing a step later: prompts, sampling
parameters, request ids, and ``generate``'s lists of them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import replace

from ..model.tokenizer import ByteTokenizer
from ..sequence import SamplingParams, is_int, token_ids_or_error


def prompt_token_ids(prompt: str | Sequence[int], tokenizer: ByteTokenizer,
                     vocab_size: int) -> tuple[int, ...]:
    """Text (encoded with BOS) or token ids: ints in the vocabulary, at least one."""
    if isinstance(prompt, str):
        ids = tuple(tokenizer.encode(prompt))
    else:
        ids = token_ids_or_error(prompt, vocab_size, "prompt token ids")
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    return ids


def request_params(params: SamplingParams | None,
                   stop_token_ids: frozenset[int]) -> SamplingParams:
    """``params`` (None: the defaults) checked, with the engine's ``stop_token_ids`` (EOS)
    added to the request's own. ``SamplingParams`` checks its own values."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.logprobs is not None and params.use_beam_search:
        raise ValueError("logprobs with beam_width > 1: the beams' scores are their "
                         "cumulative logprobs already; ask for logprobs without beams")
    extra = tuple(t for t in sorted(stop_token_ids) if t not in params.stop_token_ids)
    if extra:                              # the engine's stop tokens (EOS) join the request's
        params = replace(params, stop_token_ids=params.stop_token_ids + extra)
    return params


def check_request_id(request_id: object, in_use: Container[int]) -> None:
    """A new request id: an int >= 0 that no queued request holds."""
    if not is_int(request_id) or request_id < 0:
        raise ValueError(f"request_id must be an int >= 0, got {request_id!r}")
    if request_id in in_use:
        raise ValueError(f"request id {request_id} is already in use")


def generate_inputs(prompts: str | Sequence[str] | Sequence[Sequence[int]],
                    params: SamplingParams | Sequence[SamplingParams] | None,
                    check_prompt: Callable[[str | Sequence[int]], object]
                    ) -> tuple[Sequence, Sequence[SamplingParams]]:
    """``generate``'s arguments as one list of prompts and one ``SamplingParams`` per prompt,
    every prompt checked by ``check_prompt`` (its error names the prompt's index)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"one SamplingParams per prompt: {len(prompts)} prompts, "
                         f"{len(params)} params")
    for i, p in enumerate(prompts):        # all checked before any is queued
        try:
            check_prompt(p)
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
    return prompts, params
