"""The layout's rules, checked on the real import graph of ``course_lib`` (parsed, not imported):

* no import cycle among course_lib modules, type-only imports included;
* no module imports a layer above its own (``LAYERS`` below, bottom first);
* ``memory/``, ``scheduler/`` and the other torch-free layers import no torch or triton, not
  even through another course_lib module;
* the package root holds at most 7 modules besides ``__init__.py`` / ``__main__.py``;
* inside ``memory/``, the three designs (``v0/``, ``v1/``, ``radix/``) never import one
  another's modules: each builds on the shared modules at ``memory/``'s top level only.

Each detector is first shown to trip on a small package that breaks its rule.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "course_lib"

# Bottom first. A module may import its own component and components of lower layers only.
LAYERS: list[set[str]] = [
    {"sizing"},                             # units, model specs, model-free block counting
    {"device", "capacity"},                 # facts about the machine and the models
    {"config", "sequence", "envcheck"},     # plain data everyone shares | chapter 00's check
    {"memory"},                             # block tables, pools, prefix cache, BlockManager
    {"scheduler"},                          # batching, preemption, output processing, metrics
    {"sim", "kernels"},                     # model-free simulation | torch / Triton kernels
    {"model"},                              # the tiny Llama over the kernels
    {"engine", "claims"},                   # serving engine | numbers
    {"parallel"},                           # engines and ranks on processes: context
                                            # parallelism, prefill/decode disaggregation
    {"viz"},                                # drawings and widgets
    {"exercises"},                          # checkers for the chapters' exercises
    {"__main__"},                           # the command line
]
TORCH_FREE = {"sizing", "capacity", "config", "sequence", "memory", "scheduler", "sim", "claims"}
HEAVY = {"torch", "triton"}
MAX_ROOT_MODULES = 7


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(edges, externals)``: for each module of the package at ``root``, the package modules
    it imports (anywhere in the file: top level, functions, ``if TYPE_CHECKING``) and the
    top-level names of the other packages it imports."""
    pkg = root.name
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    packages = {module_name(p, root) for p in root.rglob("__init__.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    externals: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        here = mod if mod in packages else mod.rpartition(".")[0]   # package of relative imports
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [(name, [a.name for a in node.names])]
            else:
                continue
            for name, names in targets:
                top = name.split(".")[0]
                if top != pkg:
                    externals[mod].add(top)
                    continue
                subs = [f"{name}.{n}" for n in names or [] if f"{name}.{n}" in files]
                edges[mod].update(subs)
                if names is None or len(subs) < len(names):
                    edges[mod].add(name)
    for mod in edges:
        edges[mod].discard(mod)
        unknown = edges[mod] - files.keys()
        assert not unknown, f"{mod} imports modules that do not exist: {sorted(unknown)}"
    return edges, externals


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}                     # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def component(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_edges(edges: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Imports of a component that is in a higher layer, or in another component of the same
    layer; the package's own ``__init__`` may be imported by anyone (it imports nothing)."""
    rank = {c: i for i, layer in enumerate(layers) for c in layer}
    bad = []
    for mod, targets in edges.items():
        a = component(mod)
        for target in targets:
            b = component(target)
            if a == b or b == "__init__":
                continue
            if a not in rank or b not in rank:
                bad.append(f"{mod} -> {target} (no layer for {a if a not in rank else b})")
            elif rank[b] >= rank[a]:
                bad.append(f"{mod} (layer {rank[a]}) -> {target} (layer {rank[b]})")
    return sorted(bad)


def heavy_imports(edges, externals, torch_free: set[str]) -> list[str]:
    """Torch-free modules that import torch or triton, directly or through package modules."""
    bad = []
    for mod in edges:
        if component(mod) not in torch_free:
            continue
        seen, todo = set(), [mod]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if externals[m] & HEAVY:
                path = mod if m == mod else f"{mod} -> ... -> {m}"
                bad.append(f"{path} imports {sorted(externals[m] & HEAVY)}")
            todo += edges[m]
    return sorted(bad)


DESIGNS = ("v0", "v1", "radix")     # memory/'s designs: one folder each


def cross_design_edges(edges: dict[str, set[str]], package: str,
                       designs: tuple[str, ...] = DESIGNS) -> list[str]:
    """Imports from one design folder of ``package`` (e.g. ``course_lib.memory``) into
    another design folder of it."""
    def design(mod: str) -> str | None:
        rest = mod[len(package) + 1:].split(".") if mod.startswith(package + ".") else []
        return rest[0] if rest and rest[0] in designs and len(rest) > 1 else None

    return sorted(f"{mod} -> {target}" for mod, targets in edges.items() for target in targets
                  if design(mod) and design(target) and design(mod) != design(target))


# ------------------------------------------------------------------ the detectors trip
def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_detectors_trip_on_a_package_that_breaks_each_rule(tmp_path) -> None:
    root = write_package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from .b import B\n",
        "low/b.py": "from . import a\nimport torch\n",
        "low/c.py": "def f():\n    from ..high import run\n",
        "high/__init__.py": "from .run import run\n",
        "high/run.py": "from pkg.low import b\n",
    })
    edges, externals = import_graph(root)
    assert edges["pkg.low.a"] == {"pkg.low.b"}          # a type-only import is an edge
    assert edges["pkg.high.run"] == {"pkg.low.b"}       # `from pkg.low import b`: the module
    assert edges["pkg.high"] == {"pkg.high.run"}
    cycle = find_cycle(edges)
    assert cycle is not None and set(cycle) == {"pkg.low.a", "pkg.low.b"}
    layers = [{"low"}, {"high"}]
    assert upward_edges(edges, layers) == ["pkg.low.c (layer 0) -> pkg.high.run (layer 1)"]
    assert heavy_imports(edges, externals, {"high"}) == [
        "pkg.high -> ... -> pkg.low.b imports ['torch']",
        "pkg.high.run -> ... -> pkg.low.b imports ['torch']"]
    del edges["pkg.low.a"]
    edges["pkg.low.a"] = set()
    assert find_cycle(edges) is None


