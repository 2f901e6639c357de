"""Beam search as a loop over the engine, outside its core: what vLLM V1 does.

vLLM 0.33.0 has no beam search in its scheduler. ``LLM.beam_search``
(``vllm/entrypoints/generate/beam_search/offline.py``) runs it from outside: at every step,
each live beam becomes a request for *one* token with ``logprobs = 2 * beam_width``
(``SamplingParams(max_tokens=1, logprobs=...)``); every beam's candidates are pooled. A
candidate that ends in an end-of-sequence token is complete and goes to the completed list,
whatever its rank; of the others, the ``beam_width`` best by score go on (``_beam_search_step``
in ``offline.py``: an EOS never takes a live beam's place). The score is
``cumulative_logprob / num_generated ** length_penalty``, the EOS token counted
(``vllm/entrypoints/generate/beam_search/utils.py:get_beam_search_score``). The beams' common
prefixes are not forked: the engine's prefix cache finds them, step after step. At the end,
complete and live beams together are ranked by score and the ``beam_width`` best returned.

:func:`beam_search` does the same over :class:`~course_lib.engine.llm_engine.LLMEngine`, either
design (the V1 design, whose core has no beam search, is the point). Ties are broken by
content, never by request ids (vLLM's sort keeps arrival order). With ``ignore_eos=True`` it
ranks exactly as the V0 design's beam search in the scheduler does, so the two give the same
beams; with end-of-sequence tokens they differ by design: V0's in-core search (0.6.3) lets a
finished beam take one of the ``beam_width`` places of a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..sequence import SamplingParams
from .inputs import prompt_token_ids
from .llm_engine import LLMEngine


@dataclass
class BeamSearchSequence:
    """One beam: its generated tokens and their summed log-probability."""

    tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finished: bool = False
    text: str = ""

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(len(self.tokens), 1) ** length_penalty


def beam_search(engine: LLMEngine, prompt: str | Sequence[int], beam_width: int,
                max_tokens: int, *, length_penalty: float = 1.0, ignore_eos: bool = False,
                cache_salt: str | None = None) -> list[BeamSearchSequence]:
    """The ``beam_width`` best continuations of ``prompt``, best first (see the module
    docstring). Each step runs one engine request of one token per live beam."""
    SamplingParams(max_tokens=max_tokens, beam_width=beam_width)     # the same checks
    prompt_ids = list(prompt_token_ids(prompt, engine.tokenizer, engine.model.config.vocab_size))
    eos = set() if ignore_eos else set(engine.stop_token_ids)
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * beam_width)
    beams, done = [BeamSearchSequence()], []
    for _ in range(max_tokens):
        ids = [engine.add_request(prompt_ids + b.tokens, step_params, cache_salt=cache_salt)
               for b in beams]
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step())
        candidates = []
        for beam, rid in zip(beams, ids, strict=True):
            if outs[rid].finish_reason != "length" and outs[rid].finish_reason != "stop":
                raise RuntimeError(f"beam request {rid} ended {outs[rid].finish_reason}: "
                                   f"{outs[rid].finish_detail}")
            for token, lp in outs[rid].outputs[0].logprobs[0]:
                candidates.append(BeamSearchSequence(beam.tokens + [token],
                                                     beam.cum_logprob + lp, token in eos))
        done += [c for c in candidates if c.finished]       # complete, whatever its rank
        live = [c for c in candidates if not c.finished]
        # by score, ties by content (never by request ids)
        live.sort(key=lambda c: (-c.score(length_penalty), c.tokens[:-1], c.tokens[-1]))
        beams = live[:beam_width]
        if not beams:
            break
    best = sorted(done + beams, key=lambda b: (-b.score(length_penalty), b.tokens))
    for b in best:
        b.text = engine.tokenizer.decode(b.tokens)
    return best[:beam_width]
