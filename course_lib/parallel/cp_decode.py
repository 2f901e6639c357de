"""Context-parallel decode over ``torch.distributed``: one sequence's KV cache split by tokens.

The "Block Manager tutorial", §5.3 and §8: each of ``cp_size`` ranks keeps a different part of
the sequence's tokens in its *own* paged cache (its own
:class:`~course_lib.memory.v0.manager.BlockManager` and its own ``key_cache`` / ``value_cache``
tensors), so one request can hold ``cp_size`` times more tokens. A decode step moves the query,
not the cache:

1. broadcast Q: the rank that runs the new token sends its query to every rank;
2. local partial attention: each rank attends over its own tokens -> ``out_r``, ``lse_r``;
3. merge: ``all_reduce(MAX)`` of the LSEs, then ``all_reduce(SUM)`` of ``exp(lse_r - max) *
   out_r`` and of ``exp(lse_r - max)`` -- the online-softmax merge of :mod:`.merge` done by
   the network. (``merge="all_gather"`` gathers every ``(out_r, lse_r)`` and calls
   :func:`~course_lib.parallel.merge.merge_partials` instead: same numbers, more bytes.)

The new token's K/V go to the rank that owns its position (``placement``): ``"contiguous"``
is the article's picture (the prompt cut in balanced ranges, new tokens on the last rank);
``"interleaved"`` deals chunks of ``interleave_size`` tokens round-robin, as vLLM's decode
context parallelism does, so every rank's cache grows during decode.

Each rank's cache is a :class:`~course_lib.parallel.rank_cache.RankKVCache`. The model is a
stand-in: a token's q, k, v come from a seeded generator (:class:`CPCase`), so
every process can rebuild the same problem and the parent can compute the one-rank answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.parallel.merge import merge_partials, split_ranges
from course_lib.parallel.rank_cache import RankKVCache
from course_lib.sizing.units import check_int

PLACEMENTS = ("contiguous", "interleaved")
MERGES = ("all_reduce", "all_gather")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class CPCase:
    """One deterministic decode problem: a prompt of ``prompt_len`` tokens, then ``num_steps``
    decode steps. Attention shapes are one layer's; ``num_gpu_blocks`` is *per rank*."""

    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 4
    num_gpu_blocks: int = 16
    prompt_len: int = 21
    num_steps: int = 3
    placement: str = "contiguous"
    interleave_size: int = 1
    dtype: str = "float64"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "block_size", "num_gpu_blocks",
                     "prompt_len", "num_steps", "interleave_size"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def token(self, position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stand-in model's ``q [num_heads, head_dim]``, ``k, v [num_kv_heads, head_dim]``
        of the token at ``position`` (the same in every process)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        q = torch.randn(self.num_heads, self.head_dim, generator=g, dtype=torch.float64)
        kv = torch.randn(2, self.num_kv_heads, self.head_dim, generator=g, dtype=torch.float64)
        q, kv = q.to(self.torch_dtype), kv.to(self.torch_dtype)
        return q, kv[0], kv[1]

    def rank_of(self, position: int, cp_size: int) -> int:
        """The rank whose cache holds the token at ``position``."""
        if self.placement == "interleaved":
            return (position // self.interleave_size) % cp_size
        if position >= self.prompt_len:
            return cp_size - 1            # contiguous: decode tokens extend the last range
        return next(r for r, (a, b) in enumerate(split_ranges(self.prompt_len, cp_size))
                    if a <= position < b)


def cp_merge(out: torch.Tensor, lse: torch.Tensor, merge: str = "all_reduce",
             group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's ``out [H, dv]``, ``lse [H]`` into the full attention, on every rank."""
    if merge == "all_gather":
        world = dist.get_world_size(group)
        outs = [torch.empty_like(out) for _ in range(world)]
        lses = [torch.empty_like(lse) for _ in range(world)]
        dist.all_gather(outs, out.contiguous(), group=group)
        dist.all_gather(lses, lse.contiguous(), group=group)
        return merge_partials(outs, lses)
    if merge != "all_reduce":
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)        # [H] global max
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)       # all empty: weights stay 0
    w = torch.exp(lse - m)                                        # [H]; empty rank: 0
    num = w[:, None] * out                                        # [H, dv]
    dist.all_reduce(num, group=group)
    dist.all_reduce(w, group=group)                               # sum_r exp(lse_r - m)
    safe = torch.where(w > 0, w, torch.ones_like(w))
    return num / safe[:, None], m + torch.log(w)


def cp_decode_step(cache: RankKVCache, seq_id: int, q: torch.Tensor, scale: float,
                   src: int = 0, merge: str = "all_reduce",
                   group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of one sequence on every rank of ``group`` (all ranks call it).

    ``q [num_heads, head_dim]``: the query on rank ``src``, a buffer of that shape elsewhere
    (overwritten by the broadcast). Returns the merged ``(out [H, d], lse [H])`` on every
    rank, equal to attention over all the sequence's tokens on one rank.
    """
    dist.broadcast(q, src=src, group=group)
    out, lse = cache.partial(seq_id, q, scale)
    return cp_merge(out, lse, merge, group)


def _device(rank: int) -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")


def run_case(case: CPCase, rank: int, cp_size: int, merge: str = "all_reduce",
             device: torch.device | str = "cpu") -> dict:
    """Prefill (each rank stores its prompt tokens) and ``num_steps`` decode steps of ``case``
    on this rank. ``cp_size == 1`` needs no process group: that is the one-rank answer.

    Returns ``outputs [num_steps, H, d]`` and ``lse [num_steps, H]`` (the merged results, on
    CPU), this rank's ``positions`` and ``block_table``, and ``bytes_sent``: bytes this rank
    put on the wire for the query broadcast and for the merge.
    """
    distributed = cp_size > 1
    cache = RankKVCache(case.num_kv_heads, case.head_dim, case.block_size, case.num_gpu_blocks,
                        case.torch_dtype, device, rank)
    mine = [p for p in range(case.prompt_len) if case.rank_of(p, cp_size) == rank]
    if mine:
        kv = [case.token(p) for p in mine]
        cache.append(0, mine, torch.stack([t[1] for t in kv]).to(device),
                     torch.stack([t[2] for t in kv]).to(device))
    outs, lses, q_bytes, merge_bytes = [], [], 0, 0
    for step in range(case.num_steps):
        pos = case.prompt_len + step
        owner = case.rank_of(pos, cp_size)
        q, k, v = (t.to(device) for t in case.token(pos))
        if rank != 0:                         # only rank 0 "ran the model" for this token
            q, k, v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if owner != 0 and distributed:        # ship the new K/V to the rank that stores them
            kv = torch.stack([k, v])
            if rank == 0:
                dist.send(kv, dst=owner)
            elif rank == owner:
                dist.recv(kv, src=0)
                k, v = kv[0], kv[1]
        if rank == owner:
            cache.append(0, [pos], k[None], v[None])
        if distributed:
            out, lse = cp_decode_step(cache, 0, q, case.scale, 0, merge)
            q_bytes += q.numel() * q.element_size() if rank == 0 else 0
            lse_values = lse.numel() * (2 if merge == "all_reduce" else 1)  # max, then sum
            merge_bytes += (out.numel() + lse_values) * out.element_size()
        else:
            out, lse = cache.partial(0, q, case.scale)
        outs.append(out.cpu())
        lses.append(lse.cpu())
    cache.check_invariants()
    return {"rank": rank, "outputs": torch.stack(outs), "lse": torch.stack(lses),
            "positions": list(cache.positions.get(0, [])),
            "block_table": cache.manager.get_block_table(0) if cache.num_tokens(0) else [],
            "bytes_sent": {"query": q_bytes, "merge": merge_bytes}}


def cp_decode_worker(rank: int, world_size: int, cases: list[CPCase],
                     merges: tuple[str, ...] = MERGES) -> list[dict]:
    """The per-rank function :func:`~course_lib.parallel.launch.launch` runs: every case with
    every merge, in order (one launch amortises the processes' start-up)."""
    device = _device(rank)
    return [run_case(case, rank, world_size, merge, device) for case in cases
            for merge in merges]


def single_rank_decode(case: CPCase) -> dict:
    """The one-rank answer: the same steps with all tokens in one cache, no process group."""
    return run_case(case, 0, 1)


TOLERANCE = {"float64": 1e-12, "float32": 1e-5}


@dataclass(frozen=True)
class CPCheck:
    """One case run on ``world_size`` real ranks, compared with the one-rank answer."""

    case: CPCase
    world_size: int
    merge: str
    max_abs_diff: float
    tokens_per_rank: tuple[int, ...]
    ranks_agree: bool
    query_bytes: int = 0      # rank 0's broadcasts of q, all steps
    merge_bytes: int = 0      # one rank's contribution to the merges, all steps

    @property
    def ok(self) -> bool:
        return self.ranks_agree and self.max_abs_diff <= TOLERANCE[self.case.dtype]

    def __str__(self) -> str:
        verdict = "match" if self.ok else "MISMATCH"
        return (f"CP={self.world_size} {self.case.placement:<11} {self.merge:<10} "
                f"{self.case.dtype}: tokens per rank {list(self.tokens_per_rank)}, "
                f"max |CP - one rank| {'<' if self.ok else '='} "
                f"{TOLERANCE[self.case.dtype] if self.ok else self.max_abs_diff:g} -> {verdict}")


def check_against_single_rank(cases: list[CPCase], world_size: int, *, backend: str = "auto",
                              timeout_s: float = 60.0, merges: tuple[str, ...] = MERGES,
                              progress: bool = False) -> list[CPCheck]:
    """Launch ``world_size`` ranks, run every case with every merge, compare with one rank
    (``progress``: a bar of the ranks that have finished, see :func:`launch`)."""
    from course_lib.parallel.launch import launch

    per_rank = launch(cp_decode_worker, world_size, (list(cases), tuple(merges)),
                      backend=backend, timeout_s=timeout_s, progress=progress)
    checks, i = [], 0
    for case in cases:
        want = single_rank_decode(case)["outputs"]
        for merge in merges:
            results = [r[i] for r in per_rank]
            i += 1
            first = results[0]["outputs"]
            agree = all(torch.equal(r["outputs"], first) for r in results)
            diff = max(float((r["outputs"] - want).abs().max()) for r in results)
            tokens = tuple(len(r["positions"]) for r in results)
            sent = results[0]["bytes_sent"]
            checks.append(CPCheck(case, world_size, merge, diff, tokens, agree,
                                  sent["query"], sent["merge"]))
    return checks
