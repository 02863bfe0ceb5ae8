"""The reports' plots, drawn by matplotlib on its Agg backend. A system test: on its first
run on a machine, matplotlib lists the machine's fonts with a process (`fc-list`) and
keeps the list in its cache (MPLCONFIGDIR, else under XDG_CACHE_HOME); the unit layer
starts none (the page itself: `tests/unit/test_bench_parts.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipward_lab.report import PNG_MAGIC, Page, Panel, line_plot, line_plots, save_png


def test_a_plot_with_markup_in_its_labels_is_embedded_escaped(tmp_path: Path) -> None:
    png = line_plot(
        {"median <ms>": [(1.0, 2.0), (2.0, 3.0)], "$p99$": [(1.0, 4.0)]},
        "x & y",
        "ms",
        "title <b>",
        logx=True,
        markers=[(1.5, "fault: <kill> $x")],
        xticks=[(1.0, "/24"), (2.0, "/8")],
    )
    assert png.startswith(PNG_MAGIC)
    page = Page("plots")
    page.figure(png, "caption <i>")
    path = tmp_path / "page.html"
    page.write(path)
    text = path.read_text()
    assert text.count('src="data:image/png;base64,') == 1 and "caption &lt;i&gt;" in text


def test_panels_and_save_png(tmp_path: Path) -> None:
    many = [(float(t), float(t % 7)) for t in range(500)]  # a time series: no dots
    png = line_plots(
        [
            Panel({"allocations/s": many}, "s", "per s", markers=[(100.0, "kill agent")]),
            Panel({"errors": many[:10]}, "s", "count", logy=True, ymin=None),
            Panel({}, "s", "nothing yet"),
        ],
        title="sim",
        columns=2,
    )
    save_png(png, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes() == png
    with pytest.raises(ValueError):
        save_png(b"not a png", tmp_path / "q.png")
    with pytest.raises(ValueError):
        line_plots([])
