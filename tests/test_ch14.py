"""Chapter 14: what the chapter says, checked against the library (numbers derived here, then
found in the chapter's text or stored outputs), the widget's door, and the then-and-now map
held to the files it cites.

The map's vLLM and SGLang files are read from the pinned archives in the fidelity cache
(``.fidelity-cache/downloads``, fetched by `make test-fidelity`), or from extracted sources
named by $COURSE_VLLM_SRC (holding vllm/) and $COURSE_SGLANG_SRC (holding sglang/); where
neither is there the check is skipped, and where a variable is set it fails instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from course_lib.memory.v1.kv_cache_coordinator import get_kv_cache_coordinator
from course_lib.memory.v1.kv_cache_groups import (
    get_kv_cache_groups,
    num_padding_layers,
    unify_kv_cache_spec_page_size,
)
from course_lib.memory.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from course_lib.memory.v1.kv_cache_manager import KVCacheManager
from course_lib.sizing import hybrid
from course_lib.sizing.models import FULL_ATTENTION, SLIDING_ATTENTION, get_preset
from course_lib.sizing.units import GiB, cdiv
from course_lib.viz.hybrid_tables import GrowthScenario, HybridTablesExplorer

pytestmark = pytest.mark.ch14
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "14_hybrid_models.ipynb"
DOWNLOADS = ROOT / ".fidelity-cache" / "downloads"


def cells(kind: str) -> list[str]:
    nb = json.loads(NOTEBOOK.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def markdown() -> str:
    return " ".join(" ".join(cells("markdown")).split())


def outputs() -> str:
    nb = json.loads(NOTEBOOK.read_text())
    return "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []))


def layer_specs(name: str, block_size: int = 16) -> dict:
    spec = get_preset(name)
    geometry = dict(num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim,
                    dtype_bytes=spec.dtype_bytes)
    return {f"layers.{i}": (SlidingWindowSpec(block_size, sliding_window=spec.sliding_window,
                                              **geometry) if kind == SLIDING_ATTENTION
                            else FullAttentionSpec(block_size, **geometry))
            for i, kind in enumerate(spec.per_layer_types)}


WORDS = {1: "one", 2: "two", 7: "seven", 8: "8", 10: "10", 12: "12"}


# ------------------------------------------------------------------ groups and pages
def test_the_groups_the_chapter_names_are_the_librarys():
    text = markdown()
    gpt = get_kv_cache_groups(layer_specs("gpt-oss-20b"))
    sizes = {len(g.layer_names) for g in gpt}
    assert len(gpt) == 2 and len(sizes) == 1
    assert f"make {WORDS[len(gpt)]} groups of {WORDS[sizes.pop()]}" in text
    gemma = get_kv_cache_groups(layer_specs("gemma-3-27b"))
    local = [g for g in gemma if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
    per_block = max(len(g.layer_names) for g in gemma)
    assert f"make {WORDS[len(gemma)]} groups of {per_block} pages a block" in text
    assert f"six local groups of {max(len(g.layer_names) for g in local)} or " \
           f"{min(len(g.layer_names) for g in local)} layers" in text
    assert len(local) == 6
    assert f"leave {num_padding_layers(gemma)} pages unused per block" in text
    layers = get_preset("gemma-3-27b").per_layer_types
    assert f"{layers.count(SLIDING_ATTENTION)} local and {layers.count(FULL_ATTENTION)} " \
        "global layers" in text


def test_page_size_unification_and_qwens_block_size():
    mixed = {"a": SlidingWindowSpec(16, num_kv_heads=4, head_size=128, sliding_window=1024),
             "b": FullAttentionSpec(16, num_kv_heads=8, head_size=128)}
    unified = unify_kv_cache_spec_page_size(mixed)
    ratio = mixed["b"].page_size_bytes // mixed["a"].page_size_bytes
    assert unified["a"].block_size == 16 * ratio and unified["b"].block_size == 16
    assert f"block_size 16 -> block_size {16 * ratio}" in outputs()
    qwen = get_preset("qwen3-next-80b-a3b")
    per_token = hybrid.token_bytes_per_layer(qwen)
    want = 16 * cdiv(qwen.linear_state_bytes, 16 * per_token)
    assert hybrid.kv_cache_groups(qwen, 16).block_size == want
    assert f"becomes {want} tokens" in outputs()


# ------------------------------------------------------------------ the null block
@pytest.mark.parametrize("window, block_size", [(6, 4), (128, 16), (5, 1), (3, 8)])
def test_a_window_group_holds_at_most_its_window_and_a_block(window, block_size):
    """The chapter's bound: ceil((w - 1) / block_size) + 1 blocks held in the window group,
    null entries before them, every block in the full group."""
    groups = get_kv_cache_groups({"layers.0": SlidingWindowSpec(block_size,
                                                                sliding_window=window),
                                  "layers.1": FullAttentionSpec(block_size)})
    m = KVCacheManager(block_size, 512, kv_cache_groups=groups)
    tokens = list(range(1, 300))
    m.allocate_slots(0, tokens, 0, 10)
    for computed in range(10, 298):
        m.allocate_slots(0, tokens, computed, 1)
        win, full = m.get_block_tables(0)
        held = [b for b in win if b != 0]
        assert len(held) <= cdiv(window - 1, block_size) + 1
        assert win[:len(win) - len(held)] == [0] * (len(win) - len(held))
        assert 0 not in full and len(full) == cdiv(computed + 1, block_size)
    m.check_invariants()
    assert "never holds more than `ceil((w - 1) / block_size) + 1` blocks" in markdown()


# ------------------------------------------------------------------ prefix caching
def test_a_window_hit_survives_the_eviction_of_its_early_blocks():
    """Section 4, redone: C evicts A's first two window blocks; B still hits the whole
    prompt, the window group's first entries null."""
    m = KVCacheManager(block_size=4, num_gpu_blocks=17, kv_cache_groups=get_kv_cache_groups(
        {"layers.0": SlidingWindowSpec(4, sliding_window=8), "layers.1": FullAttentionSpec(4)}))
    prompt = list(range(1, 17))
    a = list(prompt)
    m.allocate_slots(0, a, 0, len(a))
    first_window_blocks = m.get_block_tables(0)[0][:2]
    for computed in (16, 17):
        a.append(200 + computed)
        m.allocate_slots(0, a, computed, 1)
    m.free(0)
    c = list(range(500, 520))
    m.allocate_slots(2, c, 0, len(c))
    taken = {b for t in m.get_block_tables(2) for b in t}
    assert set(first_window_blocks) <= taken            # evicted: C holds them
    (window_hit, full_hit), num_hit = m.get_computed_blocks(1, prompt + [900, 901, 902])
    assert num_hit == len(prompt)
    assert [b.is_null for b in window_hit] == [True, True, False, False]
    assert not any(b.is_null for b in full_hit)
    assert f"B's hit: {num_hit} tokens; window group [0, 0," in outputs()
    blocks = " and ".join(map(str, sorted(first_window_blocks)))
    assert f"C took blocks {blocks}, A's first two window blocks" in markdown()


