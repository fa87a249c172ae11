"""How the long-running processes (the server and its engine process) use Python's cyclic GC.

What start-up allocated (torch, transformers, FastAPI, the model and tokenizer: ~300k objects) lives for good, and a
full collection walks every tracked object: frozen, it is left out of every pass (vLLM freezes it too). A full pass
also walks every live request's outputs (n=128 x 100 tokens x 21 logprobs is 270 000 objects: 0.1-0.2 s idle, up to
1 s on a loaded host, during which no step runs and no response is sent), while serving makes next to no cyclic
garbage: a full collection is considered only after :data:`FULL_GC_EVERY` young-generation passes instead of 10
(issue 34: a large logprob request must not stall the others).
"""

from __future__ import annotations

import gc

FULL_GC_EVERY = 1000  # gen-1 collections between full ones (CPython's default: 10)


def freeze_startup_heap() -> None:
    """Call once start-up is done: collect, freeze what survived, and make full collections rare."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*gc.get_threshold()[:2], FULL_GC_EVERY)
