"""``agentd pins`` and ``agentd stats`` tables in an 80-column terminal: a pin's name is never
cut short, numbers are whole, and one quantity has one name in both."""

from __future__ import annotations

import re
import time

import pytest
from rich.console import Console

from agentd.cli.pins import pins_table
from agentd.cli.stats import render

NAMES = ("research_agent", "support_agent_v2", "coding_agent_with_a_long_descriptive_name")


def pin(name: str) -> dict:
    return {"name": name, "num_tokens": 2288, "num_blocks": 143, "hits": 12345,
            "tokens_served": 28243456, "ttl": 3600, "idle_s": 12.5,
            "created": time.time() - 4000, "near_misses": 3}


def stats() -> dict:
    none = {"count": 0, "p50": None, "p90": None, "p99": None}
    return {"model": "SmolLM2-135M-Instruct", "max_model_len": 8192, "uptime_s": 100.0,
            "prefix_cache_queries": 10, "prefix_cache_hits": 5, "prefix_cache_hit_rate": 0.5,
            "num_blocks_pinned": 143, "num_blocks_free": 1, "num_blocks_cached": 2,
            "num_blocks_used": 150, "num_blocks_total": 546, "num_requests_running": 0,
            "num_requests_waiting": 0, "num_requests_finished": 3, "tokens_per_s": 0.0,
            "ttft": {"hit": none, "miss": none}, "pins": [pin(n) for n in NAMES],
            "near_misses": {"total": 0, "top": [], "recent": []}}


@pytest.mark.parametrize("table", ["pins", "stats"])
def test_names_are_whole_at_80_columns_and_the_saved_tokens_have_one_name(table: str) -> None:
    console = Console(width=80, record=True, color_system=None)
    console.print(pins_table([pin(n) for n in NAMES]) if table == "pins" else render(stats()))
    text = console.export_text()
    assert "…" not in text, text
    for name in NAMES[:2]:  # usual names fit on one line
        assert re.search(rf"^\s*{name}\s+2288\s+143\s+12345\s+28243456\s", text, re.M), text
    folded = "".join(line.split()[0] for line in text.splitlines()
                     if line.strip().startswith(("coding", "_", "a_", "ame", "ve_", "e_")))
    assert NAMES[2] in folded, text  # a long one folds onto more lines, every character kept
    assert "cached" in text and "tokens saved" not in text


def test_a_ttl_too_long_to_lapse_reads_never() -> None:
    """A registry from before TTLs were bounded may hold 1e300 s: one word, not 300 digits."""
    from agentd.cli.pins import short_duration

    assert [short_duration(s) for s in (1e300, float("inf"), float("nan"), 3600, None)] == \
        ["never", "never", "never", "1h", "-"]
