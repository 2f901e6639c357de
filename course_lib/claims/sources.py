"""The source articles' capacity numbers, recomputed with course_lib.capacity.

The course grew out of three Chinese articles on vLLM's KV cache, the *source articles*
(listed in :data:`SOURCES` by number and title; learners do not need them to follow the
course). Each worked number in them that concerns KV-cache capacity becomes a
:class:`SourceClaim`: the article's value, typed in as printed, beside the course's value,
computed live by capacity.py, with a verdict and an explanation of any gap. Several of
the articles' numbers are wrong; the course shows the right one and where the article slipped,
so a learner trusts arithmetic over prose.

The claims of each article are computed in their own module (``sources_000``, ``sources_001``,
``sources_003``) on the data of ``sources_claim``; this module gathers them (:func:`audit`,
:func:`audit_table`) and re-exports the names a chapter imports from here.
"""

from __future__ import annotations

import math

from course_lib.claims.sources_000 import _source_000
from course_lib.claims.sources_001 import _source_001
from course_lib.claims.sources_003 import _source_003, mha_equivalent_kv_bytes_per_token
from course_lib.claims.sources_claim import NO_NUMBER, SOURCES, VERDICTS, SourceClaim, cite

__all__ = ["NO_NUMBER", "SOURCES", "VERDICTS", "SourceClaim", "audit", "audit_table", "cite",
           "mha_equivalent_kv_bytes_per_token"]


def audit() -> list[SourceClaim]:
    """Every audited claim, in article order, each course_value computed now."""
    return [*_source_000(), *_source_001(), *_source_003()]


def _show(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def audit_table() -> list[dict[str, str]]:
    """The audit as display rows (e.g. pandas.DataFrame(audit_table()))."""
    return [{"source": cite(c.source), "where": c.where, "claim": c.claim,
             "source_value": _show(c.source_value), "course_value": _show(c.course_value),
             "unit": c.unit, "verdict": c.verdict} for c in audit()]
