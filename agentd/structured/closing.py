"""The shortest way from a grammar state to the end of its grammar (closing).

A constrained request near its token budget is closed along this way (``agentd.structured.
matchers``), and its length is the estimate of what closing costs. The search is Dijkstra's over
the text the grammar accepts next, one character a step: where the grammar forces text, the
whole forced text is one step, costing the tokens it takes; a free character costs one; the goal
is a state where the output may end (the stop token is allowed).

It runs on a shadow matcher: the same grammar compiled for a vocabulary of one token per byte
value and a stop token (``agentd.structured.forced``), fed the request's output bytes; the next
characters it tries are the printable ASCII ones. Its masks are a few words (a mask
of the model's vocabulary can take milliseconds in a state xgrammar has no cache for), and
xgrammar fills the masks of all of a state's next characters in one call
(``traverse_draft_tree``).

States cannot be compared (xgrammar exposes no key for a parser state), so each is known by a
signature: its mask, which characters may come next and whether it may end. The search uses it
three ways:

- Branches: a state's next characters are grouped by the signature they lead to, and one
  character of each group is tried (a string's letters are one group). Groupings are cached per
  grammar and signature.
- Loops: a state whose signature was reached already since the same forced text (at no greater
  cost: Dijkstra's order) is not searched again; an escape in a string leads back into it. A
  character that keeps its state's signature (content) is always followed, because counted
  repetitions look alike (``[0-9]{4}``, a ``minLength``), until ``MAX_STALE_RUN`` states of
  the run have led nowhere new.
- Content: the characters that keep the signature. Writing them leaves the way out as it was
  (a string's letters, a fraction's digits), so a caller may reuse a result while only content
  is written.

Forced text is walked a byte at a time, at most ``MAX_FORCED_BYTES`` a step, and a way longer
than ``MAX_WAY_BYTES`` is not followed: a grammar that forces text without end cannot hold a
search.

Invariant: a search only reads forks of the shadow matcher, and every way it returns was walked
by the grammar; a search that reaches ``MAX_NODES`` states without finding one returns None.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from agentd.structured.forced import ALPHABET, SHADOW_VOCAB, STOP, forced_run, forced_text

MAX_NODES = 8192  # states a search may reach before it gives up (~25 us each)
MAX_BRANCHES = 16  # groups of next characters tried from one state
MAX_STALE_RUN = 16  # content followed this far past the last state that led anywhere new
MAX_VISITS = 10  # if nothing is found, a state that looks like one already searched from is
# searched from again, this often, on a way through it: a counted repetition of a rule hides
# its count from the search (an IPv4 address's octets look alike)
MAX_WAY_BYTES = 4096  # a way this long is not followed further: it would cost more tokens than
# any budget a request is closed within (closing is planned tens of tokens before the end)
MAX_TOKEN_BYTES = 32
MIN_SEGMENT_BYTES = 2  # forced text this long starts a new segment (a key, a separator)
_CACHED_GRAMMARS = 64
_CACHED_GROUPINGS = 4096  # per grammar


@dataclass(frozen=True)
class Closing:
    """The shortest way found from a state to the end of the output.

    ``text``: what to write, then the stop token. ``num_tokens``: the tokens that takes, the stop
    token included (``text`` as greedy longest matches in the vocabulary). ``contents``: for
    states along the way, (offset in ``text``, the bytes that keep that state's signature, as a
    bitset): writing those bytes there leaves the rest of the way open.
    """

    text: bytes
    num_tokens: int
    contents: tuple[tuple[int, int], ...] = ()

    @property
    def content(self) -> int:
        """The content bytes of the state the way starts from (0 if not known)."""
        return next((c for offset, c in self.contents if offset == 0), 0)

    def after(self, written: bytes, vocab: Vocab, exact: bool = False) -> Closing | None:
        """The way on once ``written`` has been written from its start: the rest of it, if
        ``written`` follows it, or (unless ``exact``) the same rest if ``written`` leaves it at
        a state only to write that state's content; else None (a new search is due)."""
        if self.text.startswith(written):
            return self._from(len(written), vocab)
        if exact:
            return None
        for offset, content in reversed(self.contents):
            if (offset <= len(written) and written.startswith(self.text[:offset])
                    and _only(written[offset:], content)):
                return self._from(offset, vocab)
        return None

    def _from(self, offset: int, vocab: Vocab) -> Closing:
        if offset == 0:
            return self
        text = self.text[offset:]
        return Closing(text, vocab.num_tokens(text) + 1,
                       tuple((o - offset, c) for o, c in self.contents if o >= offset))


