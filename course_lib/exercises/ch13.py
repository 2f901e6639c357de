"""Chapter 13 exercises: what a CPU offload tier stores after a step (13.1), how many
tokens it reports for a partly offloaded prefix (13.2), and when a decode engine's first
forward can finish while a prefill engine's layers are still arriving (13.3).

References run the library's :class:`~course_lib.engine.cpu_offload.CPUOffloadConnector` on
the same input: its ``build_connector_meta`` (the stores of one scheduled sequence) and its
``get_num_new_matched_tokens``, over a tier filled with the hashes the case says it holds.
Feedback names the case (the sequence's block hashes, what the tier holds, the tokens) and the
blocks or tokens that differ, in the chapter's terms.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from course_lib.engine.cpu_offload import CPUOffloadConnector
from course_lib.exercises import Exercise, Exercises, Rule, Verdict, judge_cases, returns
from course_lib.exercises.solutions import ch13 as solutions


def _tier(block_hashes: Sequence[str], tier: set[str], block_size: int, num_tokens: int
          ) -> tuple[CPUOffloadConnector, SimpleNamespace]:
    """A real tier holding ``tier`` (room for every hash besides), bound to a stand-in of the
    KV-cache manager that knows one sequence (id 0, ``num_tokens`` long) and its hashes."""
    conn = CPUOffloadConnector(len(tier) + len(block_hashes) + 1)
    for h in sorted(tier):
        conn.cpu_pool.allocate(h, set())
    conn.kv_cache_manager = SimpleNamespace(req_to_block_hashes={0: list(block_hashes)})
    conn.block_size = block_size
    return conn, _Seq(num_tokens)


class _Seq:
    """The sequence as the connector reads it: ``seq_id``, ``len()``, ``num_computed_tokens``,
    ``prompt_token_ids`` (only their number is read: the tier stores prompt blocks only)."""

    def __init__(self, num_tokens: int, num_computed_tokens: int = 0,
                 num_prompt_tokens: int | None = None) -> None:
        self.seq_id, self.num_tokens = 0, num_tokens
        self.num_computed_tokens = num_computed_tokens
        self.prompt_token_ids = (0,) * (num_tokens if num_prompt_tokens is None
                                        else num_prompt_tokens)

    def __len__(self) -> int:
        return self.num_tokens


def _letters(n: int) -> list[str]:
    """Short stand-ins for ``n`` block hashes: a, b, ..., z, a1, b1, ..."""
    return [chr(ord("a") + i % 26) + (str(i // 26) if i >= 26 else "") for i in range(n)]


# ------------------------------------------------------------------ 13.1
def blocks_to_store(block_hashes: Sequence[str], tier: set[str], num_computed_tokens: int,
                    num_new_tokens: int, block_size: int) -> list[int]:
    """Reference: the blocks (indices into the sequence's table) the tier stores after a step
    that computes ``num_new_tokens`` tokens from ``num_computed_tokens`` on: the library's
    ``build_connector_meta`` for one scheduled sequence whose block ``i`` is GPU block ``i``,
    admitted in an earlier step (its offer stands at the step's first block), whose prompt's
    full blocks are ``block_hashes`` (the tier stores prompt blocks only)."""
    num_tokens = num_computed_tokens + num_new_tokens
    conn, _ = _tier(block_hashes, tier, block_size, num_tokens)
    entry = SimpleNamespace(seq=_Seq(num_tokens, num_computed_tokens,
                                     len(block_hashes) * block_size),
                            num_tokens=num_new_tokens,
                            block_ids=list(range(-(-num_tokens // block_size))))
    meta = conn.build_connector_meta(SimpleNamespace(scheduled=[entry]))
    return [gpu for gpu, _ in meta.stores]


def _store_cases() -> list[tuple]:
    cases = [(_letters(4), set(), 0, 10, 4),            # a chunk: its partial block waits
             (_letters(4), set(), 8, 8, 4),             # only what this step computed
             (_letters(3), set(), 6, 6, 4),             # block 1 began last step, ends now
             (_letters(4), {"b"}, 0, 16, 4),            # b is held; c and d are stored
             (_letters(3), set(), 11, 1, 4),            # one token completes block 2
             (_letters(2), set(), 9, 2, 4),             # nothing completes
             (_letters(3), {"a", "b", "c"}, 0, 13, 4),  # all held: nothing to store
             (_letters(2), set(), 6, 6, 4),             # block 2 is generated: not stored
             (_letters(2), set(), 12, 4, 4)]            # decoding: nothing stored
    rng = random.Random(131)
    for _ in range(30):
        bs = rng.choice([2, 4, 8])
        ctx, n = rng.randrange(0, 40), rng.randrange(1, 24)
        # a chunk of a longer prompt, or (fewer hashes) a step past the prompt's end
        hashes = _letters(max(0, (ctx + n) // bs + rng.randrange(-2, 3)))
        tier = {h for h in hashes if rng.random() < 0.3}
        cases.append((hashes, tier, ctx, n, bs))
    return cases


def _store_text(case: tuple) -> str:
    hashes, tier, ctx, n, bs = case
    return (f"block_size {bs}, hashes {hashes}, tier holds {sorted(tier)}, tokens "
            f"{ctx}..{ctx + n - 1} computed this step")


def check_blocks_to_store(fn: Callable[..., list[int]]) -> Verdict:
    """13.1: the learner's blocks against the library tier's stores, case by case."""
    def judge(case: tuple, got) -> str | None:
        hashes, tier, ctx, n, bs = case
        want = blocks_to_store(*case)
        if isinstance(got, list | tuple) and list(got) == want:
            return None
        end = min((ctx + n) // bs, len(hashes))
        why = (f"the full prompt blocks this step completes are {ctx // bs}..{end - 1}"
               if end > ctx // bs else "this step completes no prompt block")
        return (f"{_store_text(case)}: yours {got!r}, the library stores {want} ({why}; "
                f"skip those the tier holds)")

    return judge_cases("13.1 blocks_to_store", fn, _store_cases(), returns(judge), _store_text)


def _stores_partial(block_hashes, tier, ctx, n, bs):
    """Wrong: stores the partial last block too (ceil instead of floor)."""
    end = -(-(ctx + n) // bs)
    return [i for i in range(ctx // bs, min(end, len(block_hashes)))
            if block_hashes[i] not in tier]


def _stores_generated(block_hashes, tier, ctx, n, bs):
    """Wrong: stores the blocks of generated tokens too (past the prompt's hashes)."""
    return [i for i in range(ctx // bs, (ctx + n) // bs)
            if i >= len(block_hashes) or block_hashes[i] not in tier]


def _stores_from_start(block_hashes, tier, ctx, n, bs):
    """Wrong: every full block of the sequence, not only this step's."""
    return [i for i in range((ctx + n) // bs) if block_hashes[i] not in tier]


def _skips_begun_block(block_hashes, tier, ctx, n, bs):
    """Wrong: starts at the first block this step begins (ceil), losing the one it ends."""
    return [i for i in range(-(-ctx // bs), (ctx + n) // bs) if block_hashes[i] not in tier]


def _stores_held(block_hashes, tier, ctx, n, bs):
    """Wrong: copies blocks the tier already holds again."""
    return list(range(ctx // bs, (ctx + n) // bs))


def _stops_at_held(block_hashes, tier, ctx, n, bs):
    """Wrong: stops at the first block the tier holds (a lookup's rule, not a store's)."""
    out = []
    for i in range(ctx // bs, (ctx + n) // bs):
        if block_hashes[i] in tier:
            break
        out.append(i)
    return out


# ------------------------------------------------------------------ 13.2
def num_new_matched_tokens(block_hashes: Sequence[str], tier: set[str], num_tokens: int,
                           gpu_hit_tokens: int, block_size: int) -> int:
    """Reference: the library tier's ``get_num_new_matched_tokens`` for a sequence of
    ``num_tokens`` tokens whose GPU prefix hit is ``gpu_hit_tokens``."""
    conn, seq = _tier(block_hashes, tier, block_size, num_tokens)
    n, _ = conn.get_num_new_matched_tokens(seq, gpu_hit_tokens)
    return n


def _match_cases() -> list[tuple]:
    cases = [(_letters(4), set(_letters(4)), 17, 0, 4),    # the whole prompt but its last token
             (_letters(4), set(_letters(4)), 16, 0, 4),    # the last token's block: computed
             (_letters(4), set(_letters(4)), 18, 8, 4),    # after the GPU hit only
             (_letters(4), {"a", "c", "d"}, 18, 0, 4),     # stops where the tier lacks one
             (_letters(4), {"c", "d"}, 18, 8, 4),          # the GPU found a, b; the tier c, d
             (_letters(3), set(_letters(3)), 13, 12, 4),   # the GPU found all it may
             (_letters(4), set(), 18, 4, 4)]               # the tier holds nothing
    rng = random.Random(132)
    for _ in range(30):
        bs = rng.choice([2, 4, 8])
        num_tokens = rng.randrange(1, 48)
        hashes = _letters(num_tokens // bs)
        gpu = bs * rng.randrange(0, max(1, (num_tokens - 1) // bs + 1))
        tier = {h for h in hashes if rng.random() < 0.7}
        cases.append((hashes, tier, num_tokens, gpu, bs))
    return cases


def _match_text(case: tuple) -> str:
    hashes, tier, num_tokens, gpu, bs = case
    return (f"block_size {bs}, {num_tokens} tokens, hashes {hashes}, tier holds "
            f"{sorted(tier)}, GPU hit {gpu} tokens")


def check_num_new_matched_tokens(fn: Callable[..., int]) -> Verdict:
    """13.2: the learner's count against the library tier's, case by case."""
    def judge(case: tuple, got) -> str | None:
        hashes, tier, num_tokens, gpu, bs = case
        want = num_new_matched_tokens(*case)
        if isinstance(got, int) and not isinstance(got, bool) and got == want:
            return None
        return (f"{_match_text(case)}: yours {got!r}, the library {want} (blocks "
                f"{gpu // bs}..{gpu // bs + want // bs - 1} from the tier; the last token, "
                f"{num_tokens - 1}, is computed)" if want else
                f"{_match_text(case)}: yours {got!r}, the library 0 (no block of the tier "
                f"follows the GPU hit before the last token's block)")

    return judge_cases("13.2 num_new_matched_tokens", fn, _match_cases(), returns(judge),
                       _match_text)


def _counts_blocks(block_hashes, tier, num_tokens, gpu, bs):
    """Wrong: the number of blocks, not of tokens."""
    return solutions.num_new_matched_tokens(block_hashes, tier, num_tokens, gpu, bs) // bs


def _loads_last_token(block_hashes, tier, num_tokens, gpu, bs):
    """Wrong: may cover the last token too (every full block)."""
    n = 0
    for i in range(gpu // bs, len(block_hashes)):
        if block_hashes[i] not in tier:
            break
        n += 1
    return n * bs


def _counts_from_start(block_hashes, tier, num_tokens, gpu, bs):
    """Wrong: counts the tier's blocks from the first block, the GPU's hit included."""
    return solutions.num_new_matched_tokens(block_hashes, tier, num_tokens, 0, bs)


def _counts_every_held(block_hashes, tier, num_tokens, gpu, bs):
    """Wrong: every block after the GPU hit that the tier holds, gaps or not."""
    last = (num_tokens - 1) // bs
    return bs * sum(1 for i in range(gpu // bs, min(last, len(block_hashes)))
                    if block_hashes[i] in tier)


# ------------------------------------------------------------------ 13.3
def first_forward_done(order: Sequence[int], send_s: float, layer_s: float) -> float:
    """Reference: the decode side's first forward, run event by event. The prefill side sends
    one layer at a time, in ``order``, each taking ``send_s`` on the link (the first starts at
    0); the forward runs layers 0, 1, ... in turn, each taking ``layer_s`` once its K/V is in
    (``wait_for_layer_load``) and the layer before it is done. Returns when it finishes."""
    arrived = {}
    clock = 0.0
    for layer in order:                        # the link: one send after another
        clock += send_s
        arrived[layer] = clock
    done = 0.0
    for layer in range(len(order)):            # the forward: layer by layer
        start = max(done, arrived[layer])
        done = start + layer_s
    return done


def _order_cases() -> list[tuple]:
    cases = [([0, 1, 2], 1.0, 1.0),           # sent in the forward's order
             ([2, 1, 0], 1.0, 1.0),           # reversed: the forward waits for the last
             ([0, 1, 2], 2.0, 1.0),           # a slow link: each layer waits for its K/V
             ([0, 1, 2], 1.0, 2.0),           # a slow layer: the forward lags the link
             ([1, 0, 2, 3], 0.5, 0.25),
             ([0], 3.0, 0.5)]                 # one layer
    rng = random.Random(133)
    for _ in range(30):
        n = rng.randrange(1, 9)
        order = list(range(n))
        if rng.random() < 0.7:
            rng.shuffle(order)
        cases.append((order, rng.choice([0.25, 0.5, 1.0, 2.0]),
                      rng.choice([0.25, 0.5, 1.0, 3.0])))
    return cases


def _order_text(case: tuple) -> str:
    order, send_s, layer_s = case
    return f"order {order}, send_s {send_s}, layer_s {layer_s}"


def check_first_forward_done(fn: Callable[..., float]) -> Verdict:
    """13.3: the learner's finishing time against the event-by-event reference."""
    def judge(case: tuple, got) -> str | None:
        want = first_forward_done(*case)
        if isinstance(got, int | float) and not isinstance(got, bool) and \
                abs(got - want) <= 1e-9 * max(1.0, abs(want)):
            return None
        order, send_s, _ = case
        arrive = {layer: (k + 1) * send_s for k, layer in enumerate(order)}
        return (f"{_order_text(case)}: yours {got!r}, the forward finishes at {want:g} "
                f"(layer 0's K/V arrives at {arrive[0]:g}, the last layer's at "
                f"{arrive[len(order) - 1]:g})")

    return judge_cases("13.3 first_forward_done", fn, _order_cases(), returns(judge),
                       _order_text)


def _ignores_arrival(order, send_s, layer_s):
    """Wrong: the forward never waits for the link."""
    return len(order) * layer_s


def _layers_in_parallel(order, send_s, layer_s):
    """Wrong: each layer starts when its K/V arrives, not after the layer before it."""
    return max((k + 1) * send_s for k in range(len(order))) + layer_s


def _parallel_link(order, send_s, layer_s):
    """Wrong: every layer arrives after one send_s (the link carries them all at once)."""
    return send_s + len(order) * layer_s


def _ignores_order(order, send_s, layer_s):
    """Wrong: layer l arrives (l + 1) * send_s, whatever the order."""
    return solutions.first_forward_done(list(range(len(order))), send_s, layer_s)


def _waits_for_all(order, send_s, layer_s):
    """Wrong: the forward starts once every layer is in (no layer-by-layer pipelining)."""
    return len(order) * send_s + len(order) * layer_s


EXERCISES = Exercises(
    Exercise("13.1", "blocks_to_store", check_blocks_to_store, hints=(
        "Number the sequence's blocks from 0: block i holds tokens i * block_size to "
        "(i + 1) * block_size - 1, and its hash is block_hashes[i]. Which blocks are full "
        "once this step's tokens are written, and were not full before it?",
        "The first is the block holding token num_computed_tokens (it may have begun in an "
        "earlier step: integer division), the last the one before the block left partial: "
        "range(num_computed_tokens // block_size, (num_computed_tokens + num_new_tokens) // "
        "block_size).",
        "Of those, keep the prompt's (the blocks block_hashes names: generated tokens are not "
        "stored), leave out the ones whose hash the tier already holds, and go on past them: "
        "a store copies each block on its own.",
    ), solution=solutions.blocks_to_store, rules=(
        Rule("only full blocks are stored",
             "hashes ['a', 'b', 'c', 'd'], tier holds [], tokens 0..9",
             _stores_partial),
        Rule("only the blocks this step completes, not earlier ones",
             "hashes ['a', 'b', 'c', 'd'], tier holds [], tokens 8..15", _stores_from_start),
        Rule("a block that began in an earlier step and is completed by this one is stored",
             "hashes ['a', 'b', 'c'], tier holds [], tokens 6..11", _skips_begun_block),
        Rule("only prompt blocks are stored: a block past the prompt's hashes is not",
             "hashes ['a', 'b'], tier holds [], tokens 6..11", _stores_generated),
        Rule("a block the tier holds is not stored again",
             "hashes ['a', 'b', 'c', 'd'], tier holds ['b'], tokens 0..15", _stores_held),
        Rule("the blocks after a held one are still stored",
             "hashes ['a', 'b', 'c', 'd'], tier holds ['b'], tokens 0..15", _stops_at_held),
    ), trivial=(lambda *a: None, lambda *a: []), compare_with=(
        "CPUOffloadConnector.build_connector_meta in course_lib/engine/cpu_offload.py, then "
        "vLLM 0.33.0's _build_store_jobs in "
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py (its offer "
        "starts at next_stored_chunk_idx; _calc_num_offloadable_tokens keeps it to the prompt "
        "under offload_prompt_only, the default)")),
    Exercise("13.2", "num_new_matched_tokens", check_num_new_matched_tokens, hints=(
        "The GPU found gpu_hit_tokens (whole blocks); the tier is asked about the blocks that "
        "come right after them, starting with block gpu_hit_tokens // block_size.",
        "Walk those blocks while the tier holds their hash, and stop at the first it does not "
        "hold: a prefix cannot skip a block.",
        "Never report the block of the last token (token num_tokens - 1): the course's tier "
        "leaves it to be computed, for the logits (as vLLM 0.33.0's SimpleCPUOffloadScheduler "
        "does; its OffloadingConnector may report it, and the scheduler computes that token "
        "again). So stop before block (num_tokens - 1) // block_size, and answer in tokens: "
        "blocks times block_size.",
    ), solution=solutions.num_new_matched_tokens, rules=(
        Rule("the answer is in tokens", "17 tokens, hashes ['a', 'b', 'c', 'd'], tier holds "
             "['a', 'b', 'c', 'd'], GPU hit 0", _counts_blocks),
        Rule("the last token's block is never reported", "16 tokens, hashes ['a', 'b', 'c', "
             "'d'], tier holds ['a', 'b', 'c', 'd'], GPU hit 0", _loads_last_token),
        Rule("only the blocks after the GPU hit are counted", "18 tokens, hashes ['a', 'b', "
             "'c', 'd'], tier holds ['a', 'b', 'c', 'd'], GPU hit 8", _counts_from_start),
        Rule("the count stops at the first block the tier lacks", "18 tokens, hashes ['a', "
             "'b', 'c', 'd'], tier holds ['a', 'c', 'd'], GPU hit 0", _counts_every_held),
    ), trivial=(lambda *a: None, lambda *a: 0), compare_with=(
        "CPUOffloadConnector.get_num_new_matched_tokens in course_lib/engine/cpu_offload.py, "
        "then vLLM 0.33.0's SimpleCPUOffloadScheduler.get_num_new_matched_tokens in "
        "vllm/v1/simple_kv_offload/manager.py (max_hit_len = request.num_tokens - 1 - "
        "num_computed_tokens: the same rule), and OffloadingConnectorScheduler's "
        "_lookup_complete_chunks in "
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py, which may "
        "report the whole prompt")),
    Exercise("13.3", "first_forward_done", check_first_forward_done, hints=(
        "Two clocks: the link's, on which the layers arrive one after another in `order`, "
        "and the forward's, which runs layers 0, 1, 2, ... in turn.",
        "The k-th layer sent arrives at (k + 1) * send_s: note when each *layer* arrives, "
        "then walk the layers in the forward's order.",
        "Layer l starts at the later of (its K/V arrived, layer l - 1 finished) and takes "
        "layer_s; the answer is when the last layer finishes.",
    ), solution=solutions.first_forward_done, rules=(
        Rule("a layer's attention waits for its K/V (wait_for_layer_load)",
             "order [0, 1, 2], send_s 2.0, layer_s 1.0", _ignores_arrival),
        Rule("the forward runs its layers one after another",
             "order [0, 1, 2], send_s 1.0, layer_s 2.0", _layers_in_parallel),
        Rule("the link sends one layer at a time",
             "order [0, 1, 2], send_s 2.0, layer_s 1.0", _parallel_link),
        Rule("the layers arrive in the order they are sent",
             "order [2, 1, 0], send_s 1.0, layer_s 1.0", _ignores_order),
        Rule("the forward need not wait for every layer before it starts",
             "order [0, 1, 2], send_s 1.0, layer_s 1.0", _waits_for_all),
    ), trivial=(lambda *a: None, lambda *a: 0.0), compare_with=(
        "KVConnectorBase_V1.wait_for_layer_load in course_lib/engine/kv_connector.py (the "
        "course's model runner waits for every layer before the forward), then vLLM 0.33.0's "
        "wait_for_layer_load and save_kv_layer in "
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py, called from inside each "
        "attention layer (vllm/model_executor/layers/attention/kv_transfer_utils.py)")),
)


hint = EXERCISES.print_hint            # ch13.hint("N.M"): the next graded hint
solution = EXERCISES.print_solution    # ch13.solution("N.M"): a solution's code