def test_the_design_detector_trips_on_one_design_importing_another(tmp_path) -> None:
    root = write_package(tmp_path, {
        "__init__.py": "",
        "memory/__init__.py": "",
        "memory/common.py": "",
        "memory/v0/__init__.py": "",
        "memory/v0/manager.py": "from ..common import x\n",
        "memory/v1/__init__.py": "",
        "memory/v1/manager.py": "from ..v0.manager import BlockManager\nfrom ..common import y\n",
    })
    edges, _ = import_graph(root)
    assert cross_design_edges(edges, "pkg.memory") == [
        "pkg.memory.v1.manager -> pkg.memory.v0.manager"]


# ------------------------------------------------------------------- course_lib obeys
@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_course_lib_has_no_import_cycle(graph) -> None:
    edges, _ = graph
    assert len(edges) > 50                               # the parser saw the whole package
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_every_component_has_a_layer_and_imports_only_below_it(graph) -> None:
    edges, _ = graph
    components = {component(m) for m in edges} - {"__init__"}
    assert components == set().union(*LAYERS), "a component of course_lib has no layer"
    assert upward_edges(edges, LAYERS) == []


def test_memory_and_scheduler_import_no_torch(graph) -> None:
    edges, externals = graph
    assert heavy_imports(edges, externals, TORCH_FREE) == []
    assert externals["course_lib.engine.model_runner"] & HEAVY    # the check can see torch


def test_no_memory_design_imports_another(graph) -> None:
    edges, _ = graph
    designs = {m.split(".")[2] for m in edges if m.startswith("course_lib.memory.")
               and len(m.split(".")) > 3}
    assert designs == set(DESIGNS)                       # the detector sees every design
    assert cross_design_edges(edges, "course_lib.memory") == []


