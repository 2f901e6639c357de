"""The serving engine on the tiny real model (torch).

* ``llm_engine``    :class:`LLMEngine`: schedule -> cache ops -> forward -> sample -> update
* ``inputs``        the checks on prompts, sampling parameters and request ids
* ``outputs``       :class:`RequestOutput` / :class:`CompletionOutput` (vLLM's ``outputs.py``)
* ``logprobs``      the top log-probabilities attached to outputs
* ``recovery``      after a failed step: roll back, find the request to blame, fail it alone
* ``model_runner``  the KV-cache tensors, the block copies a step asks for, one forward pass
* ``sampler``       greedy, temperature + top-p with seeded generators, beam candidates
* ``workloads``     traces scaled to the model, trace runs, the static baseline, sharing savings
"""

from .llm_engine import CompletionOutput, LLMEngine, RequestOutput

__all__ = ["CompletionOutput", "LLMEngine", "RequestOutput"]
