"""Simulated Intel device layer for testing pagedllm-xpu on CPU (tests only; see ../README.md)."""
