"""Fetch the released sources `make test-fidelity` runs the course beside, into a cache folder.

    python tests/fidelity/fetch.py [CACHE]          (CACHE: .fidelity-cache by default)

* vLLM 0.33.0's sdist (``vllm-0.33.0.tar.gz``, 47 MB) and vLLM 0.6.3's (for the V0 column of
  chapter 03's component table): downloaded directly (``pip download`` of an sdist would try
  to build it), from the link PyPI's simple index gives, and checked against the sha256 that
  link carries *and* the one pinned below.
* SGLang 0.5.23's wheel for CPython 3.11 / x86-64 (SGLang publishes no sdist, nor a pure
  wheel): the same way, whatever this machine is, since only its Python files are read.

Only the files the fidelity tests and the component-table check read are extracted, to
``CACHE/<name>/`` (e.g. ``.fidelity-cache/vllm-0.33.0/vllm/v1/core/block_pool.py``); chapter
13's map check reads the files its map cites from folders of their own, ``CACHE/<name>-map/``:
the harness imports the upstream modules from ``CACHE/<name>/``, and a real module there where
it expects to stub one (an SGLang host-memory pool, say) changes what it runs. The archives
stay in ``CACHE/downloads/``. A second run with everything in place does nothing (a
stamp file per source records what was extracted). Standard library only.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple/{project}/"

# The fidelity harness's modules (tests/fidelity/upstream.py loads these).
VLLM_FILES = (
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/kv_cache_metrics.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/kv_cache_spec_registry.py",
    "vllm/v1/metrics/stats.py",
    "vllm/utils/hashing.py",
    "vllm/utils/math_utils.py",
    # vLLM's V1 scheduler (upstream.load_vllm_scheduler)
    "vllm/v1/core/sched/scheduler.py",
    "vllm/v1/core/sched/interface.py",
    "vllm/v1/core/sched/output.py",
    "vllm/v1/core/sched/request_queue.py",
    "vllm/v1/core/sched/utils.py",
    "vllm/v1/core/encoder_cache_manager.py",
    "vllm/v1/request.py",
    "vllm/v1/outputs.py",
    "vllm/v1/structured_output/request.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    # its offloading connector's scheduler side and CPU manager (upstream.load_vllm_offloading)
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/v1/kv_offload/config.py",
    "vllm/v1/kv_offload/base.py",
    "vllm/v1/kv_offload/cpu/common.py",
    "vllm/v1/kv_offload/cpu/manager.py",
    "vllm/v1/kv_offload/cpu/policies/base.py",
    "vllm/v1/kv_offload/cpu/policies/lru.py",
    "vllm/v1/kv_offload/cpu/policies/factory.py",
    "vllm/distributed/kv_transfer/kv_connector/utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
)
SGLANG_FILES = (
    "sglang/srt/mem_cache/radix_cache.py",
    "sglang/srt/mem_cache/base_prefix_cache.py",
    "sglang/srt/mem_cache/cache_init_params.py",
    "sglang/srt/mem_cache/evict_policy.py",
    "sglang/srt/mem_cache/utils.py",
    "sglang/srt/mem_cache/events.py",
    "sglang/srt/mem_cache/unified_radix_cache.py",
    "sglang/srt/mem_cache/allocator/base.py",
    "sglang/srt/mem_cache/allocator/token.py",
    "sglang/srt/mem_cache/allocator/paged.py",
)


@dataclass(frozen=True)
class Source:
    name: str            # folder under the cache
    project: str         # PyPI project
    filename: str
    sha256: str          # pinned; the index's must agree
    strip: str           # leading folder of the archive's members ("" for a wheel)
    members: tuple[str, ...]


def _table_paths(column: str) -> tuple[str, ...]:
    """The vllm/ paths the component table names (tests/test_ch01_03_articles.py checks them)."""
    sys.path.insert(0, str(ROOT))
    from course_lib.viz.components import ARTICLE_COMPONENTS

    return tuple(sorted({p for row in ARTICLE_COMPONENTS
                         for p in re.findall(r"vllm/[\w/.]+", getattr(row, column))}))


def _map_paths(source: str) -> tuple[str, ...]:
    """The files chapter 13's then-and-now map cites (tests/test_ch13.py checks them):
    ``source`` "vllm" (vllm/... paths) or "sglang" (srt/... paths, under sglang/ in the wheel)."""
    sys.path.insert(0, str(ROOT))
    from course_lib.viz.kv_transfer_map import cited_paths

    paths = cited_paths()[source]
    return tuple(paths if source == "vllm" else (f"sglang/{p}" for p in paths))


def sources() -> tuple[Source, ...]:
    return (
        Source("vllm-0.33.0", "vllm", "vllm-0.33.0.tar.gz",
               "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
               "vllm-0.33.0/", VLLM_FILES + _table_paths("v1")),
        Source("vllm-0.6.3", "vllm", "vllm-0.6.3.tar.gz",
               "03e69029ad9caceaab68d5c3833ae6fe57c04be678ec37f29e9df6eaf178a9c5",
               "vllm-0.6.3/", _table_paths("v0")),
        Source("sglang-0.5.23", "sglang", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
               "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
               "", SGLANG_FILES),
        Source("vllm-0.33.0-map", "vllm", "vllm-0.33.0.tar.gz",
               "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
               "vllm-0.33.0/", _map_paths("vllm")),
        Source("sglang-0.5.23-map", "sglang", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
               "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
               "", _map_paths("sglang")),
    )


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.links[href.split("#")[0].rsplit("/", 1)[-1]] = href


def _index_link(src: Source) -> tuple[str, str]:
    """(url, sha256) of the file, from PyPI's simple index (PEP 503 HTML)."""
    with urllib.request.urlopen(INDEX.format(project=src.project), timeout=60) as r:
        parser = _Links()
        parser.feed(r.read().decode())
    href = parser.links.get(src.filename)
    if href is None:
        raise SystemExit(f"{src.filename} is not in {INDEX.format(project=src.project)}")
    url, _, fragment = href.partition("#")
    digest = fragment.removeprefix("sha256=")
    if digest != src.sha256:
        raise SystemExit(f"{src.filename}: the index says sha256={digest!r}, "
                         f"tests/fidelity/fetch.py pins {src.sha256}")
    return url, digest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(src: Source, downloads: Path) -> Path:
    path = downloads / src.filename
    if path.is_file() and _sha256(path) == src.sha256:
        return path
    url, digest = _index_link(src)
    downloads.mkdir(parents=True, exist_ok=True)
    print(f"fetching {url}", flush=True)
    with tempfile.NamedTemporaryFile(dir=downloads, delete=False) as tmp, \
            urllib.request.urlopen(url, timeout=300) as r:
        shutil.copyfileobj(r, tmp)
    got = _sha256(Path(tmp.name))
    if got != digest:
        Path(tmp.name).unlink()
        raise SystemExit(f"{src.filename}: sha256 {got} != {digest} (the index's)")
    Path(tmp.name).replace(path)
    return path


