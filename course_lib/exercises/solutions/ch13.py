"""Solutions of chapter 13's exercises."""

from __future__ import annotations


def blocks_to_store(block_hashes, tier, num_computed_tokens, num_new_tokens, block_size):
    # the full blocks this step completes: from the block holding its first token (it may
    # have begun in an earlier step) up to, not including, the block left partial; prompt
    # blocks only (block_hashes names them: generated tokens are not stored)
    first = num_computed_tokens // block_size
    end = min((num_computed_tokens + num_new_tokens) // block_size, len(block_hashes))
    # a block the tier already holds is not copied again; the ones after it still are
    return [i for i in range(first, end) if block_hashes[i] not in tier]


def num_new_matched_tokens(block_hashes, tier, num_tokens, gpu_hit_tokens, block_size):
    # the tier's blocks right after the GPU hit, one after another, until one is missing;
    # never the block of the last token, which is computed for the logits
    first = gpu_hit_tokens // block_size
    last = (num_tokens - 1) // block_size
    n = 0
    for i in range(first, min(last, len(block_hashes))):
        if block_hashes[i] not in tier:
            break
        n += 1
    return n * block_size


def first_forward_done(order, send_s, layer_s):
    # when each layer's K/V arrives: the k-th one sent, after k + 1 sends on one link
    arrives = [0.0] * len(order)
    for k, layer in enumerate(order):
        arrives[layer] = (k + 1) * send_s
    # the forward: layer l starts once its K/V is in and layer l - 1 is done
    done = 0.0
    for layer in range(len(order)):
        done = max(done, arrives[layer]) + layer_s
    return done
