"""OpenAI-compatible HTTP serving: ``pagedllm serve`` (FastAPI + uvicorn in front of an engine process)."""
