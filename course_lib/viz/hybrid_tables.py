"""Chapter 14's widget: a hybrid model's block tables, one per KV-cache group, drawn step by step
as one request grows on the real :class:`~course_lib.memory.v1.kv_cache_manager.KVCacheManager`.

The model has two layers: a sliding-window one and a full-attention one, as gpt-oss alternates
them (vLLM 0.33.0 groups them into two KV-cache groups over one pool:
``vllm/v1/core/kv_cache_planning.py``; here :func:`~course_lib.memory.v1.kv_cache_groups.
get_kv_cache_groups` does it). An earlier request with the same first tokens may have run and
finished, leaving its full blocks in the prefix cache; then the request arrives (its prefix
looked up, its prompt allocated in one step) and decodes one token a step. Each step is one
``allocate_slots`` call, which first frees what left the window (``remove_skipped_blocks``: the
freed entries become the null block, block 0, and the table keeps its positions).

* :class:`GrowthScenario`: the sizes (checked at the door: the manager trusts its caller);
* :class:`GrowthRun`: the first ``k`` steps played on a fresh manager, and what each did;
* :func:`table_states` and :func:`pool_states`: plain data read from the manager, one state
  per entry: ``held`` (a block the request holds, not cached: the block being filled),
  ``cached`` (held and in the prefix cache: full), ``null`` (the null block), and in the pool
  ``free, cached`` (no holder, still findable by its hash until the pool hands it out
  again: the earliest freed first) or ``free``; in the pool, ``held`` is any block a table holds;
* :func:`draw_hybrid_tables`: the tables and the pool as a matplotlib Figure;
* :class:`HybridTablesExplorer`: a step slider (with Play and prev / next) over the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from course_lib.memory.v1.kv_cache_groups import get_kv_cache_groups
from course_lib.memory.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from course_lib.memory.v1.kv_cache_manager import KVCacheManager
from course_lib.sizing.blocks import check_block_size
from course_lib.sizing.units import cdiv, check_int
from course_lib.viz.readable import EXPLORER_DPI, MAX_WIDTH_IN, figure_png
from course_lib.viz.step_controls import StepControls

HELD, CACHED, NULL, FREE_CACHED, FREE = "held", "cached", "null", "free, cached", "free"
STATE_COLORS = {HELD: "#8fb8e0", CACHED: "#7cc07c", NULL: "#9a9a9a", FREE_CACHED: "#d9efd9",
                FREE: "white"}
MAX_TABLE_BLOCKS = 16       # blocks a table may reach: one row of the drawing
MAX_POOL_BLOCKS = 48        # the pool is drawn in rows of MAX_TABLE_BLOCKS
SEQ, EARLIER = 1, 0         # the request drawn; the earlier one that left its prefix cached
CELL_W, ROW_H, LABEL_W, FONT = 0.44, 0.42, 1.75, 10.0


@dataclass(frozen=True)
class GrowthScenario:
    """One request in a two-layer hybrid model: a sliding window of ``sliding_window`` tokens
    and full attention, ``block_size`` tokens a block, a pool of ``num_gpu_blocks`` (block 0
    is the null block). The request's prompt is ``prompt_len`` tokens, of which the first
    ``shared_prefix`` were an earlier, finished request's prompt too; it then decodes
    ``num_decode_steps`` tokens, one a step.

    A door: every size is checked here (``ValueError`` naming the value and its range), and the
    pool must hold both tables at their longest plus the null block, so that no step finds it
    short (the widget shows the windows, not preemption: chapter 07's)."""

    block_size: int = 4
    sliding_window: int = 6
    prompt_len: int = 14
    num_decode_steps: int = 10
    shared_prefix: int = 12
    num_gpu_blocks: int = 24

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_int("sliding_window", self.sliding_window, 1)
        check_int("prompt_len", self.prompt_len, 1)
        check_int("num_decode_steps", self.num_decode_steps, 0)
        check_int("shared_prefix", self.shared_prefix, 0)
        if self.shared_prefix > self.prompt_len:
            raise ValueError(f"shared_prefix must be in [0, prompt_len={self.prompt_len}], "
                             f"got {self.shared_prefix}")
        blocks = cdiv(self.total_tokens, self.block_size)
        if blocks > MAX_TABLE_BLOCKS:
            raise ValueError(
                f"prompt_len + num_decode_steps = {self.total_tokens} tokens need {blocks} "
                f"blocks of {self.block_size}; the drawing holds tables of 1..{MAX_TABLE_BLOCKS}"
                f" blocks (at most {MAX_TABLE_BLOCKS * self.block_size} tokens)")
        need = 2 * blocks + 1
        check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        if not need <= self.num_gpu_blocks <= MAX_POOL_BLOCKS:
            raise ValueError(f"num_gpu_blocks must be in [{need}, {MAX_POOL_BLOCKS}] (both "
                             f"tables at {blocks} blocks, and the null block), got "
                             f"{self.num_gpu_blocks}")

    @property
    def total_tokens(self) -> int:
        return self.prompt_len + self.num_decode_steps

    @property
    def num_steps(self) -> int:
        """Steps of the slider after step 0 (the empty pool, or the earlier request's cached
        blocks): the earlier request (if any), the request's prompt, its decode steps."""
        return (self.shared_prefix > 0) + 1 + self.num_decode_steps


class GrowthRun:
    """The first ``num_steps`` steps of a scenario on a fresh hybrid ``KVCacheManager``; ``log``
    says what the last one did. Tokens: the request's are ``1, 2, ...``; the earlier request's
    prompt is the shared prefix followed by other tokens, so that only the prefix matches."""

    def __init__(self, scenario: GrowthScenario, num_steps: int) -> None:
        if not 0 <= num_steps <= scenario.num_steps:
            raise ValueError(f"step must be in [0, {scenario.num_steps}], got {num_steps}")
        s = self.scenario = scenario
        groups = get_kv_cache_groups({
            "layers.0.self_attn": SlidingWindowSpec(s.block_size, sliding_window=s.sliding_window),
            "layers.1.self_attn": FullAttentionSpec(s.block_size)})
        self.manager = KVCacheManager(s.block_size, s.num_gpu_blocks, kv_cache_groups=groups)
        self.tokens = list(range(1, s.prompt_len + 1))
        self.num_computed = 0                 # the request's tokens computed so far
        self.log = ["empty pool: nothing has run yet"]
        steps = []
        if s.shared_prefix:
            steps.append(self._earlier)
        steps += [self._prompt] + [self._decode] * s.num_decode_steps
        for step in steps[:num_steps]:
            step()

    def _earlier(self) -> None:
        m, s = self.manager, self.scenario
        prompt = self.tokens[:s.shared_prefix] + [1000 + i for i in range(s.block_size)]
        m.allocate_slots(EARLIER, prompt, 0, len(prompt))
        m.free(EARLIER)
        m.forget(EARLIER)
        self.log = [f"an earlier request ({len(prompt)} tokens, the first {s.shared_prefix} "
                    f"shared) ran and finished: its full blocks stay in the prefix cache"]

    def _prompt(self) -> None:
        m = self.manager
        hits, num_hit = m.get_computed_blocks(SEQ, self.tokens)
        m.allocate_slots(SEQ, self.tokens, 0, len(self.tokens) - num_hit, hits)
        self.num_computed = len(self.tokens)
        nulls = [sum(b.is_null for b in group) for group in hits]
        self.log = [f"the prompt ({len(self.tokens)} tokens) arrives: prefix hit of "
                    f"{num_hit} tokens"
                    + (f" (the window group takes {nulls[0]} of its blocks as null: out of "
                       f"the window already)" if nulls[0] else "")
                    + f", {len(self.tokens) - num_hit} computed"]

    def _decode(self) -> None:
        m = self.manager
        before = [list(t) for t in m.get_block_tables(SEQ)]
        self.tokens.append(2000 + len(self.tokens))
        m.allocate_slots(SEQ, self.tokens, self.num_computed, 1)
        self.num_computed += 1
        after = m.get_block_tables(SEQ)
        null_id = m.block_pool.null_block.block_id
        freed = [b for i, b in enumerate(before[0]) if b != null_id and after[0][i] == null_id]
        new = [len(a) > len(b) for a, b in zip(after, before, strict=True)]
        self.log = [f"a decode step computes token {self.num_computed - 1}"
                    + (f"; the window group frees block(s) {freed} (they left the window)"
                       if freed else "")
                    + ("; each group takes a new block" if all(new) else "")]


def table_states(manager: KVCacheManager, seq_id: int) -> tuple[list[tuple[int, str]], ...]:
    """Each group's table of the sequence: ``(block id, state)`` per entry, state ``null``,
    ``cached`` (full, in the prefix cache) or ``held`` (not cached yet)."""
    tables = []
    for group in manager.coordinator.single_type_managers:
        tables.append([(b.block_id, NULL if b.is_null else
                        CACHED if b.block_hash is not None else HELD)
                       for b in group.req_to_blocks.get(seq_id, ())])
    return tuple(tables)


def pool_states(manager: KVCacheManager) -> list[str]:
    """Every block of the pool, by id: ``null``, ``held`` (some table holds it; cached or
    not), ``free, cached`` (no holder, findable by its hash) or ``free``."""
    return [NULL if b.is_null else HELD if b.ref_cnt else
            FREE_CACHED if b.block_hash is not None else FREE
            for b in manager.block_pool.blocks]


def group_names(manager: KVCacheManager) -> list[str]:
    """Each group as the drawing labels it: its number and its kind of attention."""
    names = []
    for i, group in enumerate(manager.coordinator.single_type_managers):
        spec = group.kv_cache_spec
        kind = (f"window {spec.sliding_window}" if isinstance(spec, SlidingWindowSpec)
                else "full attention")
        names.append(f"group {i}: {kind}")
    return names


def _cell(ax, x: float, y: float, text: str, state: str) -> None:
    ax.add_patch(Rectangle((x, y), CELL_W * 0.92, ROW_H * 0.8, facecolor=STATE_COLORS[state],
                           edgecolor="#444444", linewidth=0.8,
                           linestyle="--" if state == FREE_CACHED else "-"))
    ax.text(x + CELL_W * 0.46, y + ROW_H * 0.4, text, ha="center", va="center", fontsize=FONT)


def draw_hybrid_tables(manager: KVCacheManager, seq_id: int, title: str = "") -> Figure:
    """The sequence's table in each group (entry ``i`` holds tokens ``i * block_size ..``),
    then the pool, every block coloured by its state (module docstring); at most
    ``MAX_TABLE_BLOCKS`` blocks a row. Inches throughout: readable at 100% zoom."""
    tables, pool = table_states(manager, seq_id), pool_states(manager)
    names = group_names(manager)
    pool_rows = cdiv(len(pool), MAX_TABLE_BLOCKS)
    rows = len(tables) + 1 + pool_rows            # a gap row between the tables and the pool
    width = min(MAX_WIDTH_IN, LABEL_W + MAX_TABLE_BLOCKS * CELL_W + 0.2)
    height = rows * ROW_H + 1.3
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    top = height - 0.5
    if title:
        ax.text(0.1, height - 0.25, title, fontsize=11, va="center", fontweight="bold")
    for r, (name, table) in enumerate(zip(names, tables, strict=True)):
        y = top - (r + 1) * ROW_H
        ax.text(0.1, y + ROW_H * 0.4, name, fontsize=FONT, va="center")
        for i, (block_id, state) in enumerate(table):
            _cell(ax, LABEL_W + i * CELL_W, y, str(block_id), state)
    for r in range(pool_rows):
        y = top - (len(tables) + 2 + r) * ROW_H
        first = r * MAX_TABLE_BLOCKS
        ax.text(0.1, y + ROW_H * 0.4, f"pool: blocks {first}..", fontsize=FONT, va="center")
        for i, state in enumerate(pool[first:first + MAX_TABLE_BLOCKS]):
            _cell(ax, LABEL_W + i * CELL_W, y, str(first + i), state)
    handles = [Patch(facecolor=c, edgecolor="#444444", label=s) for s, c in STATE_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=FONT,
               frameon=False)
    return fig


class HybridTablesExplorer:
    """A step slider over a :class:`GrowthScenario` (Play, prev / next): ``image`` shows each
    group's table and the pool after that step, ``caption`` what the step did."""

    def __init__(self, scenario: GrowthScenario | None = None, dpi: int = EXPLORER_DPI) -> None:
        self.scenario = scenario or GrowthScenario()
        self.dpi = dpi
        last = self.scenario.num_steps
        self.controls = c = StepControls(last, self._render)
        self.step, self.play, self.prev_button, self.next_button = (
            c.step, c.play, c.prev_button, c.next_button)
        self.caption, self.image, self.widget = c.caption, c.image, c.widget
        self.run = GrowthRun(self.scenario, 0)
        self._render()

    @property
    def manager(self) -> KVCacheManager:
        return self.run.manager

    def set_step(self, k: int) -> None:
        self.controls.set_step(k)

    def _render(self) -> None:
        k = self.step.value
        self.run = GrowthRun(self.scenario, k)
        m = self.manager
        held = [sum(s != NULL for _, s in t) for t in table_states(m, SEQ)]
        self.caption.value = (
            f"<b>step {k}</b>: " + "; ".join(self.run.log)
            + f"<br>{self.run.num_computed} tokens computed; blocks held per group "
            f"{held}; free blocks {m.num_free_gpu_blocks}/{m.num_gpu_blocks - 1}")
        fig = draw_hybrid_tables(m, SEQ, title=f"step {k}")
        self.image.value = figure_png(fig, self.dpi)
