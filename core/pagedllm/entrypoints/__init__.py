"""OpenAI-compatible HTTP serving: ``pagedllm serve`` (FastAPI + uvicorn over an async engine thread)."""
