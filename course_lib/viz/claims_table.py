"""The source articles' audited claims as a table, for the chapters that quote those articles.

``claims_table(keys)`` picks claims from ``course_lib.claims.sources.audit()``; the
``ClaimsTable`` it returns shows as HTML in Jupyter and as aligned text in print() and in nbval's
text/plain. Only layout here: the numbers and verdicts are the audit's.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

from course_lib.claims import sources
from course_lib.claims.sources_claim import SourceClaim, cite


@dataclass(frozen=True)
class ClaimsTable:
    """Source-article claims as a table: HTML in Jupyter, aligned text in print() and in
    nbval's text/plain."""

    rows: tuple[SourceClaim, ...]

    _HEAD = ("article", "where", "claim", "article says", "course computes", "unit", "verdict")

    def _cells(self, c: SourceClaim) -> tuple[str, ...]:
        show = sources.show_number  # the audit's own number formatting, shared with audit_table()
        return (cite(c.source), c.where, c.claim, show(c.source_value),
                show(c.course_value), c.unit,
                c.verdict)

    def __str__(self) -> str:
        lines = []
        for c in self.rows:
            article, where, claim, said, computed, unit, verdict = self._cells(c)
            lines.append(f"[{c.key}] {verdict.upper()}: {article} {where}: {claim}")
            lines.append(f"    the article says {said} {unit}, "
                         f"the course computes {computed} {unit}")
            lines.append(f"    {c.explanation}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in (*self._HEAD, "why"))
        body = []
        for c in self.rows:
            cells = (*self._cells(c), c.explanation)
            body.append("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(x)}</td>"
                                         for x in cells) + "</tr>")
        return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def claims_table(keys: Iterable[str]) -> ClaimsTable:
    """The audited source-article claims with these keys, in the order given
    (ValueError if unknown)."""
    claims = {c.key: c for c in sources.audit()}
    keys = list(keys)
    unknown = [k for k in keys if k not in claims]
    if unknown:
        raise ValueError(f"unknown claim keys {unknown}; known: {sorted(claims)}")
    return ClaimsTable(tuple(claims[k] for k in keys))
