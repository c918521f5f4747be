"""The wires: OpenAI Chat Completions and text completions, the OpenAI Responses API and the
Anthropic Messages API, each an adapter over one path (design §9). A request's life through
them: ``docs/lifecycle.md``.

Every wire is three modules named alike, and adding a wire adds three modules and a route:

- ``<wire>_types``: its msgspec Structs (the request as it decodes, replies as they encode);
- ``<wire>_plan``: the request checked and turned into the one internal ``Plan`` (``plan``: an
  ``EngineRequest`` plus what shapes the reply) — ``plan_chat``, ``plan_completion``,
  ``plan_responses``, ``plan_messages``;
- ``<wire>_reply``: the one event stream (``reply_events.events``) folded into a whole reply or
  encoded as the wire's stream — ``complete_chat``/``stream_chat``,
  ``complete_text``/``stream_text``, ``complete_response``/``stream_response``,
  ``complete_message``/``stream_message``.

What they share sits beside them: ``plan`` (``Plan``, ``start``, ``answer``, ``prewarm``),
``checks`` (the validation every wire does the same way), ``reply_events``, ``constraints``
(output constraints from any wire's fields), ``cache_control`` (retention fields and the cache
figures a reply reports), ``tool_calls`` and ``tools`` (tool sets and calls parsed out of the
text), ``prompts`` (rendering and cache breakpoints), ``intake`` (a prompt refused by its length
before it is rendered), ``serving`` (submitting, reading to the end, SSE) and ``openai_types``
(what the OpenAI wires share). Errors are rendered in each wire's shape by
``agentd.server.errors``.
"""
