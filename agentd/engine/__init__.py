"""The engine: requests in, one scheduled step at a time, deltas out (nano-vllm's ``engine/``,
vLLM v1's ``core/`` + ``engine/`` + ``worker/`` in one package).

- ``llm_engine``: ``LLMEngine``, the synchronous step (schedule -> run -> process);
  ``async_engine``: its thread and the event loop's front (``AsyncEngine``).
- ``request``: a request's state (``Request``) and what a wire hands in (``EngineRequest``);
  ``hooks``: what components do at each point of a request's life.
- ``scheduler``: which tokens run; ``model_runner``: the only place that builds tensors;
  ``sampler``, ``spec_decode``: tokens from logits; ``output_processor``, ``detokenizer``:
  appending them, text, and finishing; ``outputs``, ``request_stream``: what goes back.
- ``kv_sizing``: the pool's size from memory; ``kv_publisher``: KV events for routers;
  ``retention`` and ``conversation_tails``: prefixes and tails held past a request.

``docs/lifecycle.md`` follows one request through these modules.
"""
