"""The source-article audit's data: which articles, how the course cites them, what a checked
claim is.

:data:`SOURCES` lists the three source articles by number and title, :func:`cite` writes a
citation, :class:`SourceClaim` is one number of an article checked against the course's, and
:class:`Sheet` collects an article's claims. The numbers themselves are recomputed one module
per article (``sources_000``, ``sources_001``, ``sources_003``); :mod:`course_lib.claims.sources`
gathers them. Import the names here from this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SOURCES = {
    "000": ("Block Manager tutorial", "vLLM KV Cache Block Manager: an in-depth tutorial"),
    "001": ("Memory optimization", "Memory optimization: KV cache management, how "
            "PagedAttention works, and memory-pool settings"),
    "003": ("PagedAttention explained", "PagedAttention explained, with tuning parameters "
            "(blog post)"),
}


def cite(source: str, where: str = "") -> str:
    """A source article as the course cites it: ``cite("003", "§2.1")`` ->
    ``'"PagedAttention explained" §2.1'``."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {sorted(SOURCES)}, got {source!r}")
    return f'"{SOURCES[source][0]}"' + (f" {where}" if where else "")


VERDICTS = ("ok", "wrong", "approx", "unit")
NO_NUMBER = math.nan  # source_value when the article gives a formula or a claim, no number


@dataclass(frozen=True)
class SourceClaim:
    """One number from a source article, checked.

    verdict: 'ok' (right, up to the article's rounding), 'approx' (close, but the article's
    reasoning or rounding hides a real gap), 'wrong' (the number does not follow), 'unit'
    (binary and decimal units mixed). source_value is NO_NUMBER (nan) when the article states a
    formula or a qualitative claim and the course supplies the number. key: a stable id.
    """

    source: str
    where: str
    claim: str
    source_value: float
    unit: str
    course_value: float
    verdict: str
    explanation: str
    key: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {sorted(SOURCES)}, got {self.source!r}")


class Sheet:
    """Collects one article's claims so each reads as a single add(...) call."""

    def __init__(self, source: str) -> None:
        self.source, self.claims = source, []

    def add(self, key: str, where: str, claim: str, source_value: float, unit: str,
            course_value: float, verdict: str, explanation: str) -> None:
        self.claims.append(SourceClaim(self.source, where, claim, float(source_value), unit,
                                     float(course_value), verdict, explanation, key))