class _Grouping(NamedTuple):
    firsts: tuple[bytes, ...]  # one character per group of next characters
    content: int  # bitset of the characters that keep the signature


class _Node(NamedTuple):
    cost: int
    seq: int
    text: bytes
    segment: int  # the forced text the way went through last
    sig: bytes
    key: tuple  # (sig, the parser's items, segment): states with one key are taken as one
    stale: int  # content run: states since one that led anywhere new
    parent: _Node | None


_UNKNOWN: Any = object()


@dataclass
class _Entry:
    """A grammar (held, so that its id is not reused while the entry lives), its compilation
    for the shadow vocabulary, its groupings, and the way out of its start."""

    grammar: Any
    shadow: Any
    groupings: OrderedDict[bytes, _Grouping] = field(default_factory=OrderedDict)
    start: Any = _UNKNOWN


class Vocab:
    """The model's token ids by their bytes, as the grammar engine decodes them."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.token_bytes = [decoded_vocab[i] if i < len(decoded_vocab) else b""
                            for i in range(vocab_size)]
        self.index: dict[bytes, int] = {}
        for token_id, data in enumerate(self.token_bytes):
            if data and data not in self.index:
                self.index[data] = token_id
        self._byte_sets: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._content_masks: OrderedDict[int, torch.Tensor] = OrderedDict()

    def text(self, token_ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes[t] for t in token_ids if 0 <= t < self.vocab_size)

    def longest(self, text: bytes, row: torch.Tensor | None = None) -> int | None:
        """The token of the longest start of ``text`` (that ``row``, a bitmask row, allows)."""
        for end in range(min(len(text), MAX_TOKEN_BYTES), 0, -1):
            token_id = self.index.get(text[:end])
            if token_id is not None and (row is None or allowed(row, token_id)):
                return token_id
        return None

    def prefix_ids(self, text: bytes) -> list[int]:
        """The tokens whose bytes are a start of ``text``."""
        ids = (self.index.get(text[:end]) for end in range(1, min(len(text), MAX_TOKEN_BYTES) + 1))
        return [t for t in ids if t is not None]

    def num_tokens(self, text: bytes) -> int:
        """Tokens of ``text`` taken as greedy longest matches."""
        count = 0
        while text:
            token_id = self.longest(text)
            text = text[len(self.token_bytes[token_id]):] if token_id is not None else text[1:]
            count += 1
        return count

    def content_mask(self, content: int) -> torch.Tensor:
        """A bitmask row (int32 words) allowing exactly the tokens made only of bytes in
        ``content`` (an ASCII bitset)."""
        mask = self._content_masks.get(content)
        if mask is None:
            low, high, other = self._token_byte_sets()
            keep = ((low & ~np.uint64(content & (2**64 - 1))) == 0) & \
                ((high & ~np.uint64((content >> 64) & (2**64 - 1))) == 0) & ~other
            words = np.zeros(-(-self.vocab_size // 32) * 4, dtype=np.uint8)
            bits = np.packbits(keep, bitorder="little")
            words[:len(bits)] = bits
            mask = torch.from_numpy(words.view(np.int32).copy())
            self._content_masks[content] = mask
            while len(self._content_masks) > 16:
                self._content_masks.popitem(last=False)
        return mask

    def _token_byte_sets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per token: its ASCII bytes as two 64-bit sets, and whether it has another byte (or
        none at all)."""
        if self._byte_sets is None:
            low = np.zeros(self.vocab_size, dtype=np.uint64)
            high = np.zeros(self.vocab_size, dtype=np.uint64)
            other = np.zeros(self.vocab_size, dtype=bool)
            for token_id, data in enumerate(self.token_bytes):
                bits = 0
                for byte in set(data):
                    bits |= 1 << byte
                low[token_id] = bits & (2**64 - 1)
                high[token_id] = (bits >> 64) & (2**64 - 1)
                other[token_id] = not data or bits >> 128 != 0
            self._byte_sets = (low, high, other)
        return self._byte_sets


