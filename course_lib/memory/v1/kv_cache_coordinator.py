"""Several KV-cache groups over one pool: vLLM 0.33.0's ``KVCacheCoordinator``
(``vllm/v1/core/kv_cache_coordinator.py``), at the course's size.

A hybrid model's layers come in groups (``kv_cache_groups.py``), each with its own block table
kept by a :class:`~course_lib.memory.v1.single_type_kv_cache_manager.SingleTypeKVCacheManager`
over the one :class:`~course_lib.memory.v1.block_pool.BlockPool` they share. The coordinator
speaks to all of them at once, one list per group wherever vLLM's ``KVCacheBlocks.blocks``
is a tuple of lists:

* **Allocation** goes through every group: blocks needed are summed over the groups
  (``get_num_blocks_to_allocate``: one free-count check for the whole model), a hit's blocks
  are touched in every group before any group takes a new block
  (``allocate_new_computed_blocks``: a group's new block must not evict another group's hit,
  vLLM issue #33775), then each group extends its table (``allocate_new_blocks``) and caches
  its full blocks (``cache_blocks``). ``remove_skipped_blocks`` and ``free`` go to each group.
* **The prefix-cache hit** is where the groups meet: every group must hold the hit's
  tokens, each in its own way. :class:`UnitaryKVCacheCoordinator` (one group) asks its
  manager. :class:`HybridKVCacheCoordinator` finds the longest length every group accepts
  by a fixed point: start from the longest possible, let each group answer the longest hit
  it has within that length (it can only shorten it), and go round again until a whole round
  shortens nothing. It ends because the length only decreases. Full attention goes first:
  its hit is a prefix (every shorter length is a hit too), so it is looked up once and then
  only cut; a sliding-window group answers "the longest length whose last window is
  cached", which a shorter length need not satisfy: hence the rounds.

Course choices, declared: the pool gets its null block only when some group needs one (a
sliding-window or chunked-local group; ``block_pool.py``); every group has one block size,
which is then the alignment of a hit (vLLM aligns hybrid hits to ``scheduler_block_size``,
the least common multiple of the groups' block sizes, and views the block hashes at each
group's size: left out, so ``kv_cache_groups.py``'s unified configs with unequal block sizes
are for sizing only); a hit is looked up group by group (vLLM batches groups of one spec
into one lookup: the fixed point reaches the same length); and with prefix caching off the
course's :class:`~course_lib.memory.v1.kv_cache_manager.KVCacheManager` answers no hit
itself (vLLM builds a ``KVCacheCoordinatorNoPrefixCache``). Left out: EAGLE, sparse
retention and the uncached-common-prefix count, partial hash hits, KV events, DCP/PCP,
per-group hit lookups for connectors.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...sizing.units import cdiv
from .block_pool import BlockPool, KVCacheBlock
from .kv_cache_interface import FullAttentionSpec, KVCacheConfig
from .single_type_kv_cache_manager import FullAttentionManager, get_manager_for_kv_cache_spec

GroupBlocks = tuple[Sequence[KVCacheBlock], ...]     # one list per group (vLLM's KVCacheBlocks)


class KVCacheCoordinator:
    """Every group's manager over one pool (module docstring); subclasses find the hit."""

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = True) -> None:
        groups = kv_cache_config.kv_cache_groups
        assert len({g.kv_cache_spec.block_size for g in groups}) == 1, \
            "the course's groups share one block size (module docstring)"
        self.kv_cache_config = kv_cache_config
        needs_null = any(type(g.kv_cache_spec) is not FullAttentionSpec for g in groups)
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching,
                                    use_null_block=needs_null)
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(g.kv_cache_spec, self.block_pool, i, enable_caching)
            for i, g in enumerate(groups))

    # ------------------------------------------------------------------ allocating
    def get_num_blocks_to_allocate(self, seq_id: int, num_tokens: int,
                                   new_computed_blocks: GroupBlocks,
                                   total_computed_tokens: int) -> int:
        """Blocks the pool must give, summed over the groups (``num_tokens``: slots wanted,
        those held included)."""
        num_blocks = 0
        for manager, hits in zip(self.single_type_managers, new_computed_blocks, strict=True):
            num_blocks += manager.get_num_blocks_to_allocate(seq_id, num_tokens, hits,
                                                             total_computed_tokens)
        return num_blocks

    def allocate_new_computed_blocks(self, seq_id: int, new_computed_blocks: GroupBlocks,
                                     num_computed_tokens: int) -> None:
        """A new sequence's hit enters every group's table (touched, or null where the
        group's window has passed), before any group allocates."""
        for manager, hits in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(seq_id, hits, num_computed_tokens)

    def allocate_new_blocks(self, seq_id: int, num_tokens: int) -> list[list[KVCacheBlock]]:
        """Every group's table extended to ``num_tokens`` slots; the new blocks per group."""
        return [m.allocate_new_blocks(seq_id, num_tokens) for m in self.single_type_managers]

    def cache_blocks(self, seq_id: int, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Every group caches the blocks ``num_tokens`` fill."""
        for manager in self.single_type_managers:
            manager.cache_blocks(seq_id, block_hashes, num_tokens)

    # ---------------------------------------------------------------------- freeing
    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> None:
        """Every group frees what no later token reads (nothing, for full attention)."""
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(seq_id, num_computed_tokens)

    def free(self, seq_id: int) -> None:
        """Every group gives the sequence's blocks back, group by group, each tail first."""
        for manager in self.single_type_managers:
            manager.free(seq_id)

    def pop_blocks_for_free(self, seq_id: int) -> list[KVCacheBlock]:
        """Forget the sequence in every group; its blocks, group after group, each in table
        order without nulls (to free later in reverse: a KV connector still reads them)."""
        return [b for m in self.single_type_managers for b in m.pop_blocks_for_free(seq_id)]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # -------------------------------------------------------------------- the hit
    def get_blocks(self, seq_id: int) -> tuple[list[KVCacheBlock], ...]:
        """The sequence's table in every group."""
        return tuple(m.req_to_blocks[seq_id] for m in self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int]:
        """The hit every group holds, at most ``max_cache_hit_length`` tokens: its blocks per
        group and its length."""
        raise NotImplementedError


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group (a model of one kind of layer): its manager's hit is the hit (vLLM's
    ``UnitaryKVCacheCoordinator``)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int]:
        hits, length = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes, max_cache_hit_length)
        return (hits,), length


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: the hit by a fixed point over them (vLLM's
    ``HybridKVCacheCoordinator.find_longest_cache_hit``; module docstring)."""

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = True) -> None:
        super().__init__(kv_cache_config, enable_caching)
        # full attention first: one lookup bounds the others (vLLM sorts its spec groups so)
        self.lookup_order = sorted(
            range(len(self.single_type_managers)),
            key=lambda i: not isinstance(self.single_type_managers[i], FullAttentionManager))

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int) -> tuple[GroupBlocks, int]:
        """Each group in turn cuts the candidate length to the longest hit it has within it;
        rounds until one cuts nothing. A full-attention group is looked up in the first round
        only: later rounds just cut its hit to the candidate (shorter prefixes are hits).
        (vLLM stops after the first round when there is one full-attention spec and one
        other, where a second round cannot cut; the course's second round finds that out.)"""
        managers = self.single_type_managers
        hits: list[list[KVCacheBlock] | None] = [None] * len(managers)
        hit_length = max_cache_hit_length
        while True:
            length = hit_length
            for i in self.lookup_order:
                manager = managers[i]
                if isinstance(manager, FullAttentionManager) and hits[i] is not None:
                    length = min(length, len(hits[i]) * manager.block_size)
                    continue
                hits[i], length = manager.find_longest_cache_hit(block_hashes, length)
            if length >= hit_length:
                break                        # a whole round cut nothing: every group agrees
            hit_length = length
        for manager, blocks in zip(managers, hits, strict=True):
            if isinstance(manager, FullAttentionManager):
                del blocks[cdiv(hit_length, manager.block_size):]
        return tuple(hits), hit_length


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig,
                             enable_caching: bool = True) -> KVCacheCoordinator:
    """The coordinator for a config (vLLM's ``get_kv_cache_coordinator``): unitary for one
    group, hybrid for several."""
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, enable_caching)
    return HybridKVCacheCoordinator(kv_cache_config, enable_caching)
