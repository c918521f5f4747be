"""``agentd bench --plot``, drawn from a real run's JSON (benchmarks/results): a person reads it
at a glance — plain, non-overlapping TTFT ticks, whole request counts, every throughput run."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from agentd.bench.plot import draw, main, plot_data_from_json  # noqa: E402

RUN = Path(__file__).parents[2] / "benchmarks" / "results" / "2026-11-30-cpu-fp32.json"


def test_a_plot_from_a_results_json_reads_at_a_glance(tmp_path: Path) -> None:
    data = plot_data_from_json(json.loads(RUN.read_text()))
    assert len(data.hits) > 50 and len(data.misses) > 5
    (curve,) = data.curves
    assert sorted(curve.warm) == [1, 8, 32] and curve.empty == {8: pytest.approx(81.5, abs=0.1)}
    fig = draw(data, "test")
    ax_ttft, ax_tput = fig.axes
    fig.canvas.draw()
    assert all(float(tick).is_integer() for tick in ax_ttft.get_yticks())  # whole requests
    low, high = ax_ttft.get_xlim()
    labels = [t for t in ax_ttft.get_xticklabels(which="both")
              if t.get_text() and low <= t.get_position()[0] <= high]
    texts = [t.get_text() for t in labels]
    assert len(texts) >= 3 and all(text.replace(".", "").isdigit() for text in texts), texts
    boxes = [t.get_window_extent() for t in labels]
    assert not any(a.overlaps(b) for a, b in combinations(boxes, 2)), texts
    empty = [line for line in ax_tput.get_lines() if "empty cache" in line.get_label()]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in empty] == \
        [([8], [pytest.approx(81.5, abs=0.1)])]
    out = tmp_path / "plot.png"
    assert main([str(RUN), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
