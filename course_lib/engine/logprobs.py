"""The top-k logprobs a request asks for with ``SamplingParams(logprobs=k)`` (vLLM's name):
computed from a step's logits at each sampled position, then attached to the sequences that
got a token in that step.
"""

from __future__ import annotations

from ..scheduler.output import SchedulerOutput


def top_logprobs(out: SchedulerOutput, logits) -> dict[int, list[tuple[int, float]]]:
    """The top-k (token, logprob) at each sampled position of a request that asked for
    ``logprobs=k``, best first (log_softmax of the model's logits), by ``seq_id``."""
    import torch

    tops = {}
    for e in out.scheduled:
        k = e.request.sampling_params.logprobs
        if e.num_candidates and k:
            lp = torch.log_softmax(logits[e.seq.seq_id].float(), dim=-1)
            top = torch.topk(lp, min(k, lp.numel()))
            tops[e.seq.seq_id] = [(int(t), float(v)) for v, t in
                                  zip(top.values, top.indices, strict=True)]
    return tops


def attach_logprobs(out: SchedulerOutput, tops: dict[int, list]) -> None:
    """Give each sequence that got a token its position's top-k; samples forked from a
    prompt in this step share the prompt's (one position, one distribution)."""
    for e in out.scheduled:
        if e.seq.seq_id not in tops:
            continue
        for seq in e.request.seqs:
            if len(seq.output_logprobs) < len(seq.output_token_ids):
                seq.output_logprobs.append(tops.get(seq.seq_id, tops[e.seq.seq_id]))