def test_the_fixed_point_example():
    """Section 5: alone the groups hit 4 (full) and 10 (window) tokens; together nothing;
    the minimum of their answers (4) would be wrong."""
    coordinator = get_kv_cache_coordinator(KVCacheConfig(16, (
        KVCacheGroupSpec(("w",), SlidingWindowSpec(2, sliding_window=4)),
        KVCacheGroupSpec(("f",), FullAttentionSpec(2)))))
    pool = coordinator.block_pool
    hashes = [f"block {i}".encode() for i in range(5)]
    for group, cached in ((0, [1, 3, 4]), (1, [0, 1])):
        for i in cached:
            (blk,) = pool.get_new_blocks(1)
            pool.cache_full_blocks([blk], [hashes[i]], 0, 1, group)
            pool.free_blocks([blk])
    window, full = coordinator.single_type_managers
    alone = (full.find_longest_cache_hit(hashes, 10)[1],
             window.find_longest_cache_hit(hashes, 10)[1])
    assert alone == (4, 10)
    assert coordinator.find_longest_cache_hit(hashes, 10)[1] == 0
    assert window.find_longest_cache_hit(hashes, min(alone))[1] == 0
    assert (f"full group {alone[0]} tokens, window group {alone[1]} tokens" in outputs()
            and "the coordinator's hit: 0 tokens" in outputs())
    assert f"Taking the minimum of the groups' answers ({min(alone)})" in markdown()


# ------------------------------------------------------------------ memory saved
@pytest.mark.parametrize("name, gains", [
    ("gpt-oss-20b", ("as many", "1.59x", "1.88x")),
    ("gemma-3-27b", ("0.88x", "2.30x", "4.36x")),
])
def test_the_capacity_gains_quoted_are_chapter_08s_arithmetic(name, gains):
    spec = get_preset(name)
    got = [hybrid.hybrid_capacity(spec, 40 * GiB, n).gain for n in (4096, 32_768, 131_072)]
    text = markdown()
    for gain, quoted in zip(got, gains, strict=True):
        if quoted == "as many":
            assert round(gain, 2) == 1.0
        else:
            assert f"{gain:.2f}x" == quoted and quoted in text


