"""Count the lines a learner reads to answer four questions about the V0 block manager, and
how many of them are not the mechanism.

The learner has finished chapters 03, 05, 06 and 07 and reads only the five files of
docs/library.md's "learner's path". For each question, :data:`QUESTIONS` lists what one reads
to answer it: the module docstrings of the files involved, the headers of the classes involved
(the ``class`` line, the class docstring, class-level fields) and every function on the call
path (``Class.method``, or a module-level function). A name missing from a revision is
skipped (the list covers the helpers of older revisions too, e.g. ``BlockManager._get``).
Non-blank lines are counted, each line once per question (and once in the union of the four).

A line is **not the mechanism** when one of these rules, tried in this order, classifies it:

1. **undo**: a function named in :data:`UNDO_FUNCS` (all its lines); a code or comment line
   matching :data:`UNDO_WORDS`; every line of a docstring paragraph (lines between blank
   lines) of which one line matches :data:`UNDO_WORDS`;
2. **argument check**: every line of an ``assert`` statement; of an ``if`` statement without
   ``else`` whose body only raises; of any other ``raise`` statement; of a statement calling a
   ``check_*`` helper other than ``check_invariants``;
3. **speed contract**: a function named in :data:`SPEED_FUNCS` (all its lines); a code or
   comment line matching :data:`SPEED_WORDS`; every line of a docstring paragraph of which one
   line matches :data:`SPEED_WORDS`.

Usage::

    python scripts/learner_path_lines.py            # the working tree
    python scripts/learner_path_lines.py --rev HEAD  # a git revision
    python scripts/learner_path_lines.py --lines     # also print each classified line
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
M = "course_lib/memory"
COMMON, TABLE, POOL, CACHE, MANAGER = (f"{M}/common.py", f"{M}/v0/block_table.py",
                                       f"{M}/v0/pool.py", f"{M}/v0/prefix_cache.py",
                                       f"{M}/v0/manager.py")
PATH_FILES = (COMMON, TABLE, POOL, CACHE, MANAGER)

UNDO_WORDS = re.compile(r"checkpoint|rollback|\b_save\w*\(|save_items|save_stack|saved_view"
                        r"|\battach\b|on_rollback|\bundo|engine step|a failed step",
                        re.IGNORECASE)
UNDO_FUNCS = {"attach", "_save", "_save_entry", "_put_entry", "_set_leaf"}
SPEED_WORDS = re.compile(r"without a copy|no copy|not a copy|in one call|inlined"
                         r"|at any length|hot path|O\(blocks\)|O\(touched\)"
                         r"|grows? with the sequence", re.IGNORECASE)
SPEED_FUNCS = {"BlockTable.hand_out", "BlockTable.writable_blocks"}

# What one reads for each question: (file, name); "<module>" is the module docstring, a bare
# class name its header. The old revisions' helpers are listed too (skipped where absent).
_TABLE = [(TABLE, "<module>"), (TABLE, "BlockTable"), (TABLE, "BlockTable.num_tokens"),
          (TABLE, "BlockTable.num_full_blocks")]
_POOL = [(POOL, "<module>"), (POOL, "BlockAllocator"), (POOL, "BlockAllocator.__init__"),
         (POOL, "BlockAllocator.num_free_blocks"), (POOL, "BlockAllocator._save")]
_MANAGER = [(MANAGER, "<module>"), (MANAGER, "BlockManager"), (MANAGER, "BlockManager.__init__"),
            (MANAGER, "BlockManager._get"), (MANAGER, "BlockManager.num_free_gpu_blocks")]
_CACHE = [(CACHE, "<module>"), (CACHE, "PrefixCache"), (CACHE, "PrefixCache.__init__"),
          (CACHE, "PrefixCache._save")]

QUESTIONS: dict[str, list[tuple[str, str]]] = {
    "(a) append into a shared last block (copy-on-write)": _TABLE + _POOL + _MANAGER + [
        (MANAGER, "BlockManager.fork"), (TABLE, "BlockTable.copy"),
        (POOL, "BlockAllocator.touch"), (MANAGER, "BlockManager.append_slots"),
        (MANAGER, "BlockManager._append_need"), (MANAGER, "BlockManager.pool"),
        (TABLE, "BlockTable.writable_blocks"), (POOL, "BlockAllocator.allocate"),
        (POOL, "BlockAllocator.release")],
    "(b) a prefix-cache hit and its ref counts": _TABLE + _POOL + _MANAGER + _CACHE + [
        (MANAGER, "BlockManager.allocate"), (MANAGER, "BlockManager._blocks_needed"),
        (MANAGER, "BlockManager._cached_prefix"), (MANAGER, "BlockManager._evictable"),
        (MANAGER, "BlockManager.mark_blocks_as_computed"), (CACHE, "typed_salt"),
        (CACHE, "BlockKey"), (CACHE, "PrefixCache.hash_blocks"), (CACHE, "PrefixCache.key"),
        (CACHE, "PrefixCache._find"), (CACHE, "PrefixCache.match"),
        (CACHE, "PrefixCache.identity"), (CACHE, "PrefixCache.register"),
        (CACHE, "PrefixCache.insert"), (CACHE, "PrefixCache.lookup"),
        (POOL, "BlockAllocator.touch"), (POOL, "BlockAllocator.allocate_n"),
        (POOL, "BlockAllocator.allocate"), (COMMON, "<module>"), (COMMON, "PrefixCacheStats"),
        (COMMON, "PrefixCacheStats.record")],
    "(c) what is evicted first": _TABLE + _POOL + _MANAGER + _CACHE + [
        (MANAGER, "BlockManager.free"), (POOL, "BlockAllocator.release"),
        (POOL, "BlockAllocator.allocate"), (CACHE, "PrefixCache.cached_block_ids"),
        (CACHE, "PrefixCache.forget")],
    "(d) what a recompute preemption frees": _TABLE + _POOL + _MANAGER + [
        (MANAGER, "BlockManager.free"), (POOL, "BlockAllocator.release"),
        (CACHE, "PrefixCache.cached_block_ids")],
}

RULES = ("undo", "argument check", "speed contract")


def read(path: str, rev: str | None) -> str:
    if rev is None:
        return (ROOT / path).read_text(encoding="utf-8")
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


class FileIndex:
    """One file's parts (line ranges by name) and the classification of its lines."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.tree = ast.parse(text)
        self.parts: dict[str, set[int]] = {}
        self.docstring_lines: set[int] = set()
        self.why: dict[int, str] = {}                  # line number -> rule
        self._index()
        self._classify()

    @staticmethod
    def _span(node: ast.AST) -> set[int]:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return set(range(start, node.end_lineno + 1))

    def _docstring(self, body: list[ast.stmt]) -> ast.Expr | None:
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            return first
        return None

    def _index(self) -> None:
        doc = self._docstring(self.tree.body)
        self.parts["<module>"] = self._span(doc) if doc else set()
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef):
                self.parts[node.name] = self._span(node)
            elif isinstance(node, ast.ClassDef):
                header = set(range(min([node.lineno] + [d.lineno for d in node.decorator_list]),
                                   node.lineno + 1))
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        self.parts[f"{node.name}.{item.name}"] = self._span(item)
                    else:
                        header |= self._span(item)
                self.parts[node.name] = header
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                doc = self._docstring(node.body)
                if doc:
                    self.docstring_lines |= self._span(doc)

    def _mark(self, lines: set[int], rule: str) -> None:
        for n in lines:
            self.why.setdefault(n, rule)

    def _paragraphs(self) -> list[list[int]]:
        """Docstring paragraphs: runs of non-blank docstring lines."""
        out, run = [], []
        for n in sorted(self.docstring_lines) + [0]:
            if n and self.lines[n - 1].strip() and (not run or n == run[-1] + 1):
                run.append(n)
                continue
            if run:
                out.append(run)
            run = [n] if n and self.lines[n - 1].strip() else []
        return out

    def _by_words(self, words: re.Pattern, funcs: set[str], rule: str) -> None:
        for name, lines in self.parts.items():
            if name.rpartition(".")[2] in funcs or name in funcs:
                self._mark(lines, rule)
        for para in self._paragraphs():
            if any(words.search(self.lines[n - 1]) for n in para):
                self._mark(set(para), rule)
        for n, text in enumerate(self.lines, 1):
            if n not in self.docstring_lines and words.search(text):
                self._mark({n}, rule)

    def _classify(self) -> None:
        self._by_words(UNDO_WORDS, UNDO_FUNCS, "undo")
        checks: set[int] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assert | ast.Raise):
                checks |= self._span(node)
            elif isinstance(node, ast.If) and not node.orelse \
                    and all(isinstance(s, ast.Raise) for s in node.body):
                checks |= self._span(node)
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name.startswith("check_") and name != "check_invariants":
                    checks |= self._span(node)
        self._mark(checks, "argument check")
        self._by_words(SPEED_WORDS, {f.rpartition(".")[2] for f in SPEED_FUNCS}, "speed contract")

    def nonblank(self, lines: set[int]) -> set[int]:
        return {n for n in lines if self.lines[n - 1].strip()}


