"""ipywidgets explorers of a block manager; their state lives here, not in notebook cells.

* :class:`BlockTableExplorer` (chapter 03): a scripted :class:`Scenario` of requests arriving,
  growing and finishing; a step slider replays the first ``k`` steps on a fresh
  ``BlockManager`` and draws the pool and the tables.
* :class:`PrefixCacheExplorer` (chapter 06): submit prompts to a :class:`PrefixCacheSession`
  (a ``BlockManager`` with prefix caching) and watch hits, the hash chain and the LRU order.

Figures go to the notebook through ``widgets.Image`` (PNG bytes), so that a test can drive a
widget (set ``.value``, ``button.click()``) and compare the bytes, and nbval can store it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import ipywidgets as widgets

from course_lib.memory.common import AllocStatus
from course_lib.memory.v0.manager import BlockManager
from course_lib.memory.v0.prefix_cache import HASH_FUNCTIONS
from course_lib.sizing.blocks import check_block_size
from course_lib.sizing.units import cdiv, check_int
from course_lib.viz.blocks import draw_pool_and_tables
from course_lib.viz.readable import EXPLORER_DPI, figure_png
from course_lib.viz.step_controls import StepControls


@dataclass(frozen=True)
class Op:
    """One event: ``arrive`` (a prompt of num_tokens), ``grow`` (num_tokens decoded, one at a
    time), ``finish``."""
    kind: str
    seq: str
    num_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("arrive", "grow", "finish"):
            raise ValueError(f"kind must be 'arrive', 'grow' or 'finish', got {self.kind!r}")
        if self.kind != "finish" and self.num_tokens < 1:
            raise ValueError(f"{self.kind} needs num_tokens >= 1, got {self.num_tokens}")


@dataclass(frozen=True)
class Scenario:
    block_size: int
    num_gpu_blocks: int
    steps: tuple[tuple[Op, ...], ...]

    def __post_init__(self) -> None:
        """A door: the block manager it drives trusts its caller, so the sizes are checked
        here (``ValueError`` naming the value)."""
        check_block_size(self.block_size)
        check_int("num_gpu_blocks", self.num_gpu_blocks, 1)


def default_scenario() -> Scenario:
    """Four requests in a 10-block pool of 4-token blocks; D must wait for B to finish."""
    a, g, f = (lambda s, n: Op("arrive", s, n)), (lambda s, n: Op("grow", s, n)), \
        (lambda s: Op("finish", s))
    return Scenario(4, 10, (
        (a("A", 6),), (a("B", 3),), (g("A", 2),), (g("A", 1), g("B", 1)),
        (a("C", 9), g("B", 1)), (a("D", 10),), (f("B"),), (f("A"), g("C", 3)),
        (g("D", 2), f("C")), (f("D"),)))


class ScenarioRun:
    """The first ``num_steps`` steps of a scenario applied to a fresh ``BlockManager``.

    The scheduler's side of the "Block Manager tutorial" §3.2 in miniature: a request whose
    prompt does not fit now waits (FCFS) and is admitted when a finishing request frees blocks;
    a sequence grows one token at a time and takes a new block only when its last block is full.
    """

    def __init__(self, scenario: Scenario, num_steps: int) -> None:
        if not 0 <= num_steps <= len(scenario.steps):
            raise ValueError(f"step must be in [0, {len(scenario.steps)}], got {num_steps}")
        self.manager = BlockManager(scenario.block_size, scenario.num_gpu_blocks, watermark=0.0)
        self.seq_ids: dict[str, int] = {}   # label -> seq id (order of arrival)
        self.waiting: list[tuple[str, int]] = []
        self.log: list[str] = []            # what the last step did
        for step in scenario.steps[:num_steps]:
            self.log = []
            for op in step:
                self._apply(op)
            self._admit_waiting()

    def labels(self) -> dict[int, str]:
        return {sid: label for label, sid in self.seq_ids.items() if self.manager.has_seq(sid)}

    def _tokens(self, label: str, start: int, n: int) -> list[int]:
        base = 100 * (1 + self.seq_ids.get(label, len(self.seq_ids)))
        return list(range(base + start, base + start + n))

    def _try_allocate(self, label: str, n: int) -> bool:
        m = self.manager
        if m.can_allocate(n) is not AllocStatus.OK:
            return False
        self.seq_ids[label] = sid = len(self.seq_ids)
        m.allocate(sid, self._tokens(label, 0, n))
        self.log.append(f"{label} admitted: {n} tokens -> blocks {m.get_block_table(sid)}")
        return True

    def _admit_waiting(self) -> None:
        while self.waiting and self._try_allocate(*self.waiting[0]):
            self.waiting.pop(0)

    def _apply(self, op: Op) -> None:
        m = self.manager
        if op.kind == "arrive":
            if op.seq in self.seq_ids or any(op.seq == w for w, _ in self.waiting):
                raise ValueError(f"request {op.seq!r} arrives twice")
            if self.waiting or not self._try_allocate(op.seq, op.num_tokens):
                self.waiting.append((op.seq, op.num_tokens))
                need = cdiv(op.num_tokens, m.block_size)
                self.log.append(f"{op.seq} waits: needs {need} blocks, "
                                f"{m.num_free_gpu_blocks} free")
            return
        sid = self.seq_ids.get(op.seq)
        if sid is None or not m.has_seq(sid):
            raise ValueError(f"request {op.seq!r} is not running (ops: arrive, grow, finish)")
        if op.kind == "finish":
            blocks = m.get_block_table(sid)
            m.free(sid)
            self.log.append(f"{op.seq} finished: blocks {blocks} back to the free list")
            return
        before = len(m.get_block_table(sid))
        for _ in range(op.num_tokens):
            n = m.get_table(sid).num_tokens
            if not m.can_append_slots(sid, 1):
                self.log.append(f"{op.seq} cannot grow: no free block (chapter 07 preempts)")
                return
            m.append_slots(sid, self._tokens(op.seq, n, 1))
        table = m.get_block_table(sid)
        new = table[before:]
        self.log.append(f"{op.seq} +{op.num_tokens} tokens -> {m.get_table(sid).num_tokens}"
                        + (f", new block(s) {new}" if new else ", no new block"))


class BlockTableExplorer:
    """A step slider over a scenario; ``image`` shows the pool and tables at that step."""

    def __init__(self, scenario: Scenario | None = None, dpi: int = EXPLORER_DPI) -> None:
        self.scenario = scenario or default_scenario()
        self.dpi = dpi
        last = len(self.scenario.steps)
        self.controls = c = StepControls(last, self._render)
        self.step, self.play, self.prev_button, self.next_button = (
            c.step, c.play, c.prev_button, c.next_button)
        self.caption, self.image, self.widget = c.caption, c.image, c.widget
        self.run = ScenarioRun(self.scenario, 0)
        self._render()

    @property
    def manager(self) -> BlockManager:
        return self.run.manager

    def set_step(self, k: int) -> None:
        self.controls.set_step(k)

    def _render(self) -> None:
        k = self.step.value
        self.run = ScenarioRun(self.scenario, k)
        m = self.manager
        waiting = ", ".join(w for w, _ in self.run.waiting) or "none"
        lines = self.run.log or ["empty pool: nothing has arrived yet"]
        self.caption.value = (f"<b>step {k}</b>: " + "; ".join(lines)
                              + f"<br>free blocks {m.num_free_gpu_blocks}/{m.num_gpu_blocks}, "
                              f"waiting: {waiting}")
        fig = draw_pool_and_tables(m, title=f"step {k}", ncols=5, labels=self.run.labels())
        self.image.value = figure_png(fig, self.dpi)


# ------------------------------------------------------------------ prefix caching (06)
@dataclass(frozen=True)
class Submitted:
    """The outcome of one prompt: how many of its tokens were found in the cache."""
    seq_id: int
    name: str
    num_tokens: int            # prompt + generated
    num_cached_tokens: int     # prompt tokens found in the cache
    blocks: tuple[int, ...]
    block_hashes: tuple[int, ...]


class PrefixCacheSession:
    """Prompts submitted one after another to a ``BlockManager`` with prefix caching.

    ``submit`` allocates the prompt (reusing cached blocks), marks it computed (its prefill
    ran) and keeps it running, or frees it at once with ``keep=False`` (a finished request):
    its full blocks stay cached, evictable in LRU order. When the pool is short, the oldest
    running request is finished first.
    """

    def __init__(self, block_size: int = 4, num_gpu_blocks: int = 16,
                 hash_algo: str = "sha256") -> None:
        check_block_size(block_size)             # a door: the manager trusts its caller
        check_int("num_gpu_blocks", num_gpu_blocks, 1)
        if hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got "
                             f"{hash_algo!r}")
        self.manager = BlockManager(block_size, num_gpu_blocks, watermark=0.0,
                                    enable_prefix_caching=True,
                                    prefix_caching_hash_algo=hash_algo)
        self.history: list[Submitted] = []
        self.running: list[int] = []
        self.names: dict[int, str] = {}

    def submit(self, name: str, token_ids: Sequence[int], extra_key: Hashable = (),
               keep: bool = True, generate: Sequence[int] = ()) -> Submitted:
        """Prefill ``token_ids``, then decode ``generate`` one token at a time (a reply whose
        full blocks become cacheable too, as in a chat's next turn). A request that can never
        fit raises ``ValueError`` before any running request is finished to make room."""
        m = self.manager
        bad = [t for t in (*token_ids, *generate)
               if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"token ids must be integers >= 0, got {bad[:5]!r}")
        if not token_ids:
            raise ValueError("token_ids must hold at least 1 token, got none")
        need = len(token_ids) + len(generate)
        if m.can_allocate(need) is AllocStatus.NEVER:
            raise ValueError(f"{name!r}: {need} tokens need {cdiv(need, m.block_size)} blocks "
                             f"of {m.block_size}, the pool has {m.num_gpu_blocks}: it can "
                             "never fit (nothing was finished to make room)")
        while m.can_allocate(need) is not AllocStatus.OK and self.running:
            self.finish()
        sid = len(self.history)
        cached = m.allocate(sid, token_ids, extra_key)
        m.mark_blocks_as_computed(sid, len(token_ids))
        for token in generate:
            m.append_slots(sid, [token])
        m.mark_blocks_as_computed(sid, need)
        table = m.get_table(sid)
        result = Submitted(sid, name, need, cached, tuple(table.blocks),
                           tuple(table.block_hashes))
        self.history.append(result)
        self.names[sid] = f"{sid}: {name}"
        if keep:
            self.running.append(sid)
        else:
            m.free(sid)
        return result

    def finish(self, seq_id: int | None = None) -> int:
        """Free a running request (default: the oldest); returns its id."""
        if not self.running:
            raise ValueError("no running request to finish")
        sid = self.running[0] if seq_id is None else seq_id
        if sid not in self.running:
            raise ValueError(f"seq {sid} is not running; running: {self.running}")
        self.running.remove(sid)
        self.manager.free(sid)
        return sid

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def lru_order(self) -> list[int]:
        """Cached blocks no request holds, next victim first."""
        return self.manager.gpu.evictable_block_ids()

    @property
    def num_held_blocks(self) -> int:
        return self.manager.usage().num_held_blocks


def short_hash(h: int) -> str:
    return f"{h & 0xFFFFFF:06x}"


Prompt = tuple[list[int], Hashable, list[int]]   # (prompt tokens, extra_key, reply tokens)


def chat_prompts() -> dict[str, Prompt]:
    """Small prompts for 4-token blocks: an 8-token system prompt, a chat whose first turn
    generates a 5-token reply, another user, the system prompt behind a timestamp, and a salted
    (other tenant's) copy."""
    system, user1, reply1 = list(range(1, 9)), [11, 12, 13], [21, 22, 23, 24, 25]
    turn1 = system + user1
    return {"turn 1": (turn1, (), reply1),
            "turn 2 (after reply 1)": (turn1 + reply1 + [31, 32, 33], (), []),
            "turn 2, other branch": (turn1 + reply1 + [41, 42], (), []),
            "another user": (system + [51, 52, 53], (), []),
            "timestamp 10:41 + turn 1": ([1041] + turn1, (), []),
            "timestamp 10:42 + turn 1": ([1042] + turn1, (), []),
            "turn 1, tenant B salt": (turn1, "tenant-b", [])}


class PrefixCacheExplorer:
    """Pick a prompt, submit it; see its hits, its hash chain, the pool and the LRU order."""

    def __init__(self, prompts: Mapping[str, Prompt] | None = None,
                 block_size: int = 4, num_gpu_blocks: int = 16, dpi: int = EXPLORER_DPI) -> None:
        prompts = chat_prompts() if prompts is None else prompts
        if not prompts:
            raise ValueError("give at least one prompt: {name: (token_ids, extra_key, reply)}")
        for name, prompt in prompts.items():
            if not (isinstance(prompt, (tuple, list)) and len(prompt) == 3):
                raise ValueError(f"prompt {name!r} must be a (token_ids, extra_key, reply) "
                                 f"tuple, got {prompt!r}")
        self.prompts = dict(prompts)
        self.session = PrefixCacheSession(block_size, num_gpu_blocks)
        self.dpi = dpi
        self.prompt = widgets.Dropdown(options=list(self.prompts), description="prompt")
        self.keep = widgets.Checkbox(value=False, description="keep running")
        self.submit_button = widgets.Button(description="submit")
        self.finish_button = widgets.Button(description="finish oldest")
        self.reset_button = widgets.Button(description="reset prefix cache")
        self.submit_button.on_click(lambda _: self.submit())
        self.finish_button.on_click(lambda _: self.finish())
        self.reset_button.on_click(lambda _: self.reset())
        self.caption = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.widget = widgets.VBox([
            widgets.HBox([self.prompt, self.keep]),
            widgets.HBox([self.submit_button, self.finish_button, self.reset_button]),
            self.caption, self.image])
        self._render("nothing submitted yet")

    @property
    def manager(self) -> BlockManager:
        return self.session.manager

    def submit(self) -> Submitted:
        tokens, extra, reply = self.prompts[self.prompt.value]
        r = self.session.submit(self.prompt.value, tokens, extra, keep=self.keep.value,
                                generate=reply)
        chain = " → ".join(short_hash(h) for h in r.block_hashes)
        made = f" (+{len(reply)} generated)" if reply else ""
        self._render(f"<b>{r.name}</b>: {len(tokens)} prompt tokens{made}, "
                     f"{r.num_cached_tokens} from the cache, "
                     f"{len(tokens) - r.num_cached_tokens} to compute; blocks "
                     f"{list(r.blocks)}<br>hash chain: {chain or '(no full block)'}")
        return r

    def finish(self) -> None:
        if not self.session.running:
            self._render("no running request")
            return
        sid = self.session.finish()
        self._render(f"finished {self.session.names[sid]}: its full blocks stay cached")

    def reset(self) -> None:
        ok = self.session.reset_prefix_cache()
        self._render("prefix cache reset" if ok else
                     "reset refused: running requests still hold blocks")

    def _render(self, message: str) -> None:
        stats = self.manager.prefix_cache_stats
        self.caption.value = (f"{message}<br>hit rate so far {stats.hits}/{stats.queries} tokens"
                              f" = {stats.hit_rate:.0%}; LRU order (next victim first): "
                              f"{self.session.lru_order()}")
        running = {sid: self.session.names[sid] for sid in self.session.running}
        fig = draw_pool_and_tables(self.manager, ncols=8, labels=running, show_tokens=True)
        self.image.value = figure_png(fig, self.dpi)
