"""Requests and their sequences: what the scheduler schedules.

A :class:`Request` (vLLM v0's ``SequenceGroup``) is one prompt sent by a user. It holds one
:class:`Sequence` per sample it generates: one for greedy/random sampling, ``n`` for parallel
sampling, ``beam_width`` beams for beam search. All of a request's sequences are scheduled,
preempted and swapped together, because they share KV blocks (copy-on-write).

Token bookkeeping of one sequence (the contract with the block manager):

* ``token_ids`` = prompt + output tokens so far.
* ``num_computed_tokens``: leading tokens whose K/V are written in the paged cache.
* While decoding, every token but the last sampled one is computed; the next step feeds the
  last token (its K/V are written) and samples the one after it.

A sequence preempted by recompute forgets its K/V (``num_computed_tokens = 0``) but keeps its
output tokens: its next prefill recomputes ``token_ids[:-1]`` and the last token goes through
a normal decode step, so the tokens it generates are the ones it would have generated anyway.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal

# vLLM's thresholds (vllm/sampling_params.py: _SAMPLING_EPS, _MAX_TEMP): a temperature below
# SAMPLING_EPS means greedy; one in [SAMPLING_EPS, MIN_TEMPERATURE) is raised to
# MIN_TEMPERATURE, below which softmax(logits / t) overflows to inf / nan.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_SEED = 2 ** 64
# At most this many samples or beams per request, as vLLM 0.33.0's SamplingParams checks
# (``_verify_num_sequences`` in ``vllm/sampling_params.py``; ``VLLM_MAX_N_SEQUENCES``, 16384 by
# default): a request with n = 10**9 would otherwise make 10**9 sequences before anything runs.
MAX_N_SEQUENCES = 16384

# The course's sampler (engine/sampler.py: top_p_probs) keeps token i of the sorted
# distribution unless ``before_i >= top_p``, in float32: the best token has before_0 = 0
# exactly, so it stays iff float32(top_p) > 0. Round to nearest even sends every top_p <=
# 2**-150 (half the smallest float32 subnormal, ~7.0e-46) to 0.0, and then no token is kept
# ("invalid multinomial distribution"); 2**-150 itself ties to 0 (even), the next double
# above it rounds up to 2**-149. So top_p must be > TOP_P_FLOOR.
TOP_P_FLOOR = 2.0 ** -150


def is_int(value: object) -> bool:
    """An integer that is not a bool (``True`` is an int to Python, never a count or an id)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def finite_float(value: object, what: str) -> float:
    """``value`` as a Python float, or ``ValueError`` naming it: any real number by its value
    (an int, a float, numpy's, a ``Fraction``, a ``Decimal``), finite; never a bool, a
    string, or a number too large for a float (``10**400``). The step computes with the
    float: a ``Fraction(1, 3)`` left as it is would meet a tensor there and fail."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Decimal)):
        raise ValueError(f"{what} must be a finite number, got {value!r:.60}")
    try:
        out = float(value)
    except (OverflowError, ValueError):      # 10**400, Decimal("sNaN")
        out = math.inf
    if not math.isfinite(out):
        raise ValueError(f"{what} must be a finite number, got {value!r:.60}")
    return out


def token_ids_or_error(ids: Iterable[object], vocab_size: int | None = None,
                       what: str = "token ids") -> tuple[int, ...]:
    """``ids`` as a tuple of Python ints, or ``ValueError`` naming the first bad one (not an
    integer, a bool, negative, or >= ``vocab_size``). Strings and floats are refused, never
    converted: ``"65"`` or ``65.9`` is a caller's bug, not token 65. Integers of any kind
    (numpy's too) become Python ints; a 0-d array or tensor is one number, not a sequence."""
    valid = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
    try:
        if isinstance(ids, (str, bytes, bytearray)):
            raise TypeError
        items = iter(ids)                   # a 0-d array or tensor raises TypeError here
    except TypeError:
        raise ValueError(f"{what} must be a sequence of ints in {valid}, got "
                         f"{type(ids).__name__} {ids!r:.60}") from None
    out = []
    for i, t in enumerate(items):
        if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"{what} must be ints in {valid}; item {i} is {t!r}")
        out.append(int(t))
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """How many tokens to generate and how (vLLM's names and validation rules).

    ``temperature``, ``top_p`` and ``seed`` are carried for the model's sampler; the scheduler
    only needs ``max_tokens``, ``n`` and ``beam_width``. Everything is checked here, when the
    request is made, so that a bad value fails its own request at once instead of a step of
    the engine later: a finite ``temperature >= 0`` (below ``SAMPLING_EPS``: greedy; below
    ``MIN_TEMPERATURE``: sampled at ``MIN_TEMPERATURE``), ``2**-150 < top_p <= 1``, an integer
    ``seed`` in ``[0, 2**64)``, integer counts >= 1, token ids >= 0 (``stop_token_ids``: any
    iterable of them, kept as a tuple); bools are never numbers.

    Numbers are taken by value: integers of any kind (numpy's too) are kept as Python ints,
    real numbers (numpy's, ``Fraction``, ``Decimal``) as Python floats, what the sampler
    computes with; anything else is a ``ValueError`` naming the value.

    ``top_p``'s floor is the course sampler's, not vLLM's: ``top_p_probs`` compares ``top_p``
    in float32, where anything <= 2**-150 (~7.0e-46) rounds to 0 and then not even the most
    likely token stays (``TOP_P_FLOOR``), so such a request would fail its first step with
    "invalid multinomial distribution". vLLM 0.33.0 (``vllm/sampling_params.py``,
    ``_verify_args``) accepts any ``0 < top_p <= 1``: its sampler
    (``vllm/v1/sample/ops/topk_topp_sampler.py``, ``apply_top_k_top_p_pytorch``) always keeps
    the most likely token (``top_p_mask[:, -1] = False``), so there a tiny ``top_p`` samples
    greedily. The course refuses it at the door instead.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1                # parallel samples: n sequences forked from the prompt
    beam_width: int = 1       # > 1: beam search keeping that many beams
    logprobs: int | None = None           # > 0: the top-k (token, logprob) of each step too
    stop_token_ids: tuple[int, ...] = ()  # a sample that draws one stops (the token is kept);
                                          # beam search ignores them and runs to max_tokens

    def __post_init__(self) -> None:
        # Numbers are taken by value and kept as the plain int / float the step computes
        # with: a seed np.int64(2) (what np.random.randint returns) would overflow in the
        # sampler's seed arithmetic, a temperature Fraction(1, 3) fail against a tensor.
        for name in ("max_tokens", "n", "beam_width"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("n", "beam_width"):         # vLLM's bound: VLLM_MAX_N_SEQUENCES
            if getattr(self, name) > MAX_N_SEQUENCES:
                raise ValueError(f"{name} must be at most {MAX_N_SEQUENCES}, got "
                                 f"{getattr(self, name)} (vLLM's VLLM_MAX_N_SEQUENCES)")
        given_top_p = self.top_p
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, finite_float(getattr(self, name), name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {given_top_p!r}")
        if self.top_p <= TOP_P_FLOOR:
            raise ValueError(f"top_p must be in (2**-150, 1], got {given_top_p!r}: the sampler "
                             f"compares it in float32, where a top_p <= 2**-150 (~7.0e-46) is "
                             f"0 and keeps no token")
        if self.seed is not None:
            if not is_int(self.seed) or not 0 <= self.seed < MAX_SEED:
                raise ValueError(f"seed must be None or an int in [0, 2**64), got "
                                 f"{self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))
        if self.logprobs is not None:
            if not is_int(self.logprobs) or self.logprobs < 0:
                raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
            object.__setattr__(self, "logprobs", int(self.logprobs))
        stops = token_ids_or_error(self.stop_token_ids, what="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", stops)     # any iterable in, a tuple kept
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"use either n > 1 (parallel sampling) or beam_width > 1, "
                             f"got n={self.n}, beam_width={self.beam_width}")

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_temperature(self) -> float:
        """The temperature a non-greedy sampler divides by (at least ``MIN_TEMPERATURE``)."""
        return max(self.temperature, MIN_TEMPERATURE)

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs once its prompt is done."""
        return max(self.n, self.beam_width)

    def num_candidates(self, first_token: bool) -> int:
        """(token, logprob) candidates one sequence draws in a step that samples: the one rule
        the scheduler (asks for them), the samplers (draw them) and the output processor (keeps
        them) follow.

        * beam search: ``2 * beam_width`` per beam at every step, the single prompt sequence
          included; the output processor keeps the ``beam_width`` best (beam + token) of them
          all (twice the width, as vLLM V0 asks, so that enough candidates remain when some
          are cut).
        * sampling: ``n`` for the first token (the prompt forks into ``n`` samples, candidate
          ``i`` is sample ``i``'s token), then one per sample.
        """
        if self.use_beam_search:
            return 2 * self.beam_width
        return self.n if first_token else 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    # vLLM V1's RequestStatus: blocks allocated, K/V loading from a KV connector (V1 only)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "finished_stopped"          # a stop token (not produced by the sim)
    FINISHED_LENGTH_CAPPED = "finished_length"     # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"          # abort_request, or a beam dropped
    FINISHED_IGNORED = "finished_ignored"          # can never fit: rejected, never retried
    FINISHED_ERROR = "finished_error"              # its own work failed inside a step

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        """The short code a client sees (vLLM's ``finish_reason``): ``"stop"``, ``"length"``,
        ``"abort"``, ``"ignored"`` (vLLM V0 reports an ignored request as ``"length"``; the
        course keeps the two apart), ``"error"`` (as vLLM V1's ``FinishReason.ERROR`` in
        ``vllm/v1/engine/__init__.py``: its own work failed), or None while unfinished."""
        return FINISH_REASONS.get(self)