def _wanted(name: str, members: tuple[str, ...]) -> bool:
    return any(name == m or (m.endswith("/") and name.startswith(m)) for m in members)


def extract(src: Source, archive: Path, dest: Path) -> int:
    """Extract the wanted members (regular files only, no path outside ``dest``)."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    n = 0
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                if not info.is_dir() and _wanted(info.filename, src.members):
                    out = _safe(tmp, info.filename)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(z.read(info))
                    n += 1
    else:
        with tarfile.open(archive) as t:
            for info in t:
                name = info.name.removeprefix(src.strip)
                if info.isfile() and name != info.name and _wanted(name, src.members):
                    out = _safe(tmp, name)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(t.extractfile(info).read())
                    n += 1
    missing = [m for m in src.members if not m.endswith("/") and not (tmp / m).is_file()]
    if missing:
        raise SystemExit(f"{src.filename} lacks {missing}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return n


def _safe(base: Path, name: str) -> Path:
    out = (base / name).resolve()
    if not out.is_relative_to(base.resolve()):
        raise SystemExit(f"unsafe member path {name!r}")
    return out


def main(argv: list[str]) -> int:
    cache = Path(argv[1] if len(argv) > 1 else ROOT / ".fidelity-cache")
    for src in sources():
        dest = cache / src.name
        stamp = cache / f"{src.name}.json"
        want = {"file": src.filename, "sha256": src.sha256, "members": list(src.members)}
        if dest.is_dir() and stamp.is_file() and json.loads(stamp.read_text()) == want:
            continue
        archive = download(src, cache / "downloads")
        n = extract(src, archive, dest)
        stamp.write_text(json.dumps(want, indent=1))
        print(f"{src.name}: {n} files in {dest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
