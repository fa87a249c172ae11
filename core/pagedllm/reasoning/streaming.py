"""``ReasoningStream``: one choice's reasoning split, whole or delta by delta, identical either way.

The server makes one per choice. When the prompt already ends the reasoning (Qwen3's template with
``enable_thinking=False`` closes ``</think>`` in the prompt), the whole output is content, as vLLM's
``prompt_is_reasoning_end``. A stream's deltas come from the parser's monotone split; :meth:`finish` sends what
was held back (a trailing partial tag), so the concatenated deltas equal :meth:`whole` of the final text."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from pagedllm.reasoning.abs_reasoning_parsers import DeltaMessage, ReasoningParser

logger = logging.getLogger(__name__)


class ReasoningStream:
    def __init__(self, parser: ReasoningParser, prompt_token_ids: Sequence[int] = ()):
        self.parser = parser
        self.prompt_ended = bool(prompt_token_ids) and parser.is_reasoning_end(prompt_token_ids)
        self.text = ""
        self.ids: list[int] = []
        self.sent_reasoning = ""
        self.sent_content = ""

    def whole(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a finished output; an empty part is None."""
        if self.prompt_ended:
            return None, text or None
        return self.parser.extract_reasoning(text)

    def delta(self, delta_text: str, delta_ids: Sequence[int] = ()) -> Optional[DeltaMessage]:
        """The next delta of the stream (None when nothing is visible yet)."""
        prev_text, prev_ids = self.text, self.ids
        self.text, self.ids = prev_text + delta_text, prev_ids + list(delta_ids)
        if self.prompt_ended:
            msg = DeltaMessage(content=delta_text) if delta_text else None
        else:
            msg = self.parser.extract_reasoning_streaming(prev_text, self.text, delta_text, prev_ids, self.ids,
                                                          list(delta_ids))
        return self._sent(msg)

    def finish(self) -> Optional[DeltaMessage]:
        """What the stream still owes at its end (held-back text), so that it adds up to :meth:`whole`."""
        reasoning, content = self.whole(self.text)
        reasoning, content = reasoning or "", content or ""
        if not (reasoning.startswith(self.sent_reasoning) and content.startswith(self.sent_content)):
            logger.warning("reasoning parser %s: streamed split is not a prefix of the whole split",
                           type(self.parser).__name__)
            return None
        msg = DeltaMessage(reasoning=reasoning[len(self.sent_reasoning):] or None,
                           content=content[len(self.sent_content):] or None)
        return self._sent(msg) if (msg.reasoning or msg.content) else None

    def _sent(self, msg: Optional[DeltaMessage]) -> Optional[DeltaMessage]:
        if msg is not None:
            self.sent_reasoning += msg.reasoning or ""
            self.sent_content += msg.content or ""
        return msg
