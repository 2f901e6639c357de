"""How a full block is named in the V0 prefix cache: a chained hash and the key behind it.

A *full* block is identified by its content **and everything before it**: its hash is
``hash((parent_hash, token_ids_of_this_block, extra_key))``, where ``parent_hash`` is the hash
of the previous block (``ROOT_HASH`` for the first). Two requests that share a system prompt
therefore compute the same hashes for the blocks of that prompt and can share the physical
blocks. ``extra_key`` salts the chain (a LoRA id, a multimodal input hash, a tenant's
cache salt) so that equal tokens under different conditions never match. A hash only points
at a candidate: ``BlockKey`` keeps what the block was registered with, so that
:class:`~course_lib.memory.PrefixCache` can verify a hit exactly.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable
from typing import NamedTuple

ROOT_HASH = 0  # parent hash of a sequence's first block

HashFn = Callable[[int, tuple, Hashable], int]


def builtin_block_hash(parent_hash: int, token_ids: tuple, extra_key: Hashable) -> int:
    """Python's tuple hash: fast; deterministic across runs for ints and tuples of ints."""
    return hash((parent_hash, token_ids, extra_key))


def sha256_block_hash(parent_hash: int, token_ids: tuple, extra_key: Hashable) -> int:
    """A cryptographic hash (vLLM's ``prefix_caching_hash_algo="sha256"``): slower,
    collision-resistant, identical on every machine."""
    data = pickle.dumps((parent_hash, token_ids, extra_key), protocol=4)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


HASH_FUNCTIONS: dict[str, HashFn] = {"builtin": builtin_block_hash, "sha256": sha256_block_hash}


def typed_salt(salt: Hashable) -> Hashable:
    """A salt (``extra_key``) as it enters the hash: each value with its type, so that salts
    equal in Python but of other types (``1``, ``True``, ``1.0``) never share blocks. Tuples
    are typed item by item; ``()`` (no salt) stays ``()``."""
    if isinstance(salt, tuple):
        return tuple(typed_salt(s) for s in salt) if salt else ()
    return (type(salt).__qualname__, salt)


ParentRef = tuple[int, int]  # (block id, generation) of the cached block before this one


class BlockKey(NamedTuple):
    """What a cached block was registered with: enough to verify a hit exactly.

    ``parent`` names the *cached block* before this one (None for a first block), with the
    generation it had when this key was made. A lookup walks a prompt from its first block,
    so a hit at block i requires the stored parent to be the very block matched at i-1:
    by induction a hit proves the whole prefix equal, even if two prefixes' hashes collide.
    A parent that was evicted and re-registered has a new generation, so stale children
    can never be matched.
    """
    block_hash: int
    parent_hash: int
    token_ids: tuple
    extra_key: Hashable
    parent: ParentRef | None


def block_key(fields: tuple) -> BlockKey:
    """``BlockKey(*fields)`` without the named tuple's Python-level ``__new__`` (per block)."""
    return tuple.__new__(BlockKey, fields)