@pytest.mark.slow
def test_the_bench_peak_blocks_quoted_are_the_traces():
    """bench/hybrid.py's peak blocks (deterministic: a seeded trace) as the chapter quotes
    them, for gpt-oss's groups and Gemma 3's, with and without the windows."""
    spec = importlib.util.spec_from_file_location("bench_hybrid", ROOT / "bench" / "hybrid.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    trace = bench.make_trace(400)
    text = markdown()
    for kind in ("gpt-oss (2 groups)", "gemma-3 (7 groups)"):
        peak = bench.run_trace(kind, trace)[2]
        full = bench.run_trace(kind, trace, windows=False)[2]
        assert f"{peak:,} " in text and f"{full:,}" in text, (kind, peak, full)


# ------------------------------------------------------------------ the widget's door
@pytest.mark.parametrize("kwargs, message", [
    (dict(sliding_window=0), "sliding_window must be an integer >= 1, got 0"),
    (dict(block_size=6), "block_size"),
    (dict(prompt_len=3, shared_prefix=4), r"shared_prefix must be in \[0, prompt_len=3\]"),
    (dict(num_gpu_blocks=5), r"num_gpu_blocks must be in \["),
    (dict(num_decode_steps=100), "the drawing holds tables of 1..16 blocks"),
])
def test_the_widget_refuses_bad_sizes_before_building_anything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridTablesExplorer(GrowthScenario(**kwargs))


def test_the_notebook_shows_the_widget_at_its_first_step():
    """What Run All leaves: the explorer displayed, its step slider at 0 (no later cell moved
    the displayed instance)."""
    from test_viz_notebook_widgets import step_sliders

    assert "HybridTablesExplorer().widget" in "\n".join(cells("code"))
    sliders = step_sliders(NOTEBOOK)
    assert sliders and all(s["value"] == s.get("min", 0) == 0 for s in sliders), sliders


# ------------------------------------------------------------------ then and now
def map_rows() -> list[list[str]]:
    (table,) = [c for c in cells("markdown") if "## Then and now" in c]
    rows = [line for line in table.splitlines() if line.startswith("| `course_lib")]
    return [[col.strip() for col in line.strip("|").split(" | ")] for line in rows]


def cited(column: int, prefix: str) -> list[str]:
    return sorted({p for row in map_rows()
                   for p in re.findall(rf"`({prefix}/[\w/.]+\.py)`", row[column])})


def test_the_map_names_course_lib_files_that_exist():
    assert len(map_rows()) >= 6
    for path in cited(0, "course_lib"):
        assert (ROOT / path).is_file(), path
    assert len(cited(2, "vllm")) >= 7 and len(cited(3, "srt")) >= 8


class Sources:
    """Text of a released file: from an extracted tree ($VARIABLE) or the pinned archive."""

    def __init__(self, variable: str, sub: str, archive: str) -> None:
        self.root = os.environ.get(variable)
        self.sub, self.archive = sub, DOWNLOADS / archive
        if self.root is not None:
            if not (Path(self.root) / (sub or "vllm")).is_dir():
                pytest.fail(f"${variable} is set, but {self.root} holds no {sub or 'vllm'}/")
        elif not self.archive.is_file():
            pytest.skip(f"neither ${variable} nor {self.archive} (make test-fidelity)")
        elif self.archive.suffix == ".whl":
            self.zip = zipfile.ZipFile(self.archive)
        else:
            self.tar = tarfile.open(self.archive)
            self.members = {m.name.split("/", 1)[1]: m for m in self.tar.getmembers()
                            if "/" in m.name}

    def read(self, path: str) -> str | None:
        path = f"{self.sub}/{path}" if self.sub else path
        if self.root is not None:
            file = Path(self.root) / path
            return file.read_text() if file.is_file() else None
        if hasattr(self, "zip"):
            return self.zip.read(path).decode() if path in self.zip.namelist() else None
        member = self.members.get(path)
        return self.tar.extractfile(member).read().decode() if member else None


@pytest.mark.parametrize("column, prefix, variable, sub, archive", [
    (2, "vllm", "COURSE_VLLM_SRC", "", "vllm-0.33.0.tar.gz"),
    (3, "srt", "COURSE_SGLANG_SRC", "sglang",
     "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"),
], ids=["vllm", "sglang"])
def test_the_map_cites_files_and_names_that_exist(column, prefix, variable, sub, archive):
    sources = Sources(variable, sub, archive)
    for path in cited(column, prefix):
        assert sources.read(path) is not None, path
    checked = 0          # every name in parentheses right after a file is in that file
    for row in map_rows():
        for path, names in re.findall(rf"`({prefix}/[\w/.]+\.py)` \(([^)]*)\)", row[column]):
            text = sources.read(path)
            for name in re.findall(r"`(\w+)`", names):
                assert re.search(rf"\b{name}\b", text), (name, path)
                checked += 1
    assert checked >= 8
