"""Speculative decoding (vLLM v1's ``speculative_config``): proposers, exact rejection sampling, throttling."""

from pagedllm.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
