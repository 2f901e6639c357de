"""Solutions of chapter 03's exercises."""

from __future__ import annotations


class ToyAllocator:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free_stack = list(range(num_blocks - 1, -1, -1))   # top of the stack: block 0
        self.is_free = [True] * num_blocks

    @property
    def num_free(self):
        return len(self.free_stack)

    def allocate(self):
        if not self.free_stack:
            raise RuntimeError("no free block")
        block = self.free_stack.pop()
        self.is_free[block] = False
        return block

    def free(self, block):
        if not 0 <= block < self.num_blocks or self.is_free[block]:
            raise ValueError(f"block {block} is not allocated")
        self.is_free[block] = True
        self.free_stack.append(block)


class ToyManager:
    def __init__(self, num_blocks, block_size, watermark_blocks):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark = watermark_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.tables = {}
        self.lens = {}

    @property
    def num_free(self):
        return len(self.free_blocks)

    def blocks_for(self, num_tokens):
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, num_tokens):
        needed = self.blocks_for(num_tokens)
        if needed > self.num_blocks - self.watermark:
            return "NEVER"
        if self.num_free - needed >= self.watermark:
            return "OK"
        return "LATER"

    def allocate(self, seq_id, num_tokens):
        self.tables[seq_id] = [self.free_blocks.pop() for _ in range(self.blocks_for(num_tokens))]
        self.lens[seq_id] = num_tokens

    def append_step(self, new_tokens):
        extra = {seq: self.blocks_for(self.lens[seq] + k) - len(self.tables[seq])
                 for seq, k in new_tokens.items()}
        if sum(extra.values()) > self.num_free:
            return False                       # checked before anything changes
        for seq, k in new_tokens.items():
            self.tables[seq] += [self.free_blocks.pop() for _ in range(extra[seq])]
            self.lens[seq] += k
        return True

    def free(self, seq_id):
        for block in reversed(self.tables.pop(seq_id)):
            self.free_blocks.append(block)
        del self.lens[seq_id]


def step_slot_mapping(tables, num_computed, num_new, block_size):
    slots = []
    for seq, count in num_new.items():
        for pos in range(num_computed[seq], num_computed[seq] + count):
            block = tables[seq][pos // block_size]
            slots.append(block * block_size + pos % block_size)
    return slots