class ClosingSearch:
    """Shadow matchers and shortest ways to the end of their grammars (see the module
    docstring); one per engine, used on the engine thread."""

    def __init__(self, vocab: Vocab) -> None:
        import xgrammar as xgr

        self.vocab = vocab
        info = xgr.TokenizerInfo(list(SHADOW_VOCAB), vocab_type=xgr.VocabType.RAW,
                                 stop_token_ids=[STOP])
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._mask = xgr.allocate_token_bitmask(1, len(SHADOW_VOCAB))
        self._mask_np = self._mask.numpy()
        self._grammars: OrderedDict[int, _Entry] = OrderedDict()
        self.num_searches = 0
        self.num_nodes = 0

    def shadow(self, grammar: Any) -> Any:
        """A fresh shadow matcher for ``grammar`` (a grammar compiled for the model)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self._entry(grammar).shadow)

    def forced_text(self, shadow: Any) -> str:
        """The text ``shadow``'s grammar forces next (bounded: ``agentd.structured.forced``)."""
        return forced_text(shadow, self._mask)

    def search(self, shadow: Any, grammar: Any, at_start: bool = False) -> Closing | None:
        """The shortest way from ``shadow``'s state to the end of ``grammar``; None if none was
        found within ``MAX_NODES`` states. ``at_start``: the shadow has accepted nothing (the
        result is kept per grammar: every request of an agent starts there)."""
        entry = self._entry(grammar)
        if at_start and entry.start is not _UNKNOWN:
            return entry.start
        found = self._search(shadow, entry.groupings, 1)
        if found is None:  # a counted repetition of a rule (hidden count) may need states again
            found = self._search(shadow, entry.groupings, MAX_VISITS)
        if at_start:
            entry.start = found
        return found

    def _search(self, shadow: Any, groupings: OrderedDict[bytes, _Grouping],
                max_visits: int) -> Closing | None:
        self.num_searches += 1
        walker = shadow.fork()
        root_pos = _position(walker)
        forced, sig = forced_run(walker, self._mask)
        root = _Node(self.vocab.num_tokens(forced), 0, forced, 0, sig,
                     (sig, _items(walker, root_pos), 0), 0, None)
        self._grouping(walker, sig, groupings)
        if forced:
            walker.rollback(len(forced))
        segments: dict[bytes, int] = {}
        visits = Counter([root.key])
        seq = itertools.count(1)
        heap = [root]
        num_nodes = 1
        while heap and num_nodes < MAX_NODES:
            node = heapq.heappop(heap)
            if _may_end(node.sig):
                self.num_nodes += num_nodes
                return Closing(node.text, self.vocab.num_tokens(node.text) + 1,
                               _contents(node, groupings))
            children = self._children(walker, node, root_pos, groupings, segments, seq)
            num_nodes += len(children)
            fresh = [c for c in children if not visits[c.key]]
            stale = 0 if fresh else node.stale + 1
            for child in children:
                again = visits[child.key]  # a state that looks like one searched from
                if child.sig == node.sig and again:
                    ok = stale <= MAX_STALE_RUN  # content that shows no progress
                else:
                    ok = again < max_visits and _times_on_way(child.key, node) < max_visits
                if ok:
                    visits[child.key] += 1
                    heapq.heappush(heap, child._replace(stale=stale))
        self.num_nodes += num_nodes
        return None

    def _children(self, walker: Any, node: _Node, root_pos: int,
                  groupings: OrderedDict[bytes, _Grouping],
                  segments: dict[bytes, int], seq: Any) -> list[_Node]:
        """One child per group of next characters, with the text the grammar then forces (none
        past ``MAX_WAY_BYTES``)."""
        if len(node.text) >= MAX_WAY_BYTES or node.text and not walker.accept_string(node.text):
            return []
        children = []
        for char in self._grouping(walker, node.sig, groupings).firsts:
            if not walker.accept_string(char):
                continue
            forced, sig = forced_run(walker, self._mask)
            items = _items(walker, root_pos)
            walker.rollback(1 + len(forced))
            segment = node.segment
            if len(forced) >= MIN_SEGMENT_BYTES:
                segment = segments.setdefault(forced, len(segments) + 1)
            children.append(_Node(node.cost + 1 + self.vocab.num_tokens(forced), next(seq),
                                  node.text + char + forced, segment, sig,
                                  (sig, items, segment), 0, node))
        if node.text:
            walker.rollback(1)
        return children

    def _sig(self, walker: Any) -> bytes:
        walker.fill_next_token_bitmask(self._mask, 0)
        return self._mask_np.tobytes()

    def _grouping(self, walker: Any, sig: bytes,
                  groupings: OrderedDict[bytes, _Grouping]) -> _Grouping:
        """The groups of next characters of ``walker``'s state (cached by its ``sig``); the
        last character of each group stands for it (``z`` and ``9``, not ``0``: a year 0000
        or an all-digit host name are valid to the grammar but not to many parsers)."""
        grouping = groupings.get(sig)
        if grouping is not None:
            groupings.move_to_end(sig)
            return grouping
        legal = [i for i in range(len(ALPHABET)) if _bit(sig, i)]
        lasts: dict[bytes, bytes] = {}
        content = 0
        for i, child_sig in zip(legal, self._child_sigs(walker, legal), strict=True):
            lasts[child_sig] = ALPHABET[i]
            if child_sig == sig:
                content |= 1 << ALPHABET[i][0]
        grouping = _Grouping(tuple(lasts.values())[-MAX_BRANCHES:], content)
        groupings[sig] = grouping
        while len(groupings) > _CACHED_GROUPINGS:
            groupings.popitem(last=False)
        return grouping

    def _child_sigs(self, walker: Any, token_ids: list[int]) -> list[bytes]:
        """The signature after each of ``token_ids`` (characters the state allows): one
        ``traverse_draft_tree`` call over the tree of the state and its children."""
        import xgrammar as xgr

        num = len(token_ids)
        if num == 0:
            return []
        first_child = torch.full((num + 1,), -1, dtype=torch.int64)
        first_child[0] = 1
        next_sibling = torch.full((num + 1,), -1, dtype=torch.int64)
        next_sibling[1:num] = torch.arange(2, num + 1)
        tokens = torch.tensor([0, *token_ids], dtype=torch.int64)
        masks = xgr.allocate_token_bitmask(num + 1, len(SHADOW_VOCAB))
        walker.traverse_draft_tree(first_child, next_sibling, tokens, masks)
        rows = masks.numpy()
        return [rows[i].tobytes() for i in range(1, num + 1)]

    def _entry(self, grammar: Any) -> _Entry:
        entry = self._grammars.get(id(grammar))
        if entry is None or entry.grammar is not grammar:
            entry = _Entry(grammar, self._compiler.compile_grammar(grammar.grammar))
            self._grammars[id(grammar)] = entry
            while len(self._grammars) > _CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(id(grammar))
        return entry


