"""Solutions of chapter 01's exercises."""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_from_config(config, tensor_parallel_size):
    dtype_bytes = DTYPE_BYTES[config["torch_dtype"]]
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):                 # MLA: one latent, on every rank
        return layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * dtype_bytes
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads          # absent: MHA
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads_per_rank = max(1, kv_heads // tensor_parallel_size)   # replicated past 1
    return layers * 2 * kv_heads_per_rank * head_dim * dtype_bytes


def max_batch_size(config, gpu_memory_gib, prompt_len, output_len):
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    mlp = 3 * hidden * config["intermediate_size"]          # gate, up, down
    layer = attention + mlp + 2 * hidden                    # and two RMSNorm weights
    params = vocab * hidden + config["num_hidden_layers"] * layer + hidden   # + final norm
    if not config.get("tie_word_embeddings"):
        params += vocab * hidden                            # lm_head, unless it is the embedding
    weights = params * DTYPE_BYTES[config["torch_dtype"]]
    free = round(gpu_memory_gib * 2**30) - weights
    if free < 0:
        return 0                                            # the model does not even load
    per_request = kv_bytes_from_config(config, 1) * (prompt_len + output_len)
    return free // per_request


def decode_with_gqa_cache(x, Wq, Wk, Wv, num_heads, num_kv_heads):
    import torch

    head_dim = Wq.shape[1] // num_heads
    group = num_heads // num_kv_heads                  # query heads per KV head
    k_cache, v_cache, outputs = [], [], []
    for t in range(len(x)):
        k_cache.append((x[t] @ Wk).view(num_kv_heads, head_dim))   # only the new token
        v_cache.append((x[t] @ Wv).view(num_kv_heads, head_dim))
        K, V = torch.stack(k_cache), torch.stack(v_cache)          # [t + 1, kv heads, d]
        q = (x[t] @ Wq).view(num_heads, head_dim)
        out = []
        for h in range(num_heads):
            g = h // group                                          # its KV head
            w = torch.softmax(K[:, g] @ q[h] / head_dim**0.5, dim=0)
            out.append(w @ V[:, g])
        outputs.append(torch.cat(out))
    return torch.stack(outputs), torch.stack(k_cache), torch.stack(v_cache)
