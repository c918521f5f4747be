"""String formats the grammar writes tighter than xgrammar's own, without refusing a value a
user could mean.

xgrammar's ``date-time`` and ``time`` let the fractional seconds run without end (a small model
wrote ``14:42:28.3229128789908239866...`` until ``max_tokens``), and its ``date`` takes any day
from 01 to 31 in any month (``2023-02-30``). Here those three formats become patterns of
RFC 3339 as its parsers read it; ``hostname`` gets RFC 1035's bound on a label, and ``ipv4``
loses the leading zeros that read as octal to some parsers (Python's ``ipaddress`` refuses
them, so jsonschema's check does too):

- at most 9 fractional digits (nanoseconds, the most Go, Java and .NET keep; Python keeps 6);
- real calendar days: 30 in April, 28 in February but 29 in leap years;
- years 0001-9999 and seconds 00-59: Python's ``datetime`` (and jsonschema's RFC 3339 check)
  has no year 0 and no leap second;
- host name labels of at most 63 characters (xgrammar's lets one run without end).

Invariant: only ``{"type": "string", "format": F}`` schemas without their own ``pattern`` change
(a schema with one keeps it as it was: xgrammar then follows the format), and only in the
grammar: the schema a request is checked against and its cache key stay the user's.
"""

from __future__ import annotations

from typing import Any

MAX_FRACTION_DIGITS = 9
# (written as optional digits: xgrammar 0.2.9 reads "(\.[0-9]{1,9})?" as if the dot could go)

_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_FOURS = "(0[48]|[2468][048]|[13579][26])"  # two digits, a multiple of 4 but 00
_LEAP_YEAR = f"([0-9]{{2}}{_FOURS}|{_FOURS}00)"
_DATE = (f"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
         f"|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])"
         f"|{_LEAP_YEAR}-02-29)")
_TIME = (r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
         rf"([.][0-9]{'[0-9]?' * (MAX_FRACTION_DIGITS - 1)})?"
         r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
_LABEL = "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"  # xgrammar's, at most 63 characters
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"  # no leading zero
PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$",
            "hostname": f"^{_LABEL}([.]{_LABEL})*$",
            "ipv4": f"^{_OCTET}[.]{_OCTET}[.]{_OCTET}[.]{_OCTET}$"}

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties",
                   "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames", "contains", "not", "if", "then", "else")


def tighten_formats(schema: Any) -> Any:
    """``schema`` with each string of a format in ``PATTERNS`` (at any depth) written as that
    pattern; the input is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [tighten_formats(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: tighten_formats(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = tighten_formats(out[key])
    pattern = PATTERNS.get(out.get("format")) if isinstance(out.get("format"), str) else None
    if pattern is not None and out.get("type") == "string" and "pattern" not in out:
        del out["format"]
        out["pattern"] = pattern
    return out
