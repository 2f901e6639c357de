"""Readable figures: text sizes as a reader sees them, and the sizes the course draws with.

A PNG saved at ``dpi`` shows a ``pt``-point font as ``pt * dpi / 72`` image pixels. A browser at
100% zoom shows an image no wider than its area at its own size, and a CSS point is 96/72 CSS
pixels, so the text reads as ``pt * dpi / 96`` points; a wider image is scaled down to fit.
At ``EXPLORER_DPI`` (96) a figure point is a CSS point; the inline backend's 100 dpi shows it
a little larger. The course draws every text at ``MIN_FONT_PT`` (9 pt) or more and figures at
most ``MAX_WIDTH_IN`` wide (900 px at 96 dpi), so nothing is scaled down in a notebook.
``figure_png`` saves a figure as the PNG bytes the widgets show, at the dpi its caller picks.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath

MIN_FONT_PT = 9.0
EXPLORER_DPI = 96
MAX_WIDTH_IN = 9.375                    # 900 px at 96 dpi, 938 px at the inline 100 dpi
_TEXT_PATH = TextToPath()


def text_width_in(text: str, size: float, bold: bool = False) -> float:
    """Width of one line of text in inches at ``size`` points (matplotlib's default font)."""
    prop = FontProperties(size=size, weight="bold" if bold else "normal")
    return _TEXT_PATH.get_text_width_height_descent(text, prop, ismath=False)[0] / 72


def figure_texts(fig: Figure) -> list:
    """Every non-empty text a figure draws: its own (suptitle, legends), each axes' texts,
    titles and legend, and the tick and axis labels of axes that show their axis."""
    fig.draw_without_rendering()      # tick labels get their text at draw time
    texts = list(fig.texts) + [t for legend in fig.legends for t in legend.get_texts()]
    for ax in fig.axes:
        texts += [*ax.texts, ax.title, ax._left_title, ax._right_title]
        if ax.axison:
            texts += [*ax.get_xticklabels(), *ax.get_yticklabels(), ax.xaxis.label,
                      ax.yaxis.label]
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def shown_font_pt(fig: Figure, dpi: float, shown_width_px: float = 900.0) -> float:
    """The smallest text of ``fig`` as a reader sees it, in CSS points at 100% zoom, when its
    PNG at ``dpi`` is shown in an area ``shown_width_px`` CSS pixels wide (scaled down, never
    up, to fit): ``pt * dpi / 96 * scale`` (a CSS point is 96/72 CSS pixels)."""
    scale = min(1.0, shown_width_px / (fig.get_figwidth() * dpi))
    return min(t.get_fontsize() for t in figure_texts(fig)) * dpi / 96 * scale


def figure_png(fig: Figure, dpi: float = EXPLORER_DPI) -> bytes:
    """PNG bytes of ``fig`` at ``dpi`` (for ``widgets.Image``), without the matplotlib version
    stamp (the Software tag), so equal drawings give equal bytes on any install. At
    ``EXPLORER_DPI`` a figure point is a CSS point at 100% zoom."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()
