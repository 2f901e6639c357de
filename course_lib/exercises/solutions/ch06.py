"""Solutions of chapter 06's exercises."""

from __future__ import annotations

from course_lib.sizing.units import cdiv


def lru_order(finished_tables):
    refs = {}
    for table in finished_tables:              # everybody ran at once: one reference per table
        for block in table:
            refs[block] = refs.get(block, 0) + 1
    order = []
    for table in finished_tables:              # then they finish, in this order
        for block in reversed(table):          # the end of the chain first
            refs[block] -= 1
            if refs[block] == 0:
                order.append(block)            # the newest at the end: evicted last
    return order


class PrefixPool:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_stack = list(range(num_blocks - 1, -1, -1))   # a fresh pool gives 0, 1, ...
        self.refs = [0] * num_blocks
        self.lru = {}                          # evictable blocks, least recently used first
        self.cache = {}                        # hash -> block
        self.hash_of = {}                      # block -> hash, for the cached blocks
        self.tables = {}

    def _hashes(self, prompt):
        hashes, parent, bs = [], 0, self.block_size
        for start in range(0, len(prompt) - bs + 1, bs):
            parent = hash((parent, tuple(prompt[start:start + bs]), ()))
            hashes.append(parent)
        return hashes

    def _new_block(self):
        if self.free_stack:
            block = self.free_stack.pop()
        else:                                  # evict the least recently used cached block
            block = next(iter(self.lru))
            del self.lru[block]
            del self.cache[self.hash_of.pop(block)]
        self.refs[block] = 1
        return block

    def run(self, seq, prompt):
        hashes = self._hashes(prompt)
        hits = []
        for h in hashes[:(len(prompt) - 1) // self.block_size]:   # keep one token to compute
            if h not in self.cache:
                break
            hits.append(self.cache[h])
        for block in hits:
            if self.refs[block] == 0:
                del self.lru[block]            # held again: not evictable any more
            self.refs[block] += 1
        need = cdiv(len(prompt), self.block_size) - len(hits)
        table = hits + [self._new_block() for _ in range(need)]
        for i in range(len(hits), len(hashes)):                  # computed: cache full blocks
            if hashes[i] not in self.cache:
                self.cache[hashes[i]] = table[i]
                self.hash_of[table[i]] = hashes[i]
        self.tables[seq] = table
        return len(hits) * self.block_size

    def finish(self, seq):
        for block in reversed(self.tables.pop(seq)):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.lru[block] = None     # cached: evictable, the newest at the end
                else:
                    self.free_stack.append(block)

    def block_table(self, seq):
        return list(self.tables[seq])

    def lru_order(self):
        return list(self.lru)
