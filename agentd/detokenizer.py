"""Incremental detokenization and stop-string handling for one request.

Invariant: emitted text never ends inside a UTF-8 character (a token that decodes to U+FFFD waits
for the next one), never contains a stop string or a possible start of one that is not yet
resolved, and never contains a C0 control character other than tab, newline and carriage return
(nor DEL).

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
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""  # all output text decoded so far (truncated at a stop string)
        self.num_emitted_chars = 0
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> None:
        """Decode one more token; sets ``stop_reason`` when a stop string appears."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        old_len = len(self.text)
        self.text += full[len(prefix):].translate(_DROP_CONTROLS)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        longest = max(len(s) for s in self.stop)
        search_from = max(0, old_len - longest + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        self.stop_reason = stop

    def flush(self, finished: bool) -> str:
        """Text that is safe to emit now; everything left when ``finished``."""
        end = len(self.text)
        if not finished and self.stop and self.stop_reason is None:
            end -= _partial_stop_len(self.text, self.stop)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
