"""What a component does at each point of a request's life, called by the engine in one order.

A request's own state (its retention, its kept tail, its pin, its grammar) travels on the
``Request`` (:mod:`agentd.engine.request`); a component that must keep something of its own per
request (a matcher, a generator, a draft length) subclasses ``RequestHooks`` and keeps it from
``added`` to ``finished``. ``LLMEngine`` lists its components once (``LLMEngine.hooks``) and
calls each hook on all of them in that order, so a new feature adds a hook, not a line in five
places.

Invariant: for every request the engine takes, ``added`` is called once, then ``admitted`` at
most once (its first admission, its cached prefix known), ``computed`` after each step that ran
it (its full blocks cached, its tokens processed), and ``finished`` exactly once, last, with the
request's final delta (its blocks back in the pool, nothing allocated since).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentd.engine.outputs import StreamDelta
    from agentd.engine.request import Request
    from agentd.engine.scheduler import ScheduledRequest


class RequestHooks:
    """Every hook does nothing unless a component overrides it."""

    def added(self, request: Request) -> None:
        """The engine took the request (it waits to be scheduled)."""

    def admitted(self, request: Request) -> None:
        """First admission: ``num_cached_tokens`` and the prompt's block hashes are known."""

    def computed(self, request: Request, item: ScheduledRequest) -> None:
        """A step ran ``item`` of the request; its full blocks are cached."""

    def finished(self, request: Request, item: ScheduledRequest | None,
                 delta: StreamDelta) -> None:
        """The request ended (``item``: its last step's row, None when aborted or failed);
        ``delta`` is its last, which a hook may annotate."""
