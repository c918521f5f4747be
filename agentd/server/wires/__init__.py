"""The wires beside chat completions: the OpenAI Responses API and the Anthropic Messages API.

Each wire is its msgspec types, a ``to_plan`` that turns a request into the one internal
``Plan`` (``agentd.server.wires.plan``), and an encoder for its replies and stream events; the
engine, templates, tool parsing and constrained decoding under them are the chat route's.
"""