def test_the_package_root_holds_few_modules() -> None:
    modules = sorted(p.name for p in ROOT.glob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= MAX_ROOT_MODULES, modules


# ------------------------------------------------------ the learner's path, short and closed
LIBRARY_DOC = ROOT.parent / "docs" / "library.md"
PATH_FILES_MAX, PATH_LINES_MAX = 5, 990
NOT_MECHANISM_MAX = 0.10         # share of the lines read that is not the mechanism


def learners_path() -> list[str]:
    """The numbered files of docs/library.md's "learner's path", in reading order."""
    text = LIBRARY_DOC.read_text(encoding="utf-8").split("the learner's path", 1)[1]
    return re.findall(r"^\d+\. `(course_lib/[\w/]+\.py)`", text, flags=re.M)


def test_the_block_managers_path_is_five_short_files_that_import_nothing_else(graph) -> None:
    """Allocate / append / free with prefix caching in the paper's design reads in at most 5
    files and under 1,000 lines, listed in docs/library.md, and BlockManager needs no other
    module of memory/ (what it imports from memory/ is on the path)."""
    edges, _ = graph
    files = learners_path()
    assert 1 < len(files) <= PATH_FILES_MAX, files
    lines = sum(len((ROOT.parent / f).read_text().splitlines()) for f in files)
    assert lines <= PATH_LINES_MAX, f"the learner's path is {lines} lines"
    on_path = {f[:-3].replace("/", ".") for f in files}
    todo, seen = ["course_lib.memory.v0.manager"], set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        todo += [m for m in edges[mod] if m.startswith("course_lib.memory.")]
    assert "course_lib.memory.v0.manager" in on_path
    assert seen - {"course_lib.memory", "course_lib.memory.v0"} <= on_path, sorted(seen - on_path)


def test_the_block_manager_chapters_point_at_exactly_the_learners_path() -> None:
    """Chapters 03, 05, 06 and 07 send the learner into the library's block manager through
    the files of the learner's path, and through no other file of memory/."""
    files = set(learners_path())
    named: set[str] = set()
    for chapter in ("03_blocks_and_tables", "05_copy_on_write", "06_prefix_caching",
                    "07_scheduling_and_preemption"):
        nb = json.loads((ROOT.parent / "notebooks" / f"{chapter}.ipynb").read_text())
        text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        found = set(re.findall(r"course_lib/memory/[\w/]+\.py", text))
        assert found, f"{chapter} names no file of the block manager"
        assert found <= files, f"{chapter} names {sorted(found - files)}, not on the path"
        named |= found
    assert named == files, f"no chapter names {sorted(files - named)}"


# ----------------------------------------- the learner's path holds the mechanism, measured
def learner_path_lines():
    """``scripts/learner_path_lines.py`` as a module (scripts/ is not a package)."""
    import importlib.util

    path = ROOT.parent / "scripts" / "learner_path_lines.py"
    spec = importlib.util.spec_from_file_location("learner_path_lines", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_line_classifier_trips_on_undo_checks_and_speed_contracts():
    lpl = learner_path_lines()
    index = lpl.FileIndex('''"""A pool.

Inside an engine step the checkpoint saves
what it changes.

Blocks are held or free.
"""


class Pool:
    def take(self, n):
        """n blocks."""
        if n < 0:
            raise ValueError(n)
        assert n <= self.free
        self._save(n)
        out = self.blocks
        return out

    def hand_out(self):
        """The list itself, without a copy."""
        return self.blocks
''')
    why = {n: index.why.get(n) for n in range(1, len(index.lines) + 1)}
    assert [why[n] for n in (3, 4, 6)] == ["undo", "undo", None]      # a paragraph, not all
    assert [why[n] for n in range(12, 18)] == [None, "argument check", "argument check",
                                               "argument check", "undo", None]
    assert why[20] == why[22] == "speed contract"


def test_the_learners_path_is_the_mechanism_as_docs_library_md_says():
    """For each of the four questions (and all four together), at most 10% of the lines read
    are undo code, argument checks or speed contracts; docs/library.md prints the script's
    table as it is now."""
    lpl = learner_path_lines()
    rows = lpl.count(None, False)
    assert len(rows) == 5 and all(r["total"] > 100 for r in rows)     # the script read them
    doc = LIBRARY_DOC.read_text(encoding="utf-8")
    for r in rows:
        bad = r["undo"] + r["argument check"] + r["speed contract"]
        assert bad <= NOT_MECHANISM_MAX * r["total"], (r["question"], bad, r["flagged"])
        line = (f"| {r['question']} | {r['total']} | {r['undo']} | {r['argument check']} | "
                f"{r['speed contract']} | {bad} ({bad / r['total']:.0%}) |")
        assert line in doc, f"docs/library.md does not print: {line}"
