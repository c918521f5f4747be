"""Near-miss cause guesses on the decoded text around the first differing token (``⟦``)."""

from __future__ import annotations

import pytest

from agentd.pins.near_miss import (
    CAUSE_DATE_TIME,
    CAUSE_TEMPLATE,
    CAUSE_TEXT,
    CAUSE_TEXT_ADDED,
    CAUSE_TOOLS,
    guess_cause,
)


@pytest.mark.parametrize(("pin_text", "request_text", "cause"), [
    ("Current time: 2025-06-0⟦1 09:30 UTC", "Current time: 2025-06-0⟦2 14:05 UTC",
     CAUSE_DATE_TIME),
    ("Today is ⟦Monday, June 2.", "Today is ⟦Tuesday, June 3.", CAUSE_DATE_TIME),
    ('<tools>\\n{"function": {"description": "⟦Search the web", "name": "web_search"',
     '<tools>\\n{"function": {"description": "⟦Fetch a page", "name": "fetch_page"',
     CAUSE_TOOLS),
    ('"properties": {"query": {"type": "string"}}, "⟦required": ["query"]',
     '"properties": {"query": {"type": "string"}}, "⟦type": "object"', CAUSE_TOOLS),
    ("end of the rules.<|im_end|>\\n<|im_start|>⟦system\\n", "end of the rules.<|im_end|>\\n"
     "<|im_start|>⟦user\\n", CAUSE_TEMPLATE),
    ("Be kind.⟦<|im_end|>\\n<|im_start|>user", "Be kind.⟦<|eot_id|><|start_header_id|>",
     CAUSE_TEMPLATE),
    ("about private individuals.⟦<|im_end|>\\n<|im_start|>user\\n",
     "about private individuals.⟦ Be terse.<|im_end|>\\n<|im_start|>user", CAUSE_TEXT_ADDED),
    ("Answer in ⟦English only.", "Answer in ⟦French only.", CAUSE_TEXT),
    ('"arguments": <args-json-object>}\\n</tool_call>\\n\\n⟦You are Quarry',
     '"arguments": <args-json-object>}\\n</tool_call>\\n\\n⟦Be brief. You are', CAUSE_TEXT),
])
def test_guess_cause(pin_text: str, request_text: str, cause: str) -> None:
    assert guess_cause(pin_text, request_text) == cause
