"""Solutions of chapter 02's exercises."""

from __future__ import annotations


def split_memory(residents, holes, head_need):
    split = {"token_states": 0, "reserved": 0, "internal": 0, "external": 0, "free": 0}
    for held, tokens_now, final_len in residents:
        split["token_states"] += tokens_now            # KV already computed
        split["reserved"] += final_len - tokens_now    # held for tokens still to come
        split["internal"] += held - final_len          # held, never to be used
    free = sum(holes)
    blocked = head_need is not None and max(holes, default=0) < head_need
    split["external"] = free if blocked else 0
    split["free"] = free - split["external"]
    return split


def first_fit(num_slots, events):
    holes = [(0, num_slots)]          # (start, length), sorted by start
    got = {}                          # event index -> start (or None)
    for i, (kind, value) in enumerate(events):
        if kind == "alloc":
            got[i] = None
            for j, (start, length) in enumerate(holes):
                if length >= value:
                    got[i] = start
                    if length == value:
                        del holes[j]
                    else:
                        holes[j] = (start + value, length - value)
                    break
        else:
            start, size = got[value], events[value][1]
            holes.append((start, size))
            holes.sort()
            merged = [holes[0]]
            for s, n in holes[1:]:
                last_start, last_len = merged[-1]
                if last_start + last_len == s:
                    merged[-1] = (last_start, last_len + n)
                else:
                    merged.append((s, n))
            holes = merged
    return [start for i, start in got.items()]
