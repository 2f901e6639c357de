"""Drawings of the course's data structures (matplotlib), one module per picture.

* ``readable``           text sizes as a reader sees them, and the sizes the course draws with
* ``block_views``        what a drawing of a block manager needs, as plain data
* ``blocks``             the physical pool as a grid beside each sequence's block table
* ``components``         the Block Manager tutorial's §3.1 components, then and now
* ``explorer``           ipywidgets explorers of a block manager (chapters 03 and 06)
* ``programs``           a 1-D Triton launch split into programs (chapter 00)
* ``capacity``           chapter 01's figures: what a KV cache costs
* ``fragmentation``      chapter 02's memory strips and breakdowns
* ``attention``          chapter 04: attention through a block table
* ``timeline``           chapter 07: who runs in each step, KV usage, preemption cost
* ``capacity_planning``  chapter 08's figures: where a GPU's memory goes, TP and block_size
* ``capacity_explorer``  chapter 08's capacity explorer widget
* ``claims_table``       the source articles' audited claims as a table
* ``parallel``           chapter 09's figures and strategy explorer
* ``serving``            chapter 10: block tables growing step by step
* ``engine_run``         chapter 11: the pool, the queues and the batch of a serving run
* ``designs``            chapter 12: the V0 design beside V1's on one trace
* ``offload``            chapter 13: where prompt tokens come from as the GPU pool shrinks, with
                         and without a CPU tier (a widget)
* ``kv_transfer_map``    chapter 13: the connector, offload and P/D modules beside vLLM's and
                         SGLang's files

Nothing is imported here: import the module that defines what you need.
"""
