"""Thousands of random block-manager operations against a model of the physical KV cache.

The model keeps what each physical slot would hold (a token id written there) and replays
every copy the manager asks for (CoW, swap). After each operation:

* ``check_invariants()`` holds (free + held == total, ref counts == table entries, ...);
* reading every sequence's tokens *through its block table* gives exactly its tokens. This
  fails if a shared block was ever written (the other sharers would read the new token), if
  a prefix-cache hit returned a block with other content, or if a copy was missed;
* a call refused for want of room (NoFreeBlocksError: the machine sometimes calls without
  asking first) left the manager exactly as it was.
At the end every sequence is freed and every GPU and CPU block must be free again.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from memory_helpers import snapshot
from property_budget import examples

from course_lib.memory.v0.fast import FastBlockManager
from course_lib.memory.v0.manager import BlockManager
from course_lib.memory.v0.pool import NoFreeBlocksError

PREFIXES = [(1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 7, 7), (5, 5, 5, 5, 5, 5, 5, 5)]


class BlockManagerMachine(RuleBasedStateMachine):
    manager_class: type[BlockManager] = BlockManager

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_gpu=st.integers(1, 24),
                num_cpu=st.integers(0, 16), caching=st.booleans(),
                watermark=st.sampled_from([0.0, 0.1]), weak_hash=st.booleans())
    def setup(self, block_size, num_gpu, num_cpu, caching, watermark, weak_hash):
        self.m = self.manager_class(block_size, num_gpu, num_cpu, watermark=watermark,
                              enable_prefix_caching=caching)
        if caching and weak_hash:   # 3 hash values: collisions all the time
            self.m.cache.hash_fn = lambda parent, tokens, extra: hash((parent, tokens, extra)) % 3
        self.bs = block_size
        self.kv = {"gpu": [[None] * block_size for _ in range(num_gpu)],
                   "cpu": [[None] * block_size for _ in range(num_cpu)]}
        self.next_id = 0

    # --- the model of the physical cache --------------------------------------------
    def write(self, seq_id: int, start: int) -> None:
        """The forward pass writes K/V of tokens start.. into their slots: never a shared block.
        A token's K/V depends on every token before it (attention), so a slot records the
        whole prefix: a cache hit on equal tokens after a different prefix reads wrong."""
        table = self.m.get_table(seq_id)
        for p in range(start, table.num_tokens):
            block = table.blocks[p // self.bs]
            assert self.m.ref_count(block) == 1, f"write into shared block {block}"
            self.kv["gpu"][block][p % self.bs] = tuple(table.token_ids[:p + 1])

    def copy_blocks(self, pairs, src_dev: str, dst_dev: str) -> None:
        for src, dst in pairs:
            self.kv[dst_dev][dst] = list(self.kv[src_dev][src])

    def seqs(self, device: str) -> list[int]:
        return sorted(s for s in self.m.seq_ids() if self.m.get_table(s).device == device)

    def rejected(self, before, call) -> bool:
        """Run call; if it is refused, the state must be untouched."""
        try:
            call()
        except NoFreeBlocksError:
            assert snapshot(self.m) == before, "a rejected call changed the manager"
            return True
        return False

    # --- rules ---------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 9),
          suffix=st.lists(st.integers(0, 3), max_size=6), computed=st.booleans())
    def allocate(self, prefix, cut, suffix, computed):
        tokens = list(prefix[:cut]) + suffix
        if not tokens:                  # a prompt has a token (LLMEngine.add_request checks)
            return
        seq_id, before = self.next_id, snapshot(self.m)
        self.next_id += 1
        status = self.m.can_allocate(tokens)
        result = {}
        if self.rejected(before, lambda: result.update(hit=self.m.allocate(seq_id, tokens))):
            assert status.name != "OK"
            return
        hit = result["hit"]
        assert hit % self.bs == 0 and hit < len(tokens)
        self.write(seq_id, hit)
        if computed:
            self.m.mark_blocks_as_computed(seq_id, len(tokens))

    @precondition(lambda self: self.seqs("gpu"))
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(self.seqs("gpu")))
        n, before = self.m.get_table(seq_id).num_tokens, snapshot(self.m)
        can = self.m.can_append_slots(seq_id, len(new))
        out = {}
        if self.rejected(before, lambda: out.update(copies=self.m.append_slots(seq_id, new))):
            assert not can
            return
        assert can
        self.copy_blocks(out["copies"], "gpu", "gpu")
        self.write(seq_id, n)

    @precondition(lambda self: self.seqs("gpu"))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs("gpu")))
        self.m.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.m.seq_ids())
    @rule(data=st.data())
    def free(self, data):
        self.m.free(data.draw(st.sampled_from(sorted(self.m.seq_ids()))))

    @precondition(lambda self: self.seqs("gpu"))
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.lists(st.sampled_from(self.seqs("gpu")), min_size=1, max_size=2,
                                   unique=True))
        before, can, out = snapshot(self.m), self.m.can_swap_out(group), {}
        if not self.rejected(before, lambda: out.update(p=self.m.swap_out(group))):
            assert can
            self.copy_blocks(out["p"], "gpu", "cpu")
        else:
            assert not can

    @precondition(lambda self: self.seqs("cpu"))
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.lists(st.sampled_from(self.seqs("cpu")), min_size=1, max_size=2,
                                   unique=True))
        before, out = snapshot(self.m), {}
        status = self.m.can_swap_in(group)
        if not self.rejected(before, lambda: out.update(p=self.m.swap_in(group))):
            self.copy_blocks(out["p"], "cpu", "gpu")
        else:
            assert status.name != "OK"

    @precondition(lambda self: self.seqs("gpu"))
    @rule(data=st.data())
    def mark_computed(self, data):
        seq_id = data.draw(st.sampled_from(self.seqs("gpu")))
        n = self.m.get_table(seq_id).num_tokens
        self.m.mark_blocks_as_computed(seq_id, data.draw(st.integers(0, n)))

    @rule()
    def reset_prefix_cache(self):
        idle = self.m.num_free_gpu_blocks == self.m.num_gpu_blocks
        assert self.m.reset_prefix_cache() == (idle or self.m.cache is None)

    # --- checked after every step ----------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for seq_id in self.m.seq_ids():
            table = self.m.get_table(seq_id)
            kv = self.kv[table.device]
            tokens = table.token_ids
            for p in range(table.num_tokens):
                read = kv[table.blocks[p // self.bs]][p % self.bs]
                assert read == tuple(tokens[:p + 1]), f"seq {seq_id} pos {p} reads {read}"

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for seq_id in self.m.seq_ids():
            self.m.free(seq_id)
        self.m.check_invariants()
        assert self.m.num_free_gpu_blocks == self.m.num_gpu_blocks
        assert self.m.num_free_cpu_blocks == self.m.num_cpu_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40,
                                                 deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase


class FastBlockManagerMachine(BlockManagerMachine):
    """The same model of the physical cache over the scheduler's twin (memory/v0/fast.py)."""
    manager_class = FastBlockManager


FastBlockManagerMachine.TestCase.settings = settings(max_examples=examples(60),
                                                     stateful_step_count=40, deadline=None)
TestFastBlockManagerStateful = FastBlockManagerMachine.TestCase
