"""What users call: the offline ``LLM`` class (``llm``, with ``beam_search``) and the OpenAI-compatible HTTP server
(``openai``: ``pagedllm serve``, FastAPI + uvicorn in front of an engine process)."""
