"""Traces and a model-free simulator.

- ``course_lib.sim.traces``: seeded request traces (ShareGPT-like, Alpaca-like, vLLM's random
  dataset, Poisson and bursty arrivals, multi-turn chat, few-shot, parallel sampling and beam
  search variants).
- ``course_lib.sim.static``: static (contiguous) reservation baselines like the systems before vLLM,
  and a memory-level comparison with paging (chapter 02).
- ``course_lib.sim.replay``: a cost-model replay over the real scheduler and block manager
  (chapter 07).
- ``course_lib.sim.disagg_replay``: colocated serving against prefill/decode disaggregation
  (xPyD) on the same GPUs, the same replay on every engine, one clock (chapter 13).

Nothing is imported here on purpose: import the submodule you need.
"""
