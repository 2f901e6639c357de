"""One long-context deployment in numbers: the sizing behind chapter 09's strategy comparison.

:func:`plan` sizes one deployment (model, GPU memory, TP, CP) as a :class:`DeploymentPlan`:
blocks and tokens per GPU, tokens in the whole deployment, the longest single request, decode
traffic per step, and a summary that prints them. :func:`article_case` is the "Block Manager
tutorial" §9's deployment. All arithmetic is :mod:`course_lib.capacity`'s; this module only
composes it. :mod:`course_lib.parallel.strategy` compares strategies with it.

Simplification, stated: a deployment is ``num_gpus = DP x TP x CP`` GPUs (DP: independent
groups serving different requests). Weights per GPU are the weights / TP for a dense model
(every TP group keeps a full copy) and / num_gpus for an MLA (DeepSeek MoE) model, whose
experts expert parallelism spreads over every GPU; pass ``weight_gib`` to override.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib import capacity as cap
from course_lib.sizing import blocks
from course_lib.sizing.blocks import tokens_that_fit
from course_lib.sizing.models import ModelSpec, get_preset
from course_lib.sizing.units import GiB, check_int, check_nonneg, format_bytes


@dataclass(frozen=True)
class DeploymentPlan:
    """One deployment in numbers (per GPU unless named otherwise)."""

    model: ModelSpec
    gpu_memory_gib: float
    tensor_parallel_size: int
    context_parallel_size: int
    gpu_memory_utilization: float
    block_size: int
    num_gpus: int
    weight_bytes_per_gpu: int
    available_kv_bytes: int
    block_bytes: int
    num_gpu_blocks: int
    comm: cap.DecodeCommBytes          # one layer, at the longest single request
    overhead_bytes: int = 0
    blocks_source: str | None = None   # where a given num_gpu_blocks came from; None: memory

    @property
    def blocks_given(self) -> bool:
        return self.blocks_source is not None

    @property
    def data_parallel_size(self) -> int:
        return self.num_gpus // (self.tensor_parallel_size * self.context_parallel_size)

    @property
    def total_tokens(self) -> int:
        """Tokens the whole deployment caches (TP ranks of a group hold the same tokens)."""
        return self.tokens_per_gpu * (self.num_gpus // self.tensor_parallel_size)

    @property
    def tokens_per_gpu(self) -> int:
        return tokens_that_fit(self.num_gpu_blocks, self.block_size)

    @property
    def max_request_tokens(self) -> int:
        """Longest single request: each CP rank holds a slice (TP ranks hold the same tokens)."""
        return cap.context_parallel_capacity(self.num_gpu_blocks, self.block_size,
                                             self.context_parallel_size)

    @property
    def query_bytes_per_step(self) -> int:
        """Move Q, all layers: the query out to the CP ranks and partial results back."""
        if self.context_parallel_size == 1:
            return 0
        return self.model.num_layers * (self.comm.query_bytes + self.comm.partial_output_bytes)

    @property
    def move_kv_bytes_per_step(self) -> int:
        """The alternative, all layers: ship the remote tokens' KV to the query's rank."""
        return self.model.num_layers * self.comm.move_kv_bytes

    @property
    def memory_budget_bytes(self) -> int:
        """What memory leaves for the KV cache: total x utilization - weights - overhead
        (negative when the weights do not fit; :func:`plan` refuses that unless the pool size
        was given)."""
        usable = round(self.gpu_memory_gib * GiB * self.gpu_memory_utilization)
        return usable - self.weight_bytes_per_gpu - self.overhead_bytes

    @property
    def memory_error(self) -> str | None:
        """capacity.available_kv_bytes's refusal (chapter 08's plan_kv_cache runs the same
        check) when the weights do not fit, else None."""
        try:
            cap.available_kv_bytes(round(self.gpu_memory_gib * GiB), self.gpu_memory_utilization,
                                   self.weight_bytes_per_gpu, overhead_bytes=self.overhead_bytes)
        except ValueError as exc:
            return str(exc)
        return None

    def summary(self) -> str:
        m = self.model
        cp = self.context_parallel_size
        cp_label = (f" (the article's CP: extra GPUs, each caching 1/{cp} of a request's tokens)"
                    if cp > 1 else "")
        if self.blocks_given:
            pool = (f"KV pool {format_bytes(self.available_kv_bytes)} = "
                    f"{self.num_gpu_blocks:,} blocks x {format_bytes(self.block_bytes)} "
                    f"({self.blocks_source}, not derived from memory) ->")
        else:
            pool = (f"KV budget {format_bytes(self.available_kv_bytes)}, block "
                    f"{format_bytes(self.block_bytes)} -> {self.num_gpu_blocks:,} blocks =")
        lines = [
            f"{m.name} ({m.attention_type}) on {self.num_gpus} x {gib(self.gpu_memory_gib)} GiB, "
            f"DP={self.data_parallel_size}, TP={self.tensor_parallel_size}, CP={cp}{cp_label}, "
            f"gpu_memory_utilization={self.gpu_memory_utilization}",
            f"per GPU: weights {format_bytes(self.weight_bytes_per_gpu)}, {pool} "
            f"{self.tokens_per_gpu:,} tokens; all GPUs: {self.total_tokens:,} tokens",
        ]
        if self.blocks_given and self.memory_error:
            usable = round(self.gpu_memory_gib * GiB * self.gpu_memory_utilization)
            lines.append(
                f"memory check: {gib(self.gpu_memory_gib)} GiB x {self.gpu_memory_utilization} = "
                f"{format_bytes(usable)} - weights "
                f"{format_bytes(self.weight_bytes_per_gpu)} = "
                f"{format_bytes(self.memory_budget_bytes)}: the weights do not fit, and "
                "capacity.available_kv_bytes (chapter 08's plan_kv_cache) refuses this setup")
        lines.append(f"longest single request: {self.tokens_per_gpu:,} x {cp} "
                     f"= {self.max_request_tokens:,} tokens")
        if cp > 1 and (note := context_note(m, self.max_request_tokens)):
            lines.append(note)
        if self.context_parallel_size > 1:
            lines.append(f"decode step, all {m.num_layers} layers: move Q "
                         f"{format_bytes(self.query_bytes_per_step)} vs move KV "
                         f"{format_bytes(self.move_kv_bytes_per_step)}")
        return "\n".join(lines)


def context_note(spec: ModelSpec, split_tokens: int) -> str:
    """A line when context parallelism lets one request hold more than the context ``spec``
    was built for (its max_position_embeddings: vLLM 0.33.0's default max_model_len, and a
    longer one is refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, ``vllm/config/model.py``)."""
    limit = spec.max_position_embeddings
    if not limit or split_tokens <= limit:
        return ""
    return (f"! one request may use only {limit:,} of them: {spec.name}'s context "
            "(max_position_embeddings); vLLM serves no longer request")


def gib(value: float) -> str:
    """A GPU memory size as the course prints it: 80, 140.4."""
    return f"{round(value, 1):g}"


def weight_bytes_per_gpu(spec: ModelSpec, tp: int, num_gpus: int) -> int:
    """The module's stated simplification (see the docstring)."""
    return round(spec.weight_bytes / (num_gpus if spec.is_mla else tp))


