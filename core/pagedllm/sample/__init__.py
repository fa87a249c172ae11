"""Token choice from logits, shared by the device step and speculative decoding (vLLM's ``v1/sample``).

- ``sampler``: temperature, top-k / top-p / min-p, penalties, seeds, logprobs, for a step's rows.
- ``greedy``: the first argmax of each row, blocked (torch's CPU ``argmax`` carries its index through a scalar loop).
"""
