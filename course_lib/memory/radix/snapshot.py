"""Snapshots of :class:`~course_lib.memory.radix.kv_cache_manager.RadixKVCacheManager`'s radix tree.

A snapshot copies the tree together with each sequence's locked node (``RadixState``), so that
a failed engine step can put both back; two snapshots compare by the cached blocks they hold
(``canonical_state``), not by object identity or by how the tree's edges happen to be split.
"""

from __future__ import annotations

from .radix_cache import RadixCache, TreeNode


def clone_with_locks(tree: RadixCache, last_node: dict[int, TreeNode]
                     ) -> tuple[RadixCache, dict[int, TreeNode]]:
    """A copy of the tree, and each sequence's locked node mapped to its copy."""
    new, mapping = tree.clone()
    return new, {s: mapping[id(n)] for s, n in last_node.items()}


def canonical_state(tree: RadixCache) -> tuple:
    """A tree's cached blocks as data: (namespace, the tokens up to the block's end, block id,
    lock count, last access) per block, and the free list in order; equal for equal caches,
    however their edges happen to be split."""
    bs, pages = tree.page_size, []
    for n in tree.nodes():
        prefix: tuple = ()
        node = n.parent
        while node is not tree.root:
            prefix = node.key + prefix
            node = node.parent
        for i in range(0, len(n.value), bs):
            pages.append((n.extra_key, prefix + n.key[:i + bs], n.value[i] // bs, n.lock_ref,
                          n.last_access_time))
    return tuple(sorted(pages, key=repr)), tuple(tree.pool.free_blocks)


class RadixState:
    """The tree and the sequences' locked nodes, copied; compares by content
    (:func:`canonical_state`), not by object identity."""

    def __init__(self, tree: RadixCache, last_node: dict[int, TreeNode]) -> None:
        self.tree, self.last_node = clone_with_locks(tree, last_node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RadixState) and \
            canonical_state(self.tree) == canonical_state(other.tree)

    __hash__ = None  # type: ignore[assignment]