_ITEM = re.compile(r"rule_id=(-?\d+), sequence_id=(-?\d+), element_id=(-?\d+), "
                   r"rule_start_pos=(-?\d+), sub_element_id=(-?\d+)")
_STEPS = re.compile(r"There are (\d+) steps")


def _position(walker: Any) -> int:
    """Bytes the matcher has accepted (from its debug state; 0 if that cannot be read)."""
    found = _STEPS.search(walker._debug_print_internal_state())
    return int(found.group(1)) - 1 if found else 0


def _items(walker: Any, root_pos: int) -> frozenset[tuple[int, ...]]:
    """The parser's items at the matcher's position: rule, alternative and element, and for
    the items that began before the search did (the enclosing structures) where they began,
    which tells nesting depths apart (masks do not). Read from xgrammar's debug state (no
    public API gives them); empty if it cannot be read."""
    items = set()
    for found in _ITEM.finditer(walker._debug_print_internal_state()):
        rule, alternative, element, start, sub = (int(g) for g in found.groups())
        items.add((rule, alternative, element, sub, start if start < root_pos else None))
    return frozenset(items)


def _times_on_way(key: tuple, node: _Node | None) -> int:
    """How often a state with ``key`` is on the way to ``node``, ``node`` included."""
    count = 0
    while node is not None:
        count += node.key == key
        node = node.parent
    return count


def _contents(goal: _Node, groupings: OrderedDict[bytes, _Grouping]) -> tuple[tuple[int, int],
                                                                             ...]:
    """(offset, content bytes) of the states on the way to ``goal`` (their groupings were
    computed when they were searched from)."""
    contents = []
    node = goal.parent
    while node is not None:
        grouping = groupings.get(node.sig)
        if grouping is not None and grouping.content:
            contents.append((len(node.text), grouping.content))
        node = node.parent
    return tuple(reversed(contents))


def _only(text: bytes, byte_set: int) -> bool:
    """Whether every byte of ``text`` is in ``byte_set``."""
    return all(byte_set >> byte & 1 for byte in set(text))


def _bit(sig: bytes, index: int) -> bool:
    return bool(sig[index >> 3] >> (index & 7) & 1)


def _may_end(sig: bytes) -> bool:
    return _bit(sig, STOP)


def allowed(row: torch.Tensor, token_id: int) -> bool:
    """Whether ``token_id``'s bit is set in one int32 bitmask row."""
    word, bit = divmod(token_id, 32)
    return bool((int(row[word]) >> bit) & 1)
