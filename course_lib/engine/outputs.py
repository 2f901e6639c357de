"""What the engine returns for a finished request (vLLM's ``vllm/outputs.py``): a
:class:`RequestOutput` holding one :class:`CompletionOutput` per sample or beam, built from
the scheduler's :class:`~course_lib.sequence.Request` by :func:`request_output`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.tokenizer import ByteTokenizer
from ..sequence import Request


@dataclass
class CompletionOutput:
    """One generated sequence: sample ``index`` (parallel sampling) or the ``index``-th best
    beam (beam search)."""

    index: int
    token_ids: list[int]
    text: str
    cumulative_logprob: float
    finish_reason: str | None  # "stop" (EOS or a stop token), "length", "abort", "ignored"
    logprobs: list[list[tuple[int, float]]] | None = None   # per token: the top-k, best first


@dataclass
class RequestOutput:
    """A finished request: its prompt, its outputs and its timings (seconds)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int    # prompt tokens found in the prefix cache
    num_preemptions: int
    ttft: float | None        # arrival -> first token
    latency: float | None     # arrival -> finished
    finish_reason: str | None = None   # the request's code (see CompletionOutput)
    finish_detail: str | None = None   # why it was aborted or ignored, in a sentence
    # the KV connector's parameters for whoever continues the request (vLLM's
    # RequestOutput.kv_transfer_params: a prefill engine's remote_block_ids, ...); or None
    kv_transfer_params: dict | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""


def request_output(req: Request, tokenizer: ByteTokenizer) -> RequestOutput:
    """``req`` as the engine returns it: its sequences in order (samples by index, beams best
    first), decoded by ``tokenizer``, with their logprobs if the request asked for them, and
    its timings measured from its arrival."""
    seqs = req.ordered_seqs()
    outs = [CompletionOutput(i if req.sampling_params.use_beam_search else s.index,
                             list(s.output_token_ids),
                             tokenizer.decode(s.output_token_ids),
                             s.cumulative_logprob, s.status.finish_reason,
                             [list(t) for t in s.output_logprobs]
                             if req.sampling_params.logprobs is not None else None)
            for i, s in enumerate(seqs)]
    ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
    latency = None if req.finished_time is None else req.finished_time - req.arrival_time
    return RequestOutput(req.request_id, list(req.prompt_token_ids), outs,
                         req.num_cached_tokens, req.num_preemptions, ttft, latency,
                         req.finish_reason, req.finish_detail, req.kv_transfer_output)