def count(rev: str | None, show_lines: bool) -> list[dict]:
    files = {path: FileIndex(read(path, rev)) for path in PATH_FILES}
    rows = []
    union: dict[str, set[int]] = {path: set() for path in PATH_FILES}
    for question, parts in list(QUESTIONS.items()) + [("all four (each line once)", None)]:
        read_lines: dict[str, set[int]] = {path: set() for path in PATH_FILES}
        names = []
        if parts is None:
            read_lines = union
        else:
            for path, name in parts:
                index = files[path]
                if name in index.parts:
                    read_lines[path] |= index.nonblank(index.parts[name])
                    names.append(f"{Path(path).name}:{name}")
            for path in PATH_FILES:
                union[path] |= read_lines[path]
        total = sum(len(lines) for lines in read_lines.values())
        by_rule = dict.fromkeys(RULES, 0)
        flagged = []
        for path, lines in read_lines.items():
            for n in sorted(lines):
                rule = files[path].why.get(n)
                if rule:
                    by_rule[rule] += 1
                    flagged.append(f"    {rule:<15} {Path(path).name}:{n}: "
                                   f"{files[path].lines[n - 1].strip()}")
        rows.append(dict(question=question, names=names, total=total, **by_rule,
                         flagged=flagged))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    parser.add_argument("--lines", action="store_true", help="print each classified line")
    args = parser.parse_args(argv)
    rows = count(args.rev, args.lines)
    where = args.rev or "working tree"
    print(f"Lines read on the learner's path ({where}); not mechanism = undo + argument "
          f"checks + speed contracts\n")
    print("| question | lines read | undo | argument checks | speed contracts | not mechanism |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        bad = r["undo"] + r["argument check"] + r["speed contract"]
        print(f"| {r['question']} | {r['total']} | {r['undo']} | {r['argument check']} | "
              f"{r['speed contract']} | {bad} ({bad / r['total']:.0%}) |")
    print()
    for r in rows[:-1]:
        print(f"{r['question']}: {', '.join(r['names'])}")
    if args.lines:
        for r in rows[:-1]:
            print(f"\n{r['question']}:")
            print("\n".join(r["flagged"]) or "    (none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