FINISHED_STATUSES = frozenset(s for s in SequenceStatus if s.name.startswith("FINISHED"))
FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop",
                  SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort",
                  SequenceStatus.FINISHED_IGNORED: "ignored",
                  SequenceStatus.FINISHED_ERROR: "error"}


class RequestFailed(Exception):
    """Raised inside a step when one request's own work fails (its sampling, its output
    processing): the engine rolls the step back and finishes that request alone."""

    def __init__(self, request_id: int, cause: BaseException) -> None:
        super().__init__(f"request {request_id}: {type(cause).__name__}: {cause}")
        self.request_id, self.cause = request_id, cause


@dataclass(eq=False)
class Sequence:
    """One generated continuation of a prompt. ``index``: its sample number in the request
    (0..n-1), which a seeded sampler uses so that samples differ."""

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    output_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # top-k each
    # a KV connector's parameters for it (vLLM's Request.kv_transfer_params: a V1 request is
    # one sequence), read by the connector's scheduler side; None without a connector
    kv_transfer_params: dict | None = None
    # prompt + output tokens in one list, grown beside output_token_ids (what token_ids hands
    # out): vLLM 0.33.0's Request keeps ``_all_token_ids`` the same way (vllm/v1/request.py)
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output tokens: the sequence's own list, not a copy, so that reading it
        costs O(1) whatever the length (the V1 scheduler passes it to the KV-cache manager at
        every decode step, the model runner reads it every step). Read it, never change it:
        it grows as :meth:`append_output_token_ids` appends, so a caller that keeps it past
        the next token copies it. Output tokens appended to ``output_token_ids`` directly (a
        test, an exercise) are noticed (a length or last-token mismatch) and the list is
        rebuilt."""
        tokens, out = self._all_token_ids, self.output_token_ids
        if len(tokens) != len(self.prompt_token_ids) + len(out) or out and tokens[-1] != out[-1]:
            tokens = self._all_token_ids = [*self.prompt_token_ids, *out]
        return tokens

    def append_output_token_ids(self, token_id: int) -> None:
        """One more output token (vLLM 0.33.0's ``Request.append_output_token_ids``,
        vllm/v1/request.py: the output list and the list of all tokens grow together)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def prefill_target(self) -> int:
        """Tokens that must be computed before the next decode step: the whole prompt before
        the first token is sampled, every token but the last one afterwards (recompute)."""
        return len(self) - 1 if self.output_token_ids else len(self)

    @property
    def needs_prefill(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def fork(self, seq_id: int, index: int) -> Sequence:
        return Sequence(seq_id, self.prompt_token_ids, index, list(self.output_token_ids),
                        self.status, self.num_computed_tokens, self.cumulative_logprob,
                        list(self.output_logprobs))


@dataclass(eq=False)
class Request:
    """A prompt and its sequences (vLLM v0's ``SequenceGroup``), with its timestamps."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None     # a short code: stop, length, abort, ignored, error
    finish_detail: str | None = None     # why it was aborted or ignored: a sentence to read
    cache_salt: str | None = None        # prefix-cache namespace: only equal salts share
    num_preemptions: int = 0
    num_cached_tokens: int = 0           # prompt tokens found in the prefix cache (first time)
    kv_transfer_output: dict | None = None   # what the KV connector returned when it finished

    def __post_init__(self) -> None:
        self.prompt_token_ids = token_ids_or_error(self.prompt_token_ids,
                                                   what=f"request {self.request_id}'s prompt")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt must have >= 1 token")
        try:
            self.arrival_time = finite_float(self.arrival_time, "arrival_time")
        except ValueError:
            raise ValueError(f"request {self.request_id}: arrival_time must be a finite number "
                             f"of seconds, got {self.arrival_time!r:.60}") from None
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"request {self.request_id}: cache_salt must be a str or None, "
                             f"got {self.cache_salt!r}")

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status not in FINISHED_STATUSES]

    @property
    def is_finished(self) -> bool:
        return all(s.status in FINISHED_STATUSES for s in self.seqs)

    @property
    def is_prefill(self) -> bool:
        """True while some sequence still has tokens to (re)compute before decoding."""
        return any(s.num_computed_tokens < s.prefill_target for s in self.seqs
                   if s.status not in FINISHED_STATUSES)

    @property
    def num_output_tokens(self) -> int:
        return max((len(s.output_token_ids) for s in self.seqs), default=0)

    def ordered_seqs(self) -> list[Sequence]:
        """The sequences to report: by sample index, or the kept beams, best first."""
        if self.sampling_params.use_beam_search:
            return sorted((s for s in self.seqs if s.status != SequenceStatus.FINISHED_ABORTED),
                          key=lambda s: (-s.cumulative_logprob, s.output_token_ids))
        return sorted(self.seqs, key=lambda s: s.index)

    def outputs(self) -> list[list[int]]:
        """Generated tokens of each sequence, in :meth:`ordered_seqs` order."""
        return [list(s.output_token_ids) for s in self.ordered_seqs()]
