"""All or nothing: the one transaction that owns what ``LLMEngine.step`` changes.

A step changes three kinds of state: the bookkeeping (scheduler queues and counters, requests,
sequences, block tables, pools, prefix cache or radix tree, the runner's counters), the
contents of the KV-cache tensors, and the metrics. One :class:`StepTransaction`, begun at the
top of ``LLMEngine.step`` and committed at its end or rolled back, owns all of it:

* **Bookkeeping: one checkpoint** (:class:`~course_lib.checkpoint.Checkpoint`): the fields of
  every object the step may change, saved when it first touches them and put back on failure,
  whatever fields the classes have (no ``snapshot()`` / ``restore()`` pair per class). What
  a step may change is listed here, once per design (:func:`manager_parts`; V1's block pool
  and the radix tree save each block or node themselves just before they first change it,
  and V0's pools and prefix cache log each ref count, state, cut of the free stack and map
  entry before they change it (:func:`begin_manager` attaches them), so a step pays for what
  it touches, not for the pool, the tree or the cache); the scheduler
  adds the requests it touches (``Scheduler.begin``), and the waiting queue logs its moves
  instead of being copied. The cost: the running requests and the manager's own state, never
  the waiting queue. A KV connector (V1's ``kv_connector``) is listed the same way
  (:func:`begin_connector`: the objects its ``rollback_parts`` names, and the checkpoint for
  the undos it registers itself).
* **Tensors: only the blocks at risk.** Most writes of a step land where nothing lived
  before it: new tokens' slots past a sequence's old end, blocks that were free. Those need no
  undo: after a rollback nothing points at them. A write is at risk only when a block written
  in this step held something at its start: a cached block evicted for the step, or a block
  freed by a preemption and handed out again in the same step. Those blocks
  (:func:`blocks_at_risk`, from what the checkpoint saved; with a KV connector also the GPU
  blocks its loads write) are copied before the cache
  operations run and copied back on failure.
* **Metrics** hold their changes until the commit (``Metrics.begin`` / ``commit`` /
  ``discard``): their collectors are ``prometheus_client`` objects, not plain fields to copy.
  The engine's own maps (its requests, their seeds) and its step counter change only after
  the commit.

A transaction is committed or rolled back exactly once, then closed: a step can never put back
what an earlier step saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..checkpoint import Checkpoint
from ..memory.common import FREE
from ..memory.radix.kv_cache_manager import RadixKVCacheManager
from ..memory.radix.radix_cache import TreeNode
from ..memory.v0.manager import BlockManager
from ..memory.v1.block_pool import KVCacheBlock
from ..memory.v1.kv_cache_manager import KVCacheManager
from ..scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from ..scheduler.metrics import Metrics
    from ..scheduler.scheduler import Scheduler
    from ..scheduler.v1 import SchedulerV1
    from .model_runner import ModelRunner


class StepFailed(RuntimeError):
    """A step failed and no single request's work was found to cause it. The engine is
    exactly as it was before the step: call ``step()`` again (a transient fault) or stop."""


class RollbackFailed(RuntimeError):
    """A failed step could not be put back (a second failure while putting it back, twice,
    or the copy of the blocks at risk into the KV cache failed). Some bookkeeping or cached
    K/V may be wrong: the engine refuses further steps rather than produce wrong tokens.
    Create a new engine."""


# ------------------------------------------------------------ what a step may change, by design
def manager_parts(manager: object) -> tuple[list[object], tuple[type, ...]]:
    """The objects of a KV-cache manager a step may change, by design: (objects saved when
    the step begins, classes whose objects the manager saves itself just before it first
    changes them). A
    field a class gains is saved without a change here; a new *object* a manager comes to own
    must be listed here (``tests/test_checkpoint.py`` checks it)."""
    if isinstance(manager, BlockManager):        # V0 (and its twin, FastBlockManager)
        parts = [manager, manager.gpu, manager.cpu]
        if manager.cache is not None:
            parts.append(manager.cache)
        return parts + [manager.get_table(s) for s in manager.seq_ids()], ()
    if isinstance(manager, KVCacheManager):      # vLLM V1: the pool saves the blocks it changes
        pool = manager.block_pool
        return [manager, pool, pool.free_block_queue], (KVCacheBlock,)
    if isinstance(manager, RadixKVCacheManager):  # SGLang: the tree saves the nodes it changes
        return [manager, manager.pool, manager.tree], (TreeNode,)
    raise TypeError(f"no rollback parts known for a {type(manager).__name__}")


def begin_manager(checkpoint: Checkpoint, manager: object) -> None:
    """Save what a step may change in ``manager`` (:func:`manager_parts`) into ``checkpoint``,
    and hand the checkpoint to the parts that save what they change themselves."""
    objects, _ = manager_parts(manager)
    checkpoint.touch(*objects)
    if isinstance(manager, BlockManager):        # V0: the pools' and the cache's logs
        manager.gpu.attach(checkpoint)
        manager.cpu.attach(checkpoint)
        if manager.cache is not None:
            manager.cache.attach(checkpoint)
    elif isinstance(manager, KVCacheManager):
        manager.block_pool.attach(checkpoint)
    elif isinstance(manager, RadixKVCacheManager):
        manager.tree.checkpoint = checkpoint


def begin_connector(checkpoint: Checkpoint, connector: object | None) -> None:
    """Save what a step may change in a KV connector (``rollback_parts``: the connector and
    the objects it owns) and hand it the checkpoint (``attach``) for the undos it registers
    itself (contents of its own buffers it overwrites). Nothing without a connector."""
    if connector is None:
        return
    checkpoint.touch(*connector.rollback_parts())
    connector.attach(checkpoint)


class BlocksBefore(NamedTuple):
    """What the blocks were when the step began, as :func:`blocks_at_risk` needs it."""
    tables: dict[int, tuple[str, Sequence[int]]]   # seq_id -> (device, block ids), read only
    gpu_mattered: Callable[[int], bool]         # held or cached then: its contents matter
    cpu_mattered: Callable[[int], bool]


def blocks_before(checkpoint: Checkpoint, manager: object) -> BlocksBefore:
    """The block tables and block states at the start of the step, from what ``checkpoint``
    saved (one entry per design, as :func:`manager_parts`). V0's are read in place
    (``Checkpoint.saved_view``): a table's block ids, saved by length, are a view of its own
    list, and a block's state at the start is the one the pool saved before changing it
    (``Checkpoint.item_at_start``), so that this costs O(sequences), not O(their
    blocks) or O(pool), each step."""
    if isinstance(manager, BlockManager):
        view = checkpoint.saved_view
        tables = {s: (view(t, "device"), view(t, "blocks"))
                  for s, t in view(manager, "_tables").items()}
        gpu, cpu = manager.gpu._state, manager.cpu._state    # their changed items saved
        at_start = checkpoint.item_at_start
        return BlocksBefore(tables, lambda b: at_start(gpu, b) != FREE,
                            lambda b: at_start(cpu, b) != FREE)
    if isinstance(manager, KVCacheManager):
        tables = {s: ("gpu", [b.block_id for b in blocks])
                  for s, blocks in checkpoint.saved(manager, "req_to_blocks").items()}
        blocks = manager.block_pool.blocks

        def mattered(b: int) -> bool:
            return checkpoint.at_start(blocks[b], "ref_cnt") > 0 \
                or checkpoint.at_start(blocks[b], "block_hash") is not None
        return BlocksBefore(tables, mattered, lambda b: False)
    if isinstance(manager, RadixKVCacheManager):
        tables = {s: ("gpu", blocks)
                  for s, blocks in checkpoint.saved(manager, "req_to_blocks").items()}
        is_free = checkpoint.saved(manager.pool, "_is_free")
        return BlocksBefore(tables, lambda b: not is_free[b], lambda b: False)
    raise TypeError(f"no rollback parts known for a {type(manager).__name__}")


def blocks_at_risk(out: SchedulerOutput, before: BlocksBefore,
                   block_size: int) -> tuple[list[int], list[int]]:
    """(GPU blocks, CPU blocks) this step writes whose contents mattered when it started:
    destinations of copy-on-write copies, swaps and a KV connector's loads, and blocks the
    forward writes new tokens' K/V into, except those that were free then and, for the
    forward, a sequence's own blocks at the same place in its table (it writes past its old
    end there, where nothing lived; a block read by its position, O(1), not looked up among
    all its blocks: a block the table held elsewhere, after a free and a new allocation in
    the step, is saved)."""
    gpu = {dst for _, dst in out.blocks_to_copy} | {dst for _, dst in out.blocks_to_swap_in}
    if out.kv_connector_metadata is not None:          # a connector's loads write these
        gpu.update(out.kv_connector_metadata.gpu_blocks_written())
    for e in out.scheduled:
        ctx = e.seq.num_computed_tokens              # before update() advances it
        first, last = ctx // block_size, (ctx + e.num_tokens - 1) // block_size
        device, own = before.tables.get(e.seq.seq_id, (None, ()))
        n = len(own) if device == "gpu" else 0
        gpu.update(b for i, b in enumerate(e.block_ids[first:last + 1], first)
                   if i >= n or own[i] != b)
    cpu = {dst for _, dst in out.blocks_to_swap_out}
    return (sorted(b for b in gpu if before.gpu_mattered(b)),
            sorted(b for b in cpu if before.cpu_mattered(b)))


# --------------------------------------------------------------------------- the transaction
class StepTransaction:
    """Everything one step may change: the checkpoint of the scheduler, its requests, the
    KV-cache manager and the runner; the metrics' held changes; the cache blocks at risk
    (``backup``, set by ``LLMEngine._protect`` once the schedule is known). Committed or
    rolled back exactly once, then closed: a later step begins its own, so nothing of an
    earlier step can ever be put back. If beginning fails, nothing was changed and nothing
    stays open."""

    def __init__(self, scheduler: Scheduler | SchedulerV1, runner: ModelRunner,
                 metrics: Metrics) -> None:
        self.scheduler, self.runner, self.metrics = scheduler, runner, metrics
        self.checkpoint = Checkpoint()
        self.backup: CacheBackup | None = None       # the blocks at risk, once known
        self.last_output: SchedulerOutput | None = None
        self.closed = False
        try:
            scheduler.begin(self.checkpoint)
            self.checkpoint.touch(runner)
            begin_manager(self.checkpoint, scheduler.block_manager)
            begin_connector(self.checkpoint, getattr(scheduler, "kv_connector", None))
            metrics.begin()
        except BaseException:
            self.closed = True                       # nothing changed yet: nothing to undo
            raise

    def commit(self) -> None:
        """The step succeeded: apply the metrics' held changes, then close. The metrics are
        the last thing that can fail; after them come only assignments, so a commit either
        fails before changing anything (and the step is rolled back) or completes."""
        if self.closed:
            raise RuntimeError("this step's transaction was already committed or rolled back")
        self.metrics.commit()
        self.closed = self.checkpoint.closed = True      # the point of no return
        self.backup = None

    def rollback(self) -> None:
        """Put everything back as it was when the step began, then close: the bookkeeping
        (it only assigns fields), the metrics' held changes dropped, then the blocks at risk.
        A failure while doing so is tried once more from where it stopped (the checkpoint's
        rollback resumes); if it fails again, or the cache blocks cannot be copied back,
        :class:`RollbackFailed` (the engine takes no more steps)."""
        if self.closed:
            raise RuntimeError("this step's transaction was already committed or rolled back")
        for attempt in (1, 2):
            try:
                self.checkpoint.rollback()
                self.metrics.discard()
                if self.backup is not None:
                    put_back(self.runner.gpu_caches, self.runner.cpu_caches, self.backup)
                break
            except Exception as exc:
                if attempt == 2:
                    self.closed = True
                    raise RollbackFailed(
                        f"putting the engine back after a failed step failed twice "
                        f"({type(exc).__name__}: {exc}); its state or its cached K/V may be "
                        "wrong, so this engine takes no more steps") from exc
        self.closed = True
        self.backup = None


# ------------------------------------------------------------------------- the cache blocks
class CacheBackup(NamedTuple):
    """Copies of some blocks of every layer's K and V caches."""
    gpu_blocks: list[int]
    gpu: list[tuple[torch.Tensor, torch.Tensor]]
    cpu_blocks: list[int]
    cpu: list[tuple[torch.Tensor, torch.Tensor]]


def back_up(gpu_caches, cpu_caches, gpu_blocks: list[int], cpu_blocks: list[int]) -> CacheBackup:
    """Copy ``gpu_blocks`` / ``cpu_blocks`` of each layer's caches (nothing when empty)."""
    def copy(caches, blocks):
        if not blocks:
            return []
        idx = torch.tensor(blocks, dtype=torch.int64, device=caches[0][0].device)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in caches]
    return CacheBackup(gpu_blocks, copy(gpu_caches, gpu_blocks), cpu_blocks,
                       copy(cpu_caches, cpu_blocks))


def put_back(gpu_caches, cpu_caches, backup: CacheBackup) -> None:
    """Write the saved blocks back into the caches."""
    for caches, blocks, saved in ((gpu_caches, backup.gpu_blocks, backup.gpu),
                                  (cpu_caches, backup.cpu_blocks, backup.cpu)):
        if not blocks:
            continue
        idx = torch.tensor(blocks, dtype=torch.int64, device=caches[0][0].device)
        for (k, v), (k_saved, v_saved) in zip(caches, saved, strict=True):
            k.index_copy_(0, idx, k_saved)
            v.index_copy_(0, idx, v_saved)
