"""The scheduler side of a KV connector: the part of vLLM V1's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, role ``SCHEDULER``) that
:class:`~course_lib.scheduler.v1.SchedulerV1` calls, and the per-step metadata it hands on.

Why it lives here, apart from the worker side (``course_lib/engine/kv_connector.py``, where
the whole interface and its story are): the scheduler layer imports nothing above it and no
torch (``tests/test_layers.py``), as vLLM's scheduler process holds no tensors; the worker side
touches the KV-cache tensors. A connector is one class deriving from
:class:`~course_lib.engine.kv_connector.KVConnectorBase_V1`, which extends this one.

The calls, in the order one ``schedule()`` makes them:

1. :meth:`KVConnectorScheduler.get_num_new_matched_tokens`, once a waiting sequence's local
   prefix hit is known;
2. :meth:`KVConnectorScheduler.update_state_after_alloc`, once its blocks are allocated;
3. :meth:`KVConnectorScheduler.build_connector_meta`, at the end: the step's transfers, as
   plain data (:class:`~course_lib.scheduler.output.KVConnectorMetadata`), carried by
   ``SchedulerOutput``;
4. :meth:`KVConnectorScheduler.request_finished`, when a sequence finishes, before its
   blocks are freed.

All or nothing: the engine's step saves the objects :meth:`KVConnectorScheduler.rollback_parts`
names when it begins, and hands the connector its checkpoint (:meth:`attach`) for the undos
it registers itself (``course_lib/engine/rollback.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any

from ..checkpoint import Checkpoint

if TYPE_CHECKING:
    from ..memory.v1.kv_cache_manager import KVCacheManager
    from ..sequence import Sequence
    from .output import KVConnectorMetadata, SchedulerOutput


class KVConnectorScheduler(ABC):
    """The scheduler side of vLLM's ``KVConnectorBase_V1`` (module docstring). A V1 request is
    one :class:`~course_lib.sequence.Sequence` here, named by its ``seq_id``."""

    #: fields a step's checkpoint does not copy: what is bound once, and the checkpoint itself
    __rollback_skip__ = ("kv_cache_manager", "checkpoint")

    def __init__(self) -> None:
        self.kv_cache_manager: KVCacheManager | None = None
        self.checkpoint: Checkpoint | None = None

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """The scheduler's manager (vLLM's ``bind_kv_cache_manager``): the scheduler side reads
        its block hashes. Called once, by ``SchedulerV1``."""
        self.kv_cache_manager = kv_cache_manager

    # --------------------------------------------------------------- the transaction
    def rollback_parts(self) -> list[object]:
        """The objects a step may change, saved by the step's checkpoint when it begins; the
        connector itself by default. A connector owning more objects (a pool) lists them:
        ``tests/test_checkpoint.py`` walks what it owns."""
        return [self]

    def attach(self, checkpoint: Checkpoint) -> None:
        """The running step's checkpoint, for undos the connector registers itself
        (``Checkpoint.on_rollback``), such as contents of its own buffers it overwrites."""
        self.checkpoint = checkpoint

    def _in_step(self) -> bool:
        return self.checkpoint is not None and not self.checkpoint.closed

    # ------------------------------------------------------------------- the calls
    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens of ``seq`` past its ``num_computed_tokens`` local hit that the connector can
        supply, and whether they load asynchronously (between steps; ``False`` when 0). At
        most ``len(seq) - 1`` tokens in all (the last one is computed, for the logits); full
        blocks only. ``None``: not known yet, ask again next step."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: SequenceABC[int],
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for ``seq`` (``block_ids``: its whole table); the
        ``num_external_tokens`` after its local hit are the connector's to load (0: none)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's transfers, as plain data for the worker side; resets the connector's
        per-step state. Must not change ``scheduler_output``."""

    def request_finished(self, seq: Sequence, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``seq`` finished, its blocks not yet freed. ``(True, ...)``: a transfer still reads
        them; the scheduler keeps them until the worker side's ``get_finished`` names ``seq``
        as done sending. The dict: transfer parameters for the request's output (unused)."""
        return False, None
