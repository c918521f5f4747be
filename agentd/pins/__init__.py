"""Pins: named prefixes whose KV is never evicted and survives restarts.

- ``manager``: the engine side (prefill, restore, hits and near misses), on the engine thread;
  the registry of held blocks itself is ``agentd.cache.pin_registry`` (pure Python, no torch).
- ``service``: the daemon side (template-aware tokens, tenants, persistence, restore at start).
- ``registry_file``: ``pins.json`` (atomic, with a backup); ``stored_kv``: a pin's KV in the
  block store; ``snapshots``: the pool-side copy of a pin's KV, and older versions' snapshot
  files (read once, to migrate them).
- ``near_miss``: requests that almost hit a pin, and why they missed.

The HTTP routes are ``agentd.server.routes_pins``; the commands ``agentd.cli.{pin,pins,unpin}``.
"""
