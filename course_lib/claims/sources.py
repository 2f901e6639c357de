"""The source articles' capacity numbers, recomputed with course_lib.capacity.

The course grew out of three Chinese articles on vLLM's KV cache, the *source articles*
(listed in ``SOURCES`` by number and title; learners do not need them to follow the
course). Each worked number in them that concerns KV-cache capacity becomes a
``SourceClaim``: the article's value, typed in as printed, beside the course's value,
computed live by capacity.py, with a verdict and an explanation of any gap. Several of
the articles' numbers are wrong; the course shows the right one and where the article slipped,
so a learner trusts arithmetic over prose.

The claims of each article are computed in their own module (``sources_000``, ``sources_001``,
``sources_003``) on the data of ``sources_claim`` (``SourceClaim``, ``SOURCES``, ``VERDICTS``,
``NO_NUMBER``, ``cite``); this module gathers them (:func:`audit`, :func:`audit_table`).
"""

from __future__ import annotations

import math

from course_lib.claims.sources_000 import source_000_claims
from course_lib.claims.sources_001 import source_001_claims
from course_lib.claims.sources_003 import source_003_claims
from course_lib.claims.sources_claim import SourceClaim, cite


def audit() -> list[SourceClaim]:
    """Every audited claim, in article order, each course_value computed now."""
    return [*source_000_claims(), *source_001_claims(), *source_003_claims()]


def show_number(value: float) -> str:
    """A number as the audit prints it: "-" for none, thousands separated, 4 significant
    digits below 1,000."""
    if math.isnan(value):
        return "-"
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def audit_table() -> list[dict[str, str]]:
    """The audit as display rows (e.g. pandas.DataFrame(audit_table()))."""
    return [{"source": cite(c.source), "where": c.where, "claim": c.claim,
             "source_value": show_number(c.source_value),
             "course_value": show_number(c.course_value),
             "unit": c.unit, "verdict": c.verdict} for c in audit()]
