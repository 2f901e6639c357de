"""The model runner: KV-cache tensors, the block copies a step asks for, and one forward pass.

The scheduler and the block manager decide *which* blocks hold what; they hold no tensors.
The runner owns the tensors and turns their decisions into work (vLLM's ``CacheEngine`` +
``ModelRunner``):

* ``gpu_caches``: per layer ``(key_cache, value_cache)``, each ``[num_gpu_blocks, block_size,
  num_kv_heads, head_dim]`` on the model's device; ``cpu_caches``: the same shape with
  ``num_cpu_blocks`` blocks on the CPU, the swap space. The three sizes come from the same
  :class:`~course_lib.config.CacheConfig` the block manager is built from.
* :meth:`ModelRunner.execute_cache_ops`: swap-out, swap-in, then copy-on-write copies, in
  that order (the block manager's contract: a GPU block freed by a swap-out may be handed out
  again, as a swap-in target or a copy target, in the same step).
* :meth:`ModelRunner.prepare_inputs`: packs the scheduled entries into ``input_ids,
  positions [num_tokens]`` and :class:`~course_lib.model.attention.AttentionMetadata` built
  from the block ids each entry carries (context length = ``num_computed_tokens``). The
  runner never sees the block manager: the scheduler's output is all it needs.
* A hybrid model (chapter 14; ``ModelConfig.layer_types``) has several KV-cache groups
  (``kv_cache_groups``, the same ``model.config.kv_cache_groups(block_size)`` the
  ``KVCacheManager`` is built with): each entry then carries one block table per group
  (``ScheduledSeq.block_tables``), the metadata one block table and slot mapping per group,
  and the tensors are laid out as vLLM lays groups over one pool, the ``i``-th layer of every
  group on one ``(key_cache, value_cache)`` pair
  (:func:`~course_lib.model.llama.allocate_kv_caches`): a block costs one group's layers. A
  model of full attention only is one group of every layer: one pair per layer, one table.
* :meth:`ModelRunner.execute_model`: the forward; returns the logits row of each entry that
  samples. With a KV connector (``kv_connector``, V1's worker side, its step's metadata bound
  by the engine): ``start_load_kv`` and every layer's ``wait_for_layer_load`` before the
  forward, every layer's ``save_kv_layer`` and ``wait_for_save`` after it. vLLM calls the
  per-layer pair from inside each attention layer
  (``vllm/model_executor/layers/attention/kv_transfer_utils.py``); the tiny Llama runs its
  layers in one call, so the course keeps the contract (a layer's loads land before its
  attention reads the cache, its saves read what its attention wrote) without overlapping
  transfers with compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import CacheConfig
from ..kernels.backends import AttentionBackend, get_attn_backend
from ..kernels.cache_ops import swap_blocks
from ..model.attention import AttentionMetadata, make_attention_metadata
from ..model.llama import KVCache, TinyLlama, allocate_kv_caches
from ..scheduler.output import ScheduledSeq, SchedulerOutput
from .kv_connector import KVConnectorBase_V1


class ModelRunner:
    """Cache tensors + forward pass for one model (see the module docstring)."""

    def __init__(self, model: TinyLlama, cache_config: CacheConfig,
                 attn_impl: str | AttentionBackend = "auto") -> None:
        """``cache_config``: ``block_size``, ``num_gpu_blocks`` and ``num_cpu_blocks`` (0: no
        swap space) size the tensors; its other fields are the block manager's."""
        self.model = model
        self.cache_config = cc = cache_config
        self.block_size = cc.block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # the kernels, resolved once (course_lib.kernels.backends): "auto" is the compiled
        # Triton kernels on a GPU, and on a CPU the batched torch path, because Triton's
        # interpreter costs ~10 ms per token per layer just to write the cache
        self.attn = get_attn_backend(attn_impl, self.device)
        cfg = model.config
        self.kv_cache_groups = groups = cfg.kv_cache_groups(cc.block_size,
                                                            param.element_size())
        self.gpu_caches: list[KVCache] = allocate_kv_caches(
            cfg, cc.num_gpu_blocks, cc.block_size, self.dtype, self.device, groups)
        self.cpu_caches: list[KVCache] = (
            allocate_kv_caches(cfg, cc.num_cpu_blocks, cc.block_size, self.dtype, "cpu", groups)
            if cc.num_cpu_blocks else [])
        self.num_swapped_blocks = 0       # out + in, for reports
        self.num_copied_blocks = 0        # copy-on-write copies
        self.kv_connector: KVConnectorBase_V1 | None = None   # V1's worker side, if any

    def counters(self) -> tuple[int, int]:
        """(blocks swapped, blocks copied) so far (a failed step's recovery puts them back to
        the last completed step's: ``engine/recovery.Counters``)."""
        return self.num_swapped_blocks, self.num_copied_blocks

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over all its layers, K and V: every layer for a model of one
        group; a hybrid model's block is one group's layers (the pairs the groups share)."""
        pairs = {id(k) for k, _ in self.gpu_caches}                 # distinct tensors
        k = self.gpu_caches[0][0]
        return 2 * len(pairs) * k[0].numel() * k.element_size()

    # ------------------------------------------------------------------------ cache ops
    def execute_cache_ops(self, out: SchedulerOutput) -> None:
        """Swap-out, swap-in, then CoW copies, on every layer (this order is the contract)."""
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            if not self.cpu_caches:
                raise ValueError("the scheduler swapped blocks but the engine has no CPU swap "
                                 "space: set CacheConfig.num_cpu_blocks > 0")
        if out.blocks_to_swap_out:
            pairs = torch.tensor(out.blocks_to_swap_out, dtype=torch.int64)   # (gpu, cpu)
            for (gk, gv), (ck, cv) in zip(self.gpu_caches, self.cpu_caches, strict=True):
                swap_blocks(gk, ck, pairs)
                swap_blocks(gv, cv, pairs)
        if out.blocks_to_swap_in:
            pairs = torch.tensor(out.blocks_to_swap_in, dtype=torch.int64)    # (cpu, gpu)
            for (gk, gv), (ck, cv) in zip(self.gpu_caches, self.cpu_caches, strict=True):
                swap_blocks(ck, gk, pairs)
                swap_blocks(cv, gv, pairs)
        if out.blocks_to_copy:
            pairs = torch.tensor(out.blocks_to_copy, dtype=torch.int64, device=self.device)
            for key_cache, value_cache in self.gpu_caches:
                self.attn.copy_blocks(key_cache, value_cache, pairs)
        self.num_swapped_blocks += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        self.num_copied_blocks += len(out.blocks_to_copy)

    # -------------------------------------------------------------------------- forward
    def prepare_inputs(self, scheduled: Sequence[ScheduledSeq]
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed ``input_ids, positions [num_tokens]`` and the metadata of a batch.

        Entry ``e`` feeds tokens ``ctx .. ctx + e.num_tokens - 1`` of its sequence, with
        ``ctx = e.seq.num_computed_tokens`` (the scheduler's ``update`` advances it after the
        forward); ``e.block_ids`` already covers them (allocate / append_slots), and so does
        each of ``e.block_tables``, one per KV-cache group, for a hybrid model."""
        ids: list[int] = []
        positions: list[int] = []
        num_groups = len(self.kv_cache_groups)
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]   # [group][entry]
        ctx_lens, q_lens = [], []
        for e in scheduled:
            ctx, q = e.seq.num_computed_tokens, e.num_tokens
            tokens = e.seq.token_ids
            if ctx + q > len(tokens):
                raise ValueError(f"seq {e.seq.seq_id}: feeding tokens {ctx}..{ctx + q - 1} "
                                 f"but it has {len(tokens)}")
            ids += tokens[ctx:ctx + q]
            positions += range(ctx, ctx + q)
            entry_tables = e.block_tables or (e.block_ids,)
            if len(entry_tables) != num_groups:
                raise ValueError(f"seq {e.seq.seq_id}: the model has {num_groups} KV-cache "
                                 f"groups, so each entry needs one block table per group "
                                 f"(ScheduledSeq.block_tables), got {len(entry_tables)}")
            for g, table in enumerate(entry_tables):
                if len(table) * self.block_size < ctx + q:
                    group = f" (KV-cache group {g})" if g else ""
                    raise ValueError(f"seq {e.seq.seq_id}: {len(table)} blocks of "
                                     f"{self.block_size} cannot hold tokens 0..{ctx + q - 1}"
                                     f"{group}")
                tables[g].append(table)
            ctx_lens.append(ctx)
            q_lens.append(q)
        num_blocks = self.gpu_caches[0][0].shape[0] if self.gpu_caches else None
        meta = make_attention_metadata(tables[0], ctx_lens, q_lens, self.block_size,
                                       self.device, num_blocks=num_blocks,
                                       more_group_tables=tables[1:])
        return (torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device), meta)

    @torch.no_grad()
    def execute_model(self, scheduled: Sequence[ScheduledSeq]) -> dict[int, torch.Tensor]:
        """Run the forward over the batch; ``{seq_id: logits [vocab]}`` (float32, on the CPU)
        of the last fed token of each entry with ``num_candidates > 0``."""
        conn = self.kv_connector
        if conn is not None and not conn.has_connector_metadata():
            conn = None                                  # no transfers bound for this call
        if conn is not None:                             # loads land before attention reads
            conn.start_load_kv()
            for layer in range(len(self.gpu_caches)):
                conn.wait_for_layer_load(layer)
        if not scheduled:
            if conn is not None:
                conn.wait_for_save()
            return {}
        input_ids, positions, meta = self.prepare_inputs(scheduled)
        logits = self.model(input_ids, positions, self.gpu_caches, meta,
                            impl=self.attn)                           # [num_tokens, vocab]
        if conn is not None:                             # saves read what attention wrote
            for layer, kv in enumerate(self.gpu_caches):
                conn.save_kv_layer(layer, kv, meta)
            conn.wait_for_save()
        rows = meta.last_token_indices().to(logits.device)
        last = logits.index_select(0, rows).cpu()                     # [num_seqs, vocab]
        return {e.seq.seq_id: last[i] for i, e in enumerate(scheduled) if e.num_candidates}
