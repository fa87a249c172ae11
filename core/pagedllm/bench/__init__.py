"""Benchmarks behind ``pagedllm bench``."""
