"""On-device sampling in ``jax.numpy``, traced into the same program as the forward (no logits leave the device).

A line-for-line twin of core's ``pagedllm.backend.device_sampler.sample``: vLLM's order temperature -> top-k -> top-p ->
min-p, every row computing both the greedy and the random token and ``where`` picking (no data-dependent branch, a
fixed shape per sequence bucket; a step with no random row skips the sort through ``lax.cond``). The random draw is an exponential race (``probs / Exp(1)``, argmax), keyed by
``fold_in(key, step)`` so a new step needs a new scalar, never a new program. tpu-inference samples inside its jitted
step the same way (``tpu_inference/layers/jax/sample/sampling.py``).
"""

from __future__ import annotations

from typing import Any


def sample(logits: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any, key: Any) -> Any:
    """``[S, V]`` float32 logits and per-row parameters ``[S]`` -> int32 token ids ``[S]``."""
    import jax
    import jax.numpy as jnp

    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # An all-greedy step (the common serving case) skips the vocabulary sort: lax.cond compiles both branches into
    # the one program and runs one, so the shape stays static and nothing recompiles.
    return jax.lax.cond(jnp.any(temperature > 0),
                        lambda: _random(logits, greedy, temperature, top_k, top_p, min_p, key), lambda: greedy)


def _random(logits: Any, greedy: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any, key: Any) -> Any:
    import jax
    import jax.numpy as jnp

    vocab = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-5)[:, None]
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    keep = ranks < k

    def masked_softmax(keep: Any) -> Any:
        return jax.nn.softmax(jnp.where(keep, sorted_x, -jnp.inf), axis=-1)

    probs = masked_softmax(keep)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # the nucleus, always >= 1 token
    probs = masked_softmax(keep)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = masked_softmax(keep)
    race = probs / jax.random.exponential(key, probs.shape, dtype=probs.dtype)
    picked = jnp.take_along_axis(order, jnp.argmax(race, axis=-1)[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, picked, greedy)
