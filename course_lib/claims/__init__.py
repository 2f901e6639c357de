"""Published numbers beside the course's own.

* ``sources`` every number of the source articles recomputed with ``course_lib.capacity``
  (``sources_claim``: the claim type and citations; ``sources_000/001/003``: one article each)
* ``paper``   the vLLM paper's (SOSP'23) memory and throughput figures beside our simulations
* ``tuning``  the source articles' tuning table, each row replayed

Nothing is imported here on purpose: import the submodule you need.
"""
