"""The sampler: logits -> the (token, logprob) candidates the scheduler asked for.

For each scheduled entry that samples (``num_candidates > 0``, as
:meth:`~course_lib.sequence.SamplingParams.num_candidates` rules):

* **beam search**: the ``num_candidates`` (= 2 x beam width) most likely tokens with their
  log-probabilities; the scheduler's beam step keeps the best ``beam_width`` (beam + token).
* **greedy** (``temperature == 0``): the argmax, ``num_candidates`` times (the same token for
  each parallel sample).
* **random**: ``softmax(logits / temperature)`` cut to the smallest set of tokens whose
  probability reaches ``top_p`` (nucleus sampling), sampled with a ``torch.Generator`` seeded
  from (request seed, sample index, position). The draw of a token therefore depends neither
  on the batch it ran in nor on preemption: the same seed gives the same text, and the ``n``
  samples of a request (indices 0..n-1) differ.

A logprob is that of the model's distribution (``log_softmax(logits)``, before temperature),
as vLLM reports it.
"""

from __future__ import annotations

import torch

from ..scheduler.output import ScheduledSeq
from ..sequence import SamplingParams

_MASK64 = (1 << 63) - 1


def sample_seed(base_seed: int, index: int, position: int) -> int:
    """A generator seed mixing the request's seed, the sample index and the token position
    (a SplitMix64-like mix, so that nearby inputs give unrelated streams)."""
    x = (base_seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position) & _MASK64
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 29)


def top_p_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``probs [vocab]`` of ``softmax(logits / temperature)`` with the tail beyond ``top_p``
    zeroed (the most likely token always stays, for any ``top_p > 2**-150``: the comparison
    is in float32, where a smaller ``top_p`` is 0 and nothing stays, which is why
    ``SamplingParams`` refuses it, ``TOP_P_FLOOR``). Not renormalised: multinomial does it."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p      # mass of the better tokens
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_p)


def sample_one(logits: torch.Tensor, params: SamplingParams, base_seed: int, index: int,
               position: int) -> tuple[int, float]:
    """One (token, logprob) from ``logits [vocab]`` for sample ``index`` at ``position``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.is_greedy:
        token = int(torch.argmax(logits))
    else:
        gen = torch.Generator().manual_seed(sample_seed(base_seed, index, position))
        probs = top_p_probs(logits, params.sampling_temperature, params.top_p)
        token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logprobs[token])


def sample(entry: ScheduledSeq, logits: torch.Tensor, base_seed: int) -> list[tuple[int, float]]:
    """The ``entry.num_candidates`` candidates of one scheduled sequence (module docstring).

    ``base_seed``: the request's ``SamplingParams.seed``, or a seed the engine drew for it."""
    params, seq, k = entry.request.sampling_params, entry.seq, entry.num_candidates
    if k < 1:
        raise ValueError(f"seq {seq.seq_id} samples nothing (num_candidates={k})")
    if params.use_beam_search:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logprobs, min(k, logprobs.numel()))
        return [(int(t), float(lp)) for lp, t in zip(top.values, top.indices, strict=True)]
    position = len(seq)                   # the position of the token being sampled
    if k == 1:                            # one running sample: its own index
        return [sample_one(logits, params, base_seed, seq.index, position)]
    # the prompt's last step forks it into k samples: sample i gets index i
    return [sample_one(logits, params, base_seed, i, position) for i in range(k)]
