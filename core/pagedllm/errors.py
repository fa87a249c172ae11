"""Errors the user fixes (a flag, a model path, a device, a port): the CLI prints them as one line, exit code 2.

Anything else escaping a command is a runtime failure (exit code 1); ``--debug`` shows its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every error caused by the caller's input or set-up rather than by pagedllm."""


class ModelNotFoundError(FileNotFoundError, UserError):
    """The model path (or the embedded default model) does not exist or holds no weights."""


class UnsupportedModelError(ValueError, UserError):
    """The model exists but pagedllm cannot run it (architecture, file kind, settings)."""
