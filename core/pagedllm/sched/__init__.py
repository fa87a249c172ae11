"""Scheduling and KV-cache management: which requests run each step, and which cache blocks hold their tokens.

- ``request``: a request's engine-side state (tokens, status, blocks it holds).
- ``scheduler``: continuous batching under a token budget — decodes, then prefill chunks; preemption.
- ``kv_manager``: the paged block pool (ref-counted, prefix-hashed, swap to host).
"""
