"""Published numbers beside the course's own.

* ``sources`` every number of the source articles recomputed with ``course_lib.capacity``:
  ``audit`` and ``audit_table`` gather the claims of ``sources_000``, ``sources_001`` and
  ``sources_003`` (one article each)
* ``sources_claim`` the claim type (``SourceClaim``), the articles (``SOURCES``), ``cite``
* ``paper``   the vLLM paper's (SOSP'23) memory and throughput figures beside our simulations
* ``tuning``  the source articles' tuning table, each row replayed

Nothing is imported here on purpose: import the submodule you need.
"""
