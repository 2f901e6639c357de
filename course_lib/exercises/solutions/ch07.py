"""Solutions of chapter 07's exercises."""

from __future__ import annotations

from course_lib.sizing.units import cdiv


def prefill_chunks(prompt_len, max_num_batched_tokens, num_decoding):
    chunks, left = [], prompt_len
    while left > 0:
        chunks.append(min(left, max_num_batched_tokens - num_decoding))  # decodes go first
        left -= chunks[-1]
    return chunks


def schedule_running_and_swapped(running, swapped, num_free_gpu_blocks, num_free_cpu_blocks,
                                 block_size, preemption_mode):
    def blocks(tokens):
        return cdiv(tokens, block_size)

    def by_arrival(request):
        request_id, arrival_time, _ = request
        return arrival_time, request_id

    queue = sorted(running, key=by_arrival)        # V0 serves the oldest first
    gpu, cpu = num_free_gpu_blocks, num_free_cpu_blocks
    decoded, preempted, swapped_in = [], [], []
    while queue:
        request_id, _, computed = queue.pop(0)
        need = blocks(computed + 1) - blocks(computed)   # a new block when the last one is full
        preempted_itself = False
        while need > gpu:
            if queue:
                victim_id, _, victim_computed = queue.pop()   # the last to arrive
            else:
                victim_id, victim_computed = request_id, computed
            held = blocks(victim_computed)
            if preemption_mode == "swap" and held <= cpu:
                cpu -= held
                preempted.append((victim_id, "swap"))
            else:
                preempted.append((victim_id, "recompute"))
            gpu += held
            if victim_id == request_id:
                preempted_itself = True
                break
        if not preempted_itself:
            gpu -= need
            decoded.append(request_id)
    if not preempted:                              # swap in only in a step without victims
        for request_id, _, computed in sorted(swapped, key=by_arrival):
            if blocks(computed + 1) > gpu:         # its blocks and its next token's
                break
            gpu -= blocks(computed + 1)
            swapped_in.append(request_id)
    return decoded, preempted, swapped_in


def cheaper_preemption(num_tokens, block_size, kv_bytes_per_token, s_per_token):
    import math

    num_blocks = cdiv(num_tokens, block_size)                    # swap moves whole blocks
    one_way = (num_blocks * block_size * kv_bytes_per_token / 20e9
               + num_blocks * 2 * 32 * 4e-6)                     # bytes + one copy per K/V layer
    recompute, swap = num_tokens * s_per_token, 2 * one_way      # out, and back in
    if recompute < swap or math.isclose(recompute, swap, rel_tol=1e-9):
        return "recompute"
    return "swap"


def schedule_step(running, waiting, num_free_blocks, block_size, max_num_seqs,
                  max_num_batched_tokens):
    def blocks(tokens):
        return cdiv(tokens, block_size)

    running = [list(r) for r in running]         # [request_id, num_tokens, num_computed]
    free, budget = num_free_blocks, max_num_batched_tokens
    scheduled, preempted = [], []
    i = 0
    while i < len(running) and budget > 0:       # 1. running requests, in order
        rid, n, computed = running[i]
        num_new = min(n - computed, budget)
        need = blocks(computed + num_new) - blocks(computed)
        while need > free:                       # short: preempt the last running request
            victim = running.pop()
            free += blocks(victim[2])
            preempted.append(victim[0])
            if victim[0] == rid:
                break
        if preempted and preempted[-1] == rid:
            break
        free -= need
        budget -= num_new
        scheduled.append((rid, num_new))
        i += 1
    if not preempted:                            # 2. waiting requests, if nobody was preempted
        num_running = len(running)
        for rid, n in waiting:
            if budget == 0 or num_running == max_num_seqs:
                break
            num_new = min(n, budget)             # chunked prefill: what the budget allows
            if blocks(num_new) > free:
                break                            # first come, first served: no skipping
            free -= blocks(num_new)
            budget -= num_new
            num_running += 1
            scheduled.append((rid, num_new))
    return scheduled, preempted
