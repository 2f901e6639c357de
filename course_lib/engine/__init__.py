"""The serving engine on the tiny real model (torch).

* ``llm_engine``    :class:`LLMEngine`, whole: schedule -> cache ops -> forward -> sample ->
                    update; after a failed step it finds the request to blame, fails it alone
                    and recovers the others by recompute
* ``inputs``        the checks on prompts, sampling parameters and request ids
* ``outputs``       :class:`RequestOutput` / :class:`CompletionOutput` (vLLM's ``outputs.py``)
* ``logprobs``      the top log-probabilities attached to outputs
* ``recovery``      a failed step recovered by recompute (chapter 07's mechanism): what a
                    step commits, every request put back to it, the KV bookkeeping rebuilt empty
* ``model_runner``  the KV-cache tensors (sized by the ``CacheConfig``), the block copies a step
                    asks for, one forward pass
* ``sampler``       greedy, temperature + top-p with seeded generators, beam candidates
* ``workloads``     traces scaled to the model, trace runs, the static baseline, sharing savings
* ``beam_search``   beam search as a loop over the engine, outside its core (what vLLM V1 does)
* ``kv_connector``  vLLM V1's KV-connector interface (``KVConnectorBase_V1``): scheduler side
                    (``scheduler/kv_connector.py``) and worker side, one object for both
* ``cpu_offload``   a CPU offload tier behind it (``kv_offloading_size``), keyed by V1's hashes
* ``p2p_connector`` prefill/decode disaggregation's connector: NIXL's protocol (what is asked,
                    held, released, when a transfer is done or failed)
* ``p2p_transport`` the messages under it: peer threads, tags, ``torch.distributed`` groups
* ``kv_connector_trace``  the CPU tier recording every interface call, and the calls printed
                    step by step, scheduler side beside worker side (chapter 13)
* ``offload_study`` the CPU tier measured: a multi-turn chat and a RAG-like trace through no
                    offload, the tier and V0's swap, swept over GPU pool x tier sizes, and
                    prompts run one at a time (``bench/offload.py``, chapter 13)
"""
