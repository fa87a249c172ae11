"""Start-up stage lines: what an engine is doing while it resolves, reads, sizes and warms up a model.

Loading takes seconds to minutes; each stage says so in one line on stderr (logger ``pagedllm.startup``), so a
terminal never sits silent and stdout keeps only the generated text. Progress bars (tqdm) are drawn only when
stderr is a terminal: in a log file or a pipe each stage stays one line. As vLLM's ``vllm`` logger, this one has
its own stderr handler, so the lines show in ``pagedllm generate`` and ``LLM()`` without any logging set-up;
``PAGEDLLM_CONFIGURE_LOGGING=0`` leaves them to the application's handlers, ``PAGEDLLM_LOG_LEVEL=WARNING`` hides
them.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

#: The stage logger; its lines read ``INFO <time> pagedllm.startup: <stage>`` (``pagedllm serve``'s format).
logger = logging.getLogger("pagedllm.startup")
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


class StderrHandler(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a record is written (pytest and redirections replace it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:  # StreamHandler.__init__ assigns one; the property ignores it
        pass


def configure() -> None:
    """Give the stage logger its stderr handler once (unless ``PAGEDLLM_CONFIGURE_LOGGING=0``)."""
    if os.environ.get("PAGEDLLM_CONFIGURE_LOGGING", "1") == "0" or logger.handlers:
        return
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.propagate = False  # `serve` configures the root logger too: one copy of each line
    level = os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO").upper()
    logger.setLevel(level if isinstance(logging.getLevelName(level), int) else logging.INFO)


configure()


def stage(msg: str, *args: Any) -> None:
    """One start-up stage line (``msg % args``)."""
    logger.info(msg, *args)


def show_bars() -> bool:
    """Progress bars only on a terminal, and only while stage lines are shown."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        tty = False
    return tty and logger.isEnabledFor(logging.INFO)


def progress_bar(total: Optional[int], desc: str, unit: str = "it") -> Any:
    """A tqdm bar on stderr when :func:`show_bars`, else a disabled one (``update`` is then free). It is cleared
    when closed: the stage's summary line follows it."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not show_bars(), leave=False, dynamic_ncols=True,
                file=sys.stderr)
