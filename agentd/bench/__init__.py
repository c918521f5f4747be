"""``agentd bench``: agent workloads against agentd or any OpenAI-compatible server.

Modules: ``workload`` (load, trim to a token budget, build requests), ``client`` (streaming
calls, TTFT, server detection), ``runner`` (the phases), ``session`` (one invocation),
``results`` (figures), ``report`` / ``plot`` / ``progress`` (output), ``baseline_hf`` (the
transformers ``generate`` reference).

Invariant: nothing here imports torch or transformers at import time except ``baseline_hf``;
the CLI imports this package only when ``agentd bench`` runs.
"""
