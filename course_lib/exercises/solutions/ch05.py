"""Solutions of chapter 05's exercises."""

from __future__ import annotations

from course_lib.sizing.units import cdiv


def beam_blocks(tables, num_tokens, picks, block_size):
    refs = {}                                     # a block's count: the tables that hold it
    for table in tables.values():
        for block in table:
            refs[block] = refs.get(block, 0) + 1
    freed = []
    for beam, table in tables.items():            # a beam nobody picked is dropped
        if beam not in picks:
            for block in table:
                refs[block] -= 1
                if refs[block] == 0:
                    freed.append(block)
    for beam in set(picks):                       # picked k times: k - 1 forks
        for block in tables[beam]:
            refs[block] += picks.count(beam) - 1
    held = sum(1 for count in refs.values() if count > 0)
    copied = []
    if num_tokens % block_size == 0:              # full last blocks: each beam opens a new one
        held += len(picks)
    else:                                         # r beams on one partial block: r - 1 copies
        for last in {tables[beam][-1] for beam in picks}:
            copied += [last] * (refs[last] - 1)
        held += len(copied)
    return freed, copied, held


def blocks_held(num_samples, prompt_len, gen_len, block_size):
    if gen_len == 0:                          # nobody wrote: every sample shares every block
        return cdiv(prompt_len, block_size)
    full = prompt_len // block_size           # full prompt blocks stay shared
    return full + num_samples * (cdiv(prompt_len + gen_len, block_size) - full)


class CowManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_stack = list(range(num_blocks - 1, -1, -1))   # a fresh pool gives 0, 1, ...
        self.refs = [0] * num_blocks
        self.tables, self.lens = {}, {}

    def _take(self):
        block = self.free_stack.pop()
        self.refs[block] = 1
        return block

    def _drop(self, block):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_stack.append(block)

    def allocate(self, seq, num_tokens):
        self.tables[seq] = [self._take() for _ in range(cdiv(num_tokens, self.block_size))]
        self.lens[seq] = num_tokens

    def fork(self, parent, child):
        self.tables[child] = list(self.tables[parent])
        self.lens[child] = self.lens[parent]
        for block in self.tables[child]:
            self.refs[block] += 1

    def append(self, seq):
        table, n, copy = self.tables[seq], self.lens[seq], None
        if n % self.block_size == 0:              # last block full (or none yet): a new one
            table.append(self._take())
        elif self.refs[table[-1]] > 1:            # partial and shared: copy, then write
            src = table[-1]
            table[-1] = self._take()
            self._drop(src)
            copy = (src, table[-1])
        self.lens[seq] = n + 1
        return copy

    def free(self, seq):
        for block in reversed(self.tables.pop(seq)):   # the last block first
            self._drop(block)
        del self.lens[seq]

    def block_table(self, seq):
        return list(self.tables[seq])

    def ref_count(self, block):
        return self.refs[block]
