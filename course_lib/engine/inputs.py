"""Checking what comes into the engine before anything is queued, so that bad input fails at
once and names itself (``ValueError``) instead of failing a step later: prompts, sampling
parameters, request ids, and ``generate``'s lists of them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

from ..model.tokenizer import ByteTokenizer
from ..sequence import SamplingParams, is_int, token_ids_or_error


def prompt_token_ids(prompt: str | Sequence[int], tokenizer: ByteTokenizer,
                     vocab_size: int) -> tuple[int, ...]:
    """Text (encoded with BOS) or token ids: ints in the vocabulary, at least one. Anything
    else (None, a number, a set or a dict, whose order means nothing) is a ``ValueError``
    naming the prompt, as is text that UTF-8 cannot encode (a lone surrogate)."""
    if isinstance(prompt, str):
        try:
            ids = tuple(tokenizer.encode(prompt))
        except UnicodeEncodeError as exc:
            raise ValueError(f"the prompt text must be valid Unicode (UTF-8 encodable), got "
                             f"{exc.object[exc.start:exc.end]!r} at index {exc.start}: "
                             f"{exc.reason}") from None
    elif isinstance(prompt, (AbstractSet, Mapping)):
        raise ValueError(f"the prompt must be text or a sequence of token ids in "
                         f"0..{vocab_size - 1}, got a {type(prompt).__name__} (no order)")
    else:
        ids = token_ids_or_error(prompt, vocab_size, "prompt token ids")
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    return ids


def check_params(params: object, vocab_size: int | None = None) -> SamplingParams:
    """``params`` (None: the defaults) as a ``SamplingParams`` the engine can run, or
    ``ValueError``. ``SamplingParams`` checks its own values; what it cannot know, the model's
    vocabulary, is checked here: a stop token past it could never be drawn (vLLM 0.33.0
    refuses it too, ``_validate_stop_token_ids`` in ``vllm/sampling_params.py``)."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be None or a SamplingParams, got "
                         f"{type(params).__name__} {params!r:.60}")
    if vocab_size is not None:
        token_ids_or_error(params.stop_token_ids, vocab_size, "stop_token_ids")
    if params.logprobs is not None and params.use_beam_search:
        raise ValueError("logprobs with beam_width > 1: the beams' scores are their "
                         "cumulative logprobs already; ask for logprobs without beams")
    return params


def request_params(params: SamplingParams | None, stop_token_ids: frozenset[int],
                   vocab_size: int | None = None) -> SamplingParams:
    """``params`` (None: the defaults) checked (:func:`check_params`), with the engine's
    ``stop_token_ids`` (EOS) added to the request's own."""
    params = check_params(params, vocab_size)
    extra = tuple(t for t in sorted(stop_token_ids) if t not in params.stop_token_ids)
    if extra:                              # the engine's stop tokens (EOS) join the request's
        params = replace(params, stop_token_ids=params.stop_token_ids + extra)
    return params


def check_request_id(request_id: object, in_use: Container[int]) -> int:
    """A new request id: an int >= 0 (numpy's too) that no queued request holds; returned as
    a Python int, the type every output carries."""
    if not is_int(request_id) or request_id < 0:
        raise ValueError(f"request_id must be an int >= 0, got {request_id!r}")
    if request_id in in_use:
        raise ValueError(f"request id {request_id} is already in use")
    return int(request_id)


def generate_inputs(prompts: str | Sequence[str] | Sequence[Sequence[int]],
                    params: SamplingParams | Sequence[SamplingParams] | None,
                    check_prompt: Callable[[str | Sequence[int]], object], *,
                    on_step: object = None, vocab_size: int | None = None
                    ) -> tuple[Sequence, Sequence[SamplingParams]]:
    """``generate``'s arguments as one list of prompts and one ``SamplingParams`` per prompt,
    every prompt checked by ``check_prompt`` and every ``SamplingParams`` by
    :func:`check_params` (against ``vocab_size``; their errors name the index), and
    ``on_step`` (None or a callable): all before any request is queued."""
    if on_step is not None and not callable(on_step):
        raise ValueError(f"on_step must be None or a callable(engine, scheduler_output), "
                         f"got {type(on_step).__name__} {on_step!r:.60}")
    if isinstance(prompts, str):
        prompts = [prompts]
    elif not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts must be a str or a list of prompts (each text or a list "
                         f"of token ids), got {type(prompts).__name__} {prompts!r:.60}")
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    elif not isinstance(params, Sequence) or isinstance(params, (str, bytes, bytearray)):
        raise ValueError(f"params must be None, a SamplingParams or a list of them (one per "
                         f"prompt), got {type(params).__name__} {params!r:.60}")
    if len(params) != len(prompts):
        raise ValueError(f"one SamplingParams per prompt: {len(prompts)} prompts, "
                         f"{len(params)} params")
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        try:
            check_prompt(p)
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
        try:
            check_params(sp, vocab_size)
        except ValueError as exc:
            raise ValueError(f"params {i}: {exc}") from None
    return prompts, params
