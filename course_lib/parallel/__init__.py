"""Parallelism of the KV cache across GPUs (chapter 09): context parallelism, MLA, strategy.

* ``merge``      partial attention with its log-sum-exp, and the exact merge of the pieces
* ``launch``     spawn real ``torch.distributed`` ranks (gloo on CPU, nccl on GPUs), no hangs
* ``rank_cache`` one rank's paged KV cache: its own BlockManager and K/V tensors
* ``cp_decode``  one sequence's cache split by tokens over ranks; broadcast Q, merge the LSEs
* ``mla``        Multi-head Latent Attention: the latent cache and weight absorption
* ``strategy``   DP / DP-attention / CP compared (the tutorial's §7 table, in numbers)
* ``deployment`` one deployment (model, GPU memory, TP, CP) in numbers: ``plan``
* ``decision_tree`` the tutorial's §10 long-context decision tree: ``recommend``
* ``dcp``        vLLM's decode context parallelism (DCP) for an MLA model

Submodules load on demand (``from course_lib.parallel import merge``).
"""
