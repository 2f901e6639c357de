"""vLLM's decode context parallelism (DCP) for an MLA model, beside the article's CP.

vLLM 0.33.0 (``vllm/config/parallel.py``) shards the decode KV cache by tokens over the ranks of
the tensor-parallel group (``tensor_parallel_size % decode_context_parallel_size == 0`` without
prefill context parallelism), where the article's CP adds GPUs. For MLA this removes the
duplication TP leaves: the latent has no heads to split, so without DCP every TP rank stores all
of it. Sizing reuses :func:`course_lib.parallel.deployment.plan` with CP = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib import capacity as cap
from course_lib.parallel.deployment import DeploymentPlan, context_note, gib, plan
from course_lib.sizing.models import ModelSpec
from course_lib.sizing.units import check_int, format_bytes


@dataclass(frozen=True)
class DCPPlan:
    """vLLM's decode context parallelism (DCP) inside the TP group, for an MLA model.

    Without DCP every TP rank stores the whole latent of every token (TP splits heads; the
    latent has none). With DCP the ``decode_context_parallel_size`` ranks of a DCP group each
    store every DCP-th token, so a rank's pool (``tp_plan``: the same GPUs, CP=1) serves DCP
    times more tokens. No GPU is added: vLLM 0.33.0 requires ``tp % dcp == 0`` without PCP."""

    tp_plan: DeploymentPlan
    decode_context_parallel_size: int

    @property
    def latent_bytes_per_token_per_rank(self) -> float:
        """All layers: each rank stores 1/DCP of the tokens (an average over a request)."""
        spec, tp = self.tp_plan.model, self.tp_plan.tensor_parallel_size
        return cap.kv_bytes_per_token(spec, tp) / self.decode_context_parallel_size

    @property
    def tokens_per_rank(self) -> int:
        """Token slots in one rank's pool."""
        return self.tp_plan.tokens_per_gpu

    @property
    def max_request_tokens(self) -> int:
        """Longest single request: its tokens spread over the DCP group's pools."""
        return self.tokens_per_rank * self.decode_context_parallel_size

    @property
    def total_tokens(self) -> int:
        """Tokens the whole deployment caches: one DCP group's worth per TP group."""
        p = self.tp_plan
        return self.max_request_tokens * (p.num_gpus // p.tensor_parallel_size)

    def summary(self) -> str:
        p, dcp = self.tp_plan, self.decode_context_parallel_size
        full = cap.kv_bytes_per_token(p.model, p.tensor_parallel_size)
        return "\n".join([
            f"{p.model.name} ({p.model.attention_type}) on {p.num_gpus} x "
            f"{gib(p.gpu_memory_gib)} GiB, TP={p.tensor_parallel_size}, DCP={dcp} (vLLM's "
            f"decode context parallelism: the TP ranks split the tokens, no extra GPU), "
            f"gpu_memory_utilization={p.gpu_memory_utilization}",
            f"per GPU: weights {format_bytes(p.weight_bytes_per_gpu)}, KV budget "
            f"{format_bytes(p.available_kv_bytes)}, block {format_bytes(p.block_bytes)}"
            f" -> {p.num_gpu_blocks:,} blocks = {self.tokens_per_rank:,} token slots",
            f"latent per token, all layers: {full:,} B on every rank without DCP, "
            f"{self.latent_bytes_per_token_per_rank:,.0f} B per rank with DCP={dcp}",
            f"longest single request: {self.tokens_per_rank:,} x {dcp} = "
            f"{self.max_request_tokens:,} tokens; all GPUs: {self.total_tokens:,} tokens",
            *filter(None, [dcp > 1 and context_note(p.model, self.max_request_tokens)]),
        ])


def dcp_plan(spec: ModelSpec, gpu_memory_gib: float, tensor_parallel_size: int,
             decode_context_parallel_size: int, **kwargs: object) -> DCPPlan:
    """Size TP=``tensor_parallel_size`` with DCP=``decode_context_parallel_size`` (vLLM
    0.33.0, PCP=1), for an MLA model; ``kwargs`` go to :func:`plan` (CP stays 1).

    ValueError, as vLLM's ``ParallelConfig`` raises it, when DCP does not divide TP (so
    "TP=1, CP=4" has no DCP spelling), and for a non-MLA model (not modelled here)."""
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    check_int("decode_context_parallel_size", dcp, 1)
    if not spec.is_mla:
        raise ValueError(f"dcp_plan sizes MLA models (every TP rank holds the whole latent); "
                         f"{spec.name} is {spec.attention_type}")
    if tp % dcp:
        raise ValueError(f"tp_size={tp} must be divisible by dcp_size={dcp} (vLLM 0.33.0, "
                         "vllm/config/parallel.py: without PCP, DCP reuses the TP ranks)")
    return DCPPlan(plan(spec, gpu_memory_gib, tp, 1, **kwargs), dcp)
