"""Plain generation with a contiguous cache: the reference the paged engine is compared with.

The serving engine (chapter 10) generates through the paged cache; these few lines do the same
thing the textbook way, one sequence at a time, growing K/V tensors by concatenation.
"""

from __future__ import annotations

import math

import torch

from course_lib.model.llama import TinyLlama
from course_lib.model.tokenizer import EOS_ID


def sample_next(logits: torch.Tensor, temperature: float = 0.0,
                generator: torch.Generator | None = None, top_k: int | None = None) -> int:
    """One token from ``logits [vocab]``: argmax when ``temperature == 0``, else a sample from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` best tokens if given."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_contiguous(model: TinyLlama, prompt_ids: list[int], max_new_tokens: int,
                        temperature: float = 0.0, seed: int = 0, top_k: int | None = None,
                        stop_at_eos: bool = True) -> list[int]:
    """Prompt ids -> generated ids (prompt excluded), with a contiguous per-sequence cache.

    Stops after ``max_new_tokens``, at EOS (included) if ``stop_at_eos``, or at the model's
    context length.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    budget = min(max_new_tokens, model.config.max_position - len(prompt_ids))
    out: list[int] = []
    logits, past = model.forward_contiguous(torch.tensor([prompt_ids], device=device))
    for _ in range(max(budget, 0)):
        tok = sample_next(logits[0, -1], temperature, gen, top_k)
        out.append(tok)
        if (stop_at_eos and tok == EOS_ID) or len(out) == budget:
            break
        logits, past = model.forward_contiguous(torch.tensor([[tok]], device=device), past)
    return out
