"""The "Block Manager tutorial"'s §10 decision tree for long contexts, as data and walked.

:data:`DECISION_TREE` holds its questions, :data:`ADVICE` its answers, and :func:`recommend`
walks it for a model and a target context length, returning a :class:`Recommendation`: the
questions asked, the advice, and the smallest :func:`~course_lib.parallel.deployment.plan`
that holds the request (flagged when the request is longer than the model's context).
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.parallel.deployment import DeploymentPlan, plan
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import check_int, check_nonneg


@dataclass(frozen=True)
class Node:
    """A question of the decision tree; ``yes`` / ``no`` name the next node or are advice."""

    question: str
    yes: str
    no: str


DECISION_TREE: dict[str, Node] = {
    "start": Node("Is the model MLA (one latent per token, no KV heads)?", "mla", "gqa"),
    "mla": Node("Does one GPU's pool hold the request (CP=1)?", "util",
                "mla+cp"),
    "gqa": Node("Does the request fit once TP splits the KV heads (TP <= num_kv_heads)?",
                "util", "gqa+cp"),
}
ADVICE: dict[str, str] = {
    "mla+cp": "DP attention (TP cannot shrink a latent) + the article's context parallelism "
              "(extra GPUs): CP = the smallest power of two whose pool holds the request",
    "gqa+cp": "TP up to num_kv_heads, then add context parallelism for the rest",
    "util": "fits; if it is tight, raise gpu_memory_utilization (0.9 -> 0.95)",
}


@dataclass(frozen=True)
class Recommendation:
    """The tree's answer for one request. A request longer than the model's context is
    flagged, not refused: the plan still answers the memory question (the article's), but
    vLLM would not serve that request (``beyond_model_context``)."""

    path: tuple[str, ...]             # the questions asked and the answers, in order
    advice: str
    plan: DeploymentPlan | None       # None: nothing up to max_gpus holds the request
    context_len: int = 0
    model_context: int = 0            # the model's max_position_embeddings (0: unknown)

    @property
    def beyond_model_context(self) -> bool:
        return 0 < self.model_context < self.context_len

    def __str__(self) -> str:
        head = "\n".join(f"  {p}" for p in self.path)
        tail = ("recommended plan: " + self.plan.summary() if self.plan
                else "no configuration fits; add GPUs")
        flag = ""
        if self.beyond_model_context:
            flag = (f"\n! the request ({self.context_len:,} tokens) is longer than the model's "
                    f"context ({self.model_context:,}, max_position_embeddings): vLLM refuses "
                    "it; this plan answers the memory question only")
        return f"{head}\n=> {self.advice}{flag}\n{tail}"


def _first_fit(spec: ModelSpec, context_len: int, gpu_memory_gib: float,
               sizes: list[tuple[int, int, int]]) -> DeploymentPlan | None:
    """The first (tp, cp, num_gpus) of ``sizes``, at utilization 0.9 then 0.95, that holds
    the request (weights that do not fit skip a size)."""
    for util in (0.9, 0.95):
        for tp, cp, gpus in sizes:
            try:
                p = plan(spec, gpu_memory_gib, tp, cp, gpu_memory_utilization=util,
                         num_gpus=gpus)
            except ValueError:
                continue
            if p.max_request_tokens >= context_len:
                return p
    return None


def recommend(spec: ModelSpec, context_len: int, gpu_memory_gib: float,
              max_gpus: int = 8) -> Recommendation:
    """Walk :data:`DECISION_TREE` for one request of ``context_len`` tokens on up to
    ``max_gpus`` (a power of two) GPUs of ``gpu_memory_gib``: the smallest setup that holds it.

    MLA: the deployment takes all ``max_gpus`` (experts spread over them), attention runs as
    DP attention (TP=1) and CP grows 1, 2, 4, ... GQA: TP grows 1, 2, ... up to num_kv_heads
    (the KV heads split), then CP is added. Each size is tried at utilization 0.9, then 0.95.
    """
    check_int("context_len", context_len, 1)
    check_int("max_gpus", max_gpus, 1)
    # every plan below is caught as "does not fit": a bad size must fail here, not read "no"
    check_nonneg("gpu_memory_gib", gpu_memory_gib)
    if max_gpus & (max_gpus - 1):
        raise ValueError(f"max_gpus must be a power of two, got {max_gpus}")
    pow2 = [2 ** i for i in range(max_gpus.bit_length())]
    ctx = {"context_len": context_len, "model_context": spec.max_position_embeddings}
    path = [f"{DECISION_TREE['start'].question} {'yes' if spec.is_mla else 'no'}"]
    if spec.is_mla:
        one = _first_fit(spec, context_len, gpu_memory_gib, [(1, 1, max_gpus)])
        path.append(f"{DECISION_TREE['mla'].question} {'yes' if one else 'no'}")
        if one is not None:
            return Recommendation(tuple(path), ADVICE["util"], one, **ctx)
        best = _first_fit(spec, context_len, gpu_memory_gib, [(1, c, max_gpus) for c in pow2])
        return Recommendation(tuple(path), ADVICE["mla+cp"], best, **ctx)
    tps = [t for t in pow2 if t <= spec.num_kv_heads and spec.num_attention_heads % t == 0]
    tp_only = _first_fit(spec, context_len, gpu_memory_gib, [(t, 1, t) for t in tps])
    path.append(f"{DECISION_TREE['gqa'].question} {'yes' if tp_only else 'no'}")
    if tp_only is not None:
        return Recommendation(tuple(path), ADVICE["util"], tp_only, **ctx)
    sizes = [(t, c, t * c) for c in pow2[1:] for t in reversed(tps) if t * c <= max_gpus]
    best = _first_fit(spec, context_len, gpu_memory_gib, sizes)
    return Recommendation(tuple(path), ADVICE["gqa+cp"], best, **ctx)
