"""The scheduler: pure Python, no torch (vLLM V0's design, the paper's and the source articles').

* ``scheduler``         :class:`Scheduler`: continuous batching, chunked prefill, preemption by
                        recompute or swap; owns the :class:`~course_lib.memory.BlockManager`
* ``queues``            its request queues (add, abort, finish) and ``check_invariants``
* ``update``            the second half of a step: sampled tokens applied, finished freed
* ``snapshot``          snapshot / restore, for the engine's all-or-nothing step
* ``policy``            :class:`SchedulingBudget` and the victim policies
* ``admission``         room for a decode, a prompt or a swap-in; why a request can never fit
* ``output``            :class:`SchedulerOutput` / :class:`ScheduledSeq`: one step's decision,
                        plain data for the engine or the simulator
* ``output_processor``  sampled tokens appended, parallel samples forked, beams kept or freed
* ``metrics``           Prometheus collectors with vLLM's names, fed by the engine and the replay
* ``v1``                :class:`SchedulerV1`: vLLM V1's scheduler (one token budget, no phases,
                        recompute only, ``n`` child sequences) over the V1 ``KVCacheManager``
"""

from .output import ScheduledSeq, SchedulerOutput
from .policy import (
    VICTIM_POLICIES,
    SchedulingBudget,
    VictimPolicy,
    last_arrived_first,
    longest_first,
)
from .scheduler import Scheduler
from .v1 import SchedulerV1

__all__ = ["Scheduler", "SchedulerV1", "ScheduledSeq", "SchedulerOutput", "SchedulingBudget",
           "VictimPolicy", "VICTIM_POLICIES", "last_arrived_first", "longest_first"]
