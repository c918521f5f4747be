"""Dates and times as the compiled grammar takes them (walked by xgrammar, as the engine walks
them), against Python's ``datetime`` and jsonschema's RFC 3339 check: the grammar takes a value
exactly when they do, fractions stop at 9 digits, and other schemas are left alone."""

from __future__ import annotations

import datetime
import json

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from agentd.structured.compiler import GrammarCompiler
from agentd.structured.formats import MAX_FRACTION_DIGITS, tighten_formats
from agentd.structured.params import StructuredOutputsParams

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def compiler(default_model_dir) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(default_model_dir), 49152, [2])


def taker(compiler: GrammarCompiler, fmt: str):
    grammar = compiler.compile(StructuredOutputsParams(json={"type": "string", "format": fmt}))

    def takes(value: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return bool(matcher.accept_string(json.dumps(value))) and bool(matcher.is_completed())

    return takes


def python_date(value: str) -> bool:
    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        return False
    return True


def test_dates_are_calendar_days(compiler: GrammarCompiler) -> None:
    takes = taker(compiler, "date")
    values = [f"{y:04d}-{m:02d}-{d:02d}" for y in (0, 1, 4, 100, 400, 1900, 2000, 2023, 2024,
                                                  9996, 9999)
              for m in (1, 2, 4, 9, 12) for d in (1, 28, 29, 30, 31)]
    wrong = [v for v in values if takes(v) != python_date(v)]
    assert not wrong
    assert takes("2024-02-29") and not takes("2023-02-29") and not takes("2023-04-31")


@pytest.mark.parametrize(("value", "ok"), [
    ("2023-02-03T14:42:28Z", True),
    ("2023-02-03T14:42:28." + "3" * MAX_FRACTION_DIGITS + "Z", True),
    ("2023-02-03T14:42:28." + "3" * (MAX_FRACTION_DIGITS + 1) + "Z", False),
    ("2023-02-03T14:42:28.5+05:30", True),
    ("2023-02-03T14:42:28+24:00", False),
    ("2023-02-03T14:42:2803Z", False),  # digits after the seconds need the point
    ("2023-02-30T14:42:28Z", False),
    ("2016-12-31T23:59:60Z", False),  # no leap second, as Python and jsonschema read it
    ("2023-02-03 14:42:28Z", False),
])
def test_date_times(compiler: GrammarCompiler, value: str, ok: bool) -> None:
    assert taker(compiler, "date-time")(value) is ok
    if ok:
        assert CHECKER.conforms(value, "date-time")


@pytest.mark.parametrize(("value", "ok"), [
    ("14:42:28Z", True), ("14:42:28.123456789-01:00", True), ("14:42:28.1234567891Z", False),
    ("24:00:00Z", False), ("14:42:28", False), ("14:42:2803Z", False),
])
def test_times(compiler: GrammarCompiler, value: str, ok: bool) -> None:
    assert taker(compiler, "time")(value) is ok


def test_only_plain_date_strings_change() -> None:
    schema = {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"},
        "days": {"type": "array", "items": {"type": "string", "format": "date"}},
        "own": {"type": "string", "format": "date", "pattern": "^2"},
        "mail": {"type": "string", "format": "email"},
        "format": {"type": "string"}},
        "$defs": {"t": {"anyOf": [{"type": "string", "format": "time"}, {"type": "null"}]}}}
    out = tighten_formats(schema)
    props = out["properties"]
    assert "format" not in props["when"] and props["when"]["pattern"].startswith("^")
    assert "pattern" in props["days"]["items"] and "pattern" in out["$defs"]["t"]["anyOf"][0]
    assert props["own"] == schema["properties"]["own"]  # its own pattern: left alone
    assert props["mail"] == {"type": "string", "format": "email"}
    assert props["format"] == {"type": "string"}  # a property named "format"
    assert schema["properties"]["when"] == {"type": "string", "format": "date-time"}  # a copy


@pytest.mark.parametrize(("fmt", "value", "ok"), [
    ("hostname", "api.example.com", True), ("hostname", "a" * 63 + ".com", True),
    ("hostname", "a" * 64 + ".com", False), ("hostname", "a-.com", False),
    ("ipv4", "10.0.0.1", True), ("ipv4", "255.255.255.255", True),
    ("ipv4", "82.120.026.72", False), ("ipv4", "256.1.1.1", False), ("ipv4", "1.2.3", False),
])
def test_host_names_and_addresses(compiler: GrammarCompiler, fmt: str, value: str,
                                  ok: bool) -> None:
    assert taker(compiler, fmt)(value) is ok
    assert CHECKER.conforms(value, fmt) is ok
