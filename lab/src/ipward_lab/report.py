"""Self-contained HTML reports: one file, no external assets (CSS inline, plots embedded
as base64 PNG), so a report can be mailed, archived or opened offline as it is.

    page = Page("ipward bench")
    page.heading("Throughput")
    page.paragraph("Each figure next to a reference measured in the same run.")
    page.table(["store", "per s"], [["SQLite", "3,960"]])
    page.figure(line_plot({"median": [(1, 0.2), (2, 0.3)]}, "x", "ms", "ADD"), "caption")
    page.write("report.html")

Every piece of text is HTML-escaped. Plots are drawn with matplotlib on its Agg
backend (no display), imported only inside the plotting functions: importing this
module loads no matplotlib, so commands that merely sit next to a report command in
`ipward.cmd.cli` (the agent, the controller) never pay for it; the CNI plugin never imports
this module at all.
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_DOTS = 60  # series with more points are drawn as lines without a dot per point
Point = tuple[float, float]

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d232a;
       max-width: 1000px; margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: .2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #d8dde3; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: .8em 0; font-variant-numeric: tabular-nums; }
th, td { padding: .25em .7em; border-bottom: 1px solid #e4e8ec; text-align: left; }
th { background: #f3f5f7; font-weight: 600; }
td.num, th.num { text-align: right; }
figure { margin: 1.2em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #e4e8ec; }
figcaption { color: #4a5560; font-size: .92em; margin-top: .3em; }
pre { background: #f6f8fa; padding: .7em; overflow-x: auto; font-size: .85em; }
"""

# A cell that reads as a figure: a number with an optional unit or ratio mark.
_NUMERIC = re.compile(r"^[-+]?\d[\d,]*(\.\d+)?(\^\d+|e[-+]?\d+)?\s*(x|%|ms|us|s|MB|MiB|KiB|/s)?$")


class Page:
    """An HTML page built from parts, in order."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._parts: list[str] = [f"<h1>{_text(title)}</h1>"]

    def heading(self, text: str, level: int = 2) -> Page:
        if not 1 <= level <= 6:
            raise ValueError(f"heading level {level}")
        self._parts.append(f"<h{level}>{_text(text)}</h{level}>")
        return self

    def paragraph(self, text: str) -> Page:
        self._parts.append(f"<p>{_text(text)}</p>")
        return self

    def preformatted(self, text: str) -> Page:
        """Text shown as it is (console output, logs)."""
        self._parts.append(f"<pre>{_text(text)}</pre>")
        return self

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Page:
        """A table; columns whose cells mostly read as figures are right-aligned."""
        width = max([len(header), *(len(r) for r in rows)])
        numeric = []
        for i in range(width):
            cells = [c for r in rows if (c := _cell(r, i))]
            figures = sum(bool(_NUMERIC.match(c)) for c in cells)
            numeric.append(bool(cells) and figures * 2 >= len(cells))
        out = ["<table>"]
        if header:
            out.append("<thead><tr>")
            out += [_td("th", _cell(header, i), numeric[i]) for i in range(width)]
            out.append("</tr></thead>")
        out.append("<tbody>")
        for row in rows:
            out.append("<tr>")
            out += [_td("td", _cell(row, i), numeric[i]) for i in range(width)]
            out.append("</tr>")
        out.append("</tbody></table>")
        self._parts.append("".join(out))
        return self

    def figure(self, image: Any, caption: str = "", alt: str = "") -> Page:
        """A plot: PNG bytes, or a matplotlib Figure (rendered to PNG, then closed)."""
        png = image if isinstance(image, bytes | bytearray) else figure_png(image)
        if not bytes(png).startswith(PNG_MAGIC):
            raise ValueError("figure: not a PNG image")
        data = base64.b64encode(png).decode("ascii")
        alt_text = _text(alt or caption or "plot")
        cap = f"<figcaption>{_text(caption)}</figcaption>" if caption else ""
        self._parts.append(
            f'<figure><img alt="{alt_text}" src="data:image/png;base64,{data}">{cap}</figure>'
        )
        return self

    def html(self) -> str:
        body = "\n".join(self._parts)
        return (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_text(self.title)}</title>\n<style>{_CSS}</style>\n</head>\n"
            f"<body>\n{body}\n</body>\n</html>\n"
        )

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the page (aside, then renamed: a reader never sees half of it)."""
        _write_atomic(path, self.html().encode("utf-8"))


