"""Errors the user fixes (a flag, a model path, a device, a port): the CLI prints them as one line, exit code 2.

Anything else escaping a command is a runtime failure (exit code 1); ``--debug`` shows its traceback.
"""

from __future__ import annotations

import pickle


class UserError(Exception):
    """Base of every error caused by the caller's input or set-up rather than by pagedllm."""


class ModelNotFoundError(FileNotFoundError, UserError):
    """The model path (or the embedded default model) does not exist or holds no weights."""


class UnsupportedModelError(ValueError, UserError):
    """The model exists but pagedllm cannot run it (architecture, file kind, settings)."""


class ParamError(ValueError, UserError):
    """Invalid request parameter; ``field`` names it (the server maps this to HTTP 400 with ``param``)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # pickles across the server/engine process boundary
        return ParamError, (self.field, self.message)


def portable_exception(e: BaseException) -> BaseException:
    """The exception itself if it survives pickling (to cross a process boundary), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - anything unpicklable
        return RuntimeError(f"{type(e).__name__}: {e}")
