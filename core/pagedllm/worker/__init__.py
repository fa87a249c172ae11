"""The device step: inputs for one scheduled batch, the forward through the backend, logits and sampling.

- ``worker``: owns the device, the model, the KV caches and the backend's hooks for one rank.
- ``model_runner``: flat inputs and ``AttentionMetadata`` for a scheduled step, forward, logits.

Sampling itself is ``pagedllm.sample`` (speculative decoding shares it).
"""

from pagedllm.deprecated import package_attr


def __getattr__(name: str):  # contract v2's ``pagedllm.worker`` module (now ``pagedllm.worker.worker``)
    return package_attr(__name__, name)