def plan(spec: ModelSpec, gpu_memory_gib: float, tensor_parallel_size: int = 1,
         context_parallel_size: int = 1, *, gpu_memory_utilization: float = 0.9,
         block_size: int = 16, num_gpus: int | None = None, weight_gib: float | None = None,
         overhead_gib: float = 0.0, num_gpu_blocks: int | None = None,
         blocks_source: str = "given") -> DeploymentPlan:
    """Size one deployment of ``num_gpus`` (default TP x CP; a multiple of it) GPUs.

    ``num_gpu_blocks`` skips the memory arithmetic and takes the pool size as measured
    (vLLM's metric), as the "Block Manager tutorial" §9 does; ``blocks_source`` says where it
    came from (the summary prints it, and checks the memory anyway). ValueError (from capacity)
    when the weights do not fit or a size is invalid."""
    tp, cp = tensor_parallel_size, context_parallel_size
    check_nonneg("gpu_memory_gib", gpu_memory_gib)
    check_nonneg("overhead_gib", overhead_gib)
    if weight_gib is not None:
        check_nonneg("weight_gib", weight_gib)
    check_int("context_parallel_size", cp, 1)
    blk = cap.block_bytes(spec, block_size, tp)              # validates block_size and TP
    num_gpus = tp * cp if num_gpus is None else num_gpus
    check_int("num_gpus", num_gpus, 1)
    if num_gpus % (tp * cp):
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of TP x CP = {tp * cp}")
    weights = (weight_bytes_per_gpu(spec, tp, num_gpus) if weight_gib is None
               else round(weight_gib * GiB))
    if num_gpu_blocks is None:
        blocks_source = None
        avail = cap.available_kv_bytes(round(gpu_memory_gib * GiB), gpu_memory_utilization,
                                       weights, overhead_bytes=round(overhead_gib * GiB))
        num_gpu_blocks = blocks.num_gpu_blocks(avail, blk)    # the argument shadows it
    else:
        check_int("num_gpu_blocks", num_gpu_blocks, 0)
        avail = num_gpu_blocks * blk
    longest = cap.context_parallel_capacity(num_gpu_blocks, block_size, cp)
    return DeploymentPlan(spec, gpu_memory_gib, tp, cp, gpu_memory_utilization, block_size,
                          num_gpus, weights, avail, blk, num_gpu_blocks,
                          cap.decode_comm_bytes(spec, longest, cp), round(overhead_gib * GiB),
                          blocks_source)


def article_case() -> DeploymentPlan:
    """The "Block Manager tutorial" §9: DeepSeek-V3 on 8 x H100 80G, TP=2, CP=4, vLLM
    reporting 3,258 blocks. The pool is the article's block count: memory arithmetic refuses
    this setup (``memory_error``), since the FP8 weights alone exceed 80 GiB x 0.9."""
    return plan(get_preset("deepseek-v3"), 80, 2, 4, num_gpu_blocks=3258,
                blocks_source="the article's count")
