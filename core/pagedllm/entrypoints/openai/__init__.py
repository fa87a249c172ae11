"""The OpenAI-compatible HTTP server (FastAPI): routes, request/response schemas, auth, limits, metrics, errors,
tool calling and the render workers that apply chat templates off the event loop. It talks to the engine process
only through ``pagedllm.engine.async_engine``."""
