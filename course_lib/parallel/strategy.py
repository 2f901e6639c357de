"""Which parallelism for long contexts: the "Block Manager tutorial"'s §7 table, in numbers.

This module holds :data:`STRATEGIES` -- DP, DP attention and context parallelism side by side
(what each splits, what a rank's KV cache holds, the single-request limit, throughput,
communication per layer) -- and their comparison in numbers. Beside it, one module a job:

* ``parallel/deployment.py``: ``plan`` -- one deployment (model, GPU memory, TP, CP) in
  numbers: blocks and tokens per GPU, tokens in the whole deployment, the longest single
  request, decode traffic per step (``DeploymentPlan``, ``article_case``, the stated
  simplification of weights per GPU). All arithmetic is :mod:`course_lib.capacity`'s.
* ``parallel/decision_tree.py``: ``DECISION_TREE`` and ``recommend`` -- the article's §10 tree
  as data, walked for a model and a target context length (flagged when the request is longer
  than the model's context).
* ``parallel/dcp.py``: ``dcp_plan`` -- what vLLM 0.33.0 offers instead for MLA: decode context
  parallelism (DCP) inside the TP group, which splits the latent cache by tokens over ranks
  that already exist.

"CP" here is the article's: extra GPUs, each caching a slice of every long request's tokens.
vLLM 0.33.0 (``vllm/config/parallel.py``) splits that idea in two: DCP shards the decode KV
cache over the TP ranks (``tensor_parallel_size % decode_context_parallel_size == 0`` without
PCP) and prefill context parallelism (PCP) adds ranks but alone does not shard the decode cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.parallel.deployment import DeploymentPlan, plan
from course_lib.sizing.models import ModelSpec


@dataclass(frozen=True)
class Strategy:
    """One column of "Block Manager tutorial" §7's table, in our words."""

    name: str
    splits: str
    kv_per_rank: str
    single_request_limit: str
    throughput: str
    comm_per_layer: str


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("DP", "requests: whole model replicas", "each replica caches its own requests",
             "unchanged", "x replicas", "none"),
    Strategy("DP attention", "attention by request (MoE layers by expert)",
             "each rank caches the requests it serves", "unchanged", "x ranks",
             "2 all-to-all (MoE dispatch + combine)"),
    Strategy("CP", "one request's tokens", "each rank caches a slice of every long request",
             "x CP size", "not directly", "2 collectives in attention (Q out, partials back)"),
)


def compare_strategies(spec: ModelSpec, gpu_memory_gib: float, num_gpus: int,
                       tensor_parallel_size: int = 1, context_parallel_size: int = 2,
                       **kwargs: object) -> dict[str, DeploymentPlan]:
    """The "Block Manager tutorial" §7 in numbers: the same ``num_gpus`` GPUs used as DP groups
    (TP inside each) or with context parallelism. (For the memory, DP attention sizes like DP:
    each rank caches its own requests; it differs in how MoE layers communicate.)"""
    dp = plan(spec, gpu_memory_gib, tensor_parallel_size, 1, num_gpus=num_gpus, **kwargs)
    cp = plan(spec, gpu_memory_gib, tensor_parallel_size, context_parallel_size,
              num_gpus=num_gpus, **kwargs)
    return {"DP": dp, "DP attention": dp, "CP": cp}
