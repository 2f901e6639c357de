"""The scheduler: pure Python, no torch (vLLM V0's design, the paper's and the source articles').

* ``scheduler``         :class:`Scheduler`, whole, in reading order: ``schedule`` (continuous
                        batching, chunked prefill), preemption by recompute or swap,
                        ``update``, the request queues, ``check_invariants``; owns the
                        block manager
* ``policy``            :class:`SchedulingBudget` and the victim policies
* ``admission``         room for a decode, a prompt or a swap-in; why a request can never fit
* ``output``            :class:`SchedulerOutput` / :class:`ScheduledSeq`: one step's decision,
                        plain data for the engine or the simulator
* ``output_processor``  after the model ran: ``apply_step``, the update loop both schedulers
                        run, and ``apply_samples`` (tokens appended, parallel samples forked,
                        beams kept or freed)
* ``metrics``           Prometheus collectors with vLLM's names, fed by the engine and the replay
* ``v1``                :class:`SchedulerV1`: vLLM V1's scheduler (one token budget, no phases,
                        recompute only, ``n`` child sequences) over the V1 ``KVCacheManager``
* ``kv_connector``      :class:`KVConnectorScheduler`: the scheduler side of vLLM V1's KV
                        connector (external hits, per-step transfer metadata, delayed frees)
"""
