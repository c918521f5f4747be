"""The wires: OpenAI Chat Completions and text completions, the OpenAI Responses API and the
Anthropic Messages API, each an adapter over one path.

Each wire is its msgspec types, a ``to_plan`` that turns a request into the one internal
``Plan`` (``plan``: an ``EngineRequest`` plus what shapes the reply), and an encoder of the one
event stream (``events``) into its replies and stream events, with its error shape. The checks
they share are ``checks``; the engine, templates, tool parsing and constrained decoding under
them are one. A request's life through them: ``docs/lifecycle.md``.
"""
