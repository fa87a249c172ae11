from intel_extension_for_pytorch.llm import modules  # noqa: F401
