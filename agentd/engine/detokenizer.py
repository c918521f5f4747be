"""Incremental detokenization for one request: token ids in, text out. Nothing else (stop
strings are the output processor's, :mod:`agentd.engine.output_processor`).

Invariant: returned text never ends inside a UTF-8 character (a token that decodes to U+FFFD waits
for the next one) and never contains a C0 control character other than tab, newline and carriage
return (nor DEL).

Why the control characters: byte-level BPE vocabularies (GPT-2's, SmolLM2's) hold one token per
byte, so the model can sample the tokens of NUL, ESC, backspace...: in SmolLM2's vocabulary 24
tokens decode to control characters, all of them single-byte tokens (NUL is token 190, ``Ā``).
No text the model is asked for contains them raw, clients choke on them (a NUL ends a C
string; ESC drives a terminal), and JSON can only carry them escaped. The token still counts
as output; its text is dropped.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the output, for leading-space handling
_DROP_CONTROLS = {code: None for code in (*range(0x20), 0x7F) if chr(code) not in "\t\n\r"}


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, one token at a time."""

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> str:
        """Decode one more token; returns the text it completes (maybe none yet)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):].translate(_DROP_CONTROLS)