def _text(value: object) -> str:
    return html.escape(str(value), quote=True)


def _cell(row: Sequence[str], i: int) -> str:
    return str(row[i]).strip() if i < len(row) else ""


def _td(tag: str, text: str, numeric: bool) -> str:
    cls = ' class="num"' if numeric else ""
    return f"<{tag}{cls}>{_text(text)}</{tag}>"


def _write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    target = os.fspath(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, target)


# -- plots ---------------------------------------------------------------------------------


@dataclass
class Panel:
    """One set of axes: `series` maps a label to its (x, y) points; `markers` are
    vertical lines at x with a label (events, faults); `xticks` name positions on x."""

    series: Mapping[str, Sequence[Point]]
    xlabel: str = ""
    ylabel: str = ""
    title: str = ""
    logx: bool = False
    logy: bool = False
    markers: Sequence[tuple[float, str]] = ()
    xticks: Sequence[tuple[float, str]] = ()
    ymin: float | None = 0.0  # None: let matplotlib choose (always with logy)
    styles: Mapping[str, str] = field(default_factory=dict)  # label -> "--", ":", ...


def line_plot(
    series: Mapping[str, Sequence[Point]],
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    markers: Sequence[tuple[float, str]] = (),
    **more: Any,
) -> bytes:
    """One line plot as PNG bytes: a line with points per series, vertical labelled
    lines at `markers`. `more`: the other fields of `Panel` (logy, xticks, ymin,
    styles)."""
    return line_plots([Panel(series, xlabel, ylabel, title, logx, markers=markers, **more)])


def line_plots(
    panels: Sequence[Panel],
    title: str = "",
    columns: int = 1,
    size: tuple[float, float] = (7.0, 3.8),
) -> bytes:
    """Panels in a grid of `columns` (each panel `size` inches), as PNG bytes."""
    if not panels:
        raise ValueError("line_plots: no panels")
    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    fig = _new_figure((size[0] * columns, size[1] * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, panel in zip(flat, panels, strict=False):
        _draw(ax, panel)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(_plain(title))
    fig.tight_layout()
    return figure_png(fig)


def _draw(ax: Any, panel: Panel) -> None:
    for label, points in panel.series.items():
        pts = sorted(points)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        dots = {"marker": "o", "markersize": 4} if len(pts) <= MAX_DOTS else {}
        ax.plot(xs, ys, panel.styles.get(label, "-"), label=_plain(label), **dots)
    if panel.logx:
        ax.set_xscale("log")
    if panel.logy:
        ax.set_yscale("log")
    elif panel.ymin is not None:
        ax.set_ylim(bottom=panel.ymin)
    if panel.xticks:
        ax.set_xticks([x for x, _ in panel.xticks])
        ax.set_xticklabels([_plain(label) for _, label in panel.xticks])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    for x, label in panel.markers:
        ax.axvline(x, color="#c0392b", linestyle="--", linewidth=1, alpha=0.8)
        ax.annotate(
            _plain(label),
            xy=(x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -2),
            textcoords="offset points",
            rotation=90,
            va="top",
            ha="left",
            fontsize=7,
            color="#c0392b",
        )
    ax.set_xlabel(_plain(panel.xlabel))
    ax.set_ylabel(_plain(panel.ylabel))
    if panel.title:
        ax.set_title(_plain(panel.title), fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    if any(panel.series.values()):
        ax.legend(fontsize=8)


def _plain(text: str) -> str:
    """Text shown as written: a `$` would start matplotlib's math notation."""
    return str(text).replace("$", r"\$")


def figure_png(fig: Any, dpi: int = 110) -> bytes:
    """A matplotlib Figure as PNG bytes; a pyplot figure is closed afterwards."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    finally:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            pyplot.close(fig)  # frees a figure pyplot keeps; ignores any other
    return buf.getvalue()


def save_png(png: bytes, path: str | os.PathLike[str]) -> None:
    if not bytes(png).startswith(PNG_MAGIC):
        raise ValueError("save_png: not a PNG image")
    _write_atomic(path, bytes(png))


def _new_figure(size: tuple[float, float]) -> Any:
    """A Figure drawn by the Agg backend (no display, no pyplot global state), with
    matplotlib imported on first use."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig


__all__ = [
    "Page",
    "Panel",
    "figure_png",
    "line_plot",
    "line_plots",
    "save_png",
]
