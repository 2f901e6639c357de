"""More plausible wrong answers, one for each rule a statement states that the chapter
modules' own wrong answers did not drop yet (see ``Exercise.rules``): each is the solution
with that one rule left out, so that the case pinning the rule must fail it.
"""

from __future__ import annotations

from course_lib.exercises.solutions import ch01, ch03, ch10, ch12


# ------------------------------------------------------------------ 1.1
def kv_bytes_missing_kv_is_one(config, tensor_parallel_size):
    """Wrong: a missing num_key_value_heads read as one head (MQA), not as MHA."""
    if "num_key_value_heads" in config or config.get("kv_lora_rank"):
        return ch01.kv_bytes_from_config(config, tensor_parallel_size)
    return ch01.kv_bytes_from_config({**config, "num_key_value_heads": 1},
                                     tensor_parallel_size)


def kv_bytes_head_dim_from_hidden(config, tensor_parallel_size):
    """Wrong: head_dim always hidden_size // num_attention_heads, even when the config says."""
    return ch01.kv_bytes_from_config({**config, "head_dim": None}, tensor_parallel_size)


def kv_bytes_two_bytes(config, tensor_parallel_size):
    """Wrong: every dtype taken as 2 bytes (float32 is 4)."""
    return ch01.kv_bytes_from_config({**config, "torch_dtype": "bfloat16"},
                                     tensor_parallel_size)


# ------------------------------------------------------------------ 1.2
def gqa_decode_unscaled(x, Wq, Wk, Wv, num_heads, num_kv_heads):
    """Wrong: the scores are not scaled by 1 / sqrt(head_dim)."""
    import torch

    head_dim, group = Wq.shape[1] // num_heads, num_heads // num_kv_heads
    K = (x @ Wk).view(len(x), num_kv_heads, head_dim)
    V = (x @ Wv).view(len(x), num_kv_heads, head_dim)
    outputs = []
    for t in range(len(x)):
        q = (x[t] @ Wq).view(num_heads, head_dim)
        outputs.append(torch.cat([torch.softmax(K[:t + 1, h // group] @ q[h], dim=0)
                                  @ V[:t + 1, h // group] for h in range(num_heads)]))
    return torch.stack(outputs), K, V


# ------------------------------------------------------------------ 1.3
def max_batch_negative(config, gpu_memory_gib, prompt_len, output_len):
    """Wrong: a model whose weights do not fit gives a negative batch, not 0."""
    got = ch01.max_batch_size(config, gpu_memory_gib, prompt_len, output_len)
    if got:
        return got
    dtype = ch01.DTYPE_BYTES[config["torch_dtype"]]
    weights = _weights(config) * dtype
    per_request = ch01.kv_bytes_from_config(config, 1) * (prompt_len + output_len)
    return (round(gpu_memory_gib * 2**30) - weights) // per_request


def max_batch_no_norms(config, gpu_memory_gib, prompt_len, output_len):
    """Wrong: forgets the RMSNorm weights (two a layer and a final one)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    dtype = ch01.DTYPE_BYTES[config["torch_dtype"]]
    extra = (2 * layers + 1) * hidden * dtype        # the bytes the norms take
    return ch01.max_batch_size(config, gpu_memory_gib + extra / 2**30, prompt_len,
                               output_len)


def _weights(config) -> int:
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layer = (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
             + 3 * hidden * config["intermediate_size"] + 2 * hidden)
    params = vocab * hidden + config["num_hidden_layers"] * layer + hidden
    return params + (0 if config.get("tie_word_embeddings") else vocab * hidden)


# ------------------------------------------------------------------ 3.2
def slots_sorted_by_id(tables, num_computed, num_new, block_size):
    """Wrong: the sequences in sorted order, not in the order of num_new."""
    order = {s: num_new[s] for s in sorted(num_new)}
    return ch03.step_slot_mapping(tables, num_computed, order, block_size)


# ------------------------------------------------------------------ 3.3
class FreshPoolFromTheTop(ch03.ToyAllocator):
    """Wrong: the stack starts as [0, 1, 2, ...], so a fresh pool gives its last block first."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free_stack = list(range(num_blocks))


class EmptyGivesNone(ch03.ToyAllocator):
    """Wrong: an empty pool returns None instead of raising."""

    def allocate(self):
        return super().allocate() if self.free_stack else None


# ------------------------------------------------------------------ 8.2
def kv_heads_no_tp_check(num_kv_heads, tensor_parallel_size):
    """Wrong: checks that the two divide one another, not that the size is at least 1."""
    tp = tensor_parallel_size
    if tp > 0 and (num_kv_heads % tp if tp <= num_kv_heads else tp % num_kv_heads):
        raise ValueError("does not divide")
    return max(1, num_kv_heads // tp) if tp else num_kv_heads


def kv_heads_only_zero_refused(num_kv_heads, tensor_parallel_size):
    """Wrong: refuses TP = 0 only; a negative size that divides the heads gives -4 for (8, -2)."""
    tp = tensor_parallel_size
    if tp == 0 or (num_kv_heads % tp if tp <= num_kv_heads else tp % num_kv_heads):
        raise ValueError(f"tensor_parallel_size={tp} cannot split {num_kv_heads} KV heads")
    return num_kv_heads // tp if tp <= num_kv_heads else 1


# ------------------------------------------------------------------ 10.1
def flatten_rows_per_entry(entries):
    """Wrong: each entry's rows counted from 0, not from where the batch has reached."""
    positions, rows = ch10.flatten_step(entries)
    return positions, [None if r is None else n - 1
                       for r, (_, _, n) in zip(rows, entries, strict=True)]


# ------------------------------------------------------------------ 12.2
def radix_token_granular(prompt, earlier, page_size):
    """Wrong: counts every matched token, not whole pages."""
    return ch12.radix_hit(prompt, earlier, 1)
