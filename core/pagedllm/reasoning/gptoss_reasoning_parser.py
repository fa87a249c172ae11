"""GPT-OSS: OpenAI's harmony format. The ``analysis`` channel is reasoning, the ``final`` channel the answer::

    <|channel|>analysis<|message|>...reasoning...<|end|><|start|>assistant<|channel|>final<|message|>...answer...

Parsed from the text (and token ids) directly, without the ``openai_harmony`` package: its encoder downloads its
vocabulary file from the network on first use, which a server in a closed network cannot do. Harmony's markers are
special tokens, so the parser keeps them in the detokenized text (``adjust_request`` turns
``skip_special_tokens`` off); they never reach the client, the split removes them. Messages of other channels
(``commentary``) go to the content; several messages of one kind are joined with a newline, as vLLM does.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager, longest_partial_suffix
from pagedllm.reasoning.token_ids import rfind_seq, tag_ids

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
_FINAL_RE = re.compile(re.escape(CHANNEL) + r"\s*final\b[^<]*(?:" + re.escape(CONSTRAIN) + r"[^<]*)?"
                       + re.escape(MESSAGE))
_TAIL_TOKENS = 32  # enough to hold "<|start|>assistant<|channel|>final<|message|>" however it is tokenized


def channel_of(header: str) -> str:
    """The channel named in a message header (``assistant<|channel|>commentary to=fn`` -> ``commentary``)."""
    if CHANNEL not in header:
        return ""
    words = header.rsplit(CHANNEL, 1)[1].split(CONSTRAIN)[0].split()
    return words[0] if words else ""


@ReasoningParserManager.register_module(["gpt_oss", "openai_gptoss"])
class GptOssReasoningParser(ReasoningParser):
    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any):
        super().__init__(tokenizer, *args, **kwargs)
        if tokenizer is None:
            raise ValueError("the reasoning parser needs the model's tokenizer")
        self.final_ids = tag_ids(tokenizer, CHANNEL + "final" + MESSAGE)

    def adjust_request(self, request: Any) -> Any:
        if hasattr(request, "skip_special_tokens"):
            request.skip_special_tokens = False
        return request

    def _decode(self, ids: Sequence[int]) -> str:
        return self.model_tokenizer.decode(list(ids), skip_special_tokens=False)

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """The final channel opened after the last ``<|start|>`` (earlier turns' final messages do not count)."""
        text = self._decode(input_ids)
        return _FINAL_RE.search(text, text.rfind(START) + 1 if START in text else 0) is not None

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        n = len(list(delta_ids)) + _TAIL_TOKENS
        return self.is_reasoning_end(input_ids[max(len(input_ids) - n, 0):])

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        i = rfind_seq(input_ids, self.final_ids)
        return [] if i < 0 else list(input_ids[i + len(self.final_ids):])

    def split(self, text: str, final: bool) -> tuple[str, str]:
        head = text.lstrip()
        if not head.startswith("<|") and not (not final and (not head or "<|".startswith(head))):
            return "", text  # not harmony: the model answered in plain text
        if not final and not any(head.startswith(m) for m in MARKERS) and \
                any(m.startswith(head) for m in MARKERS):
            return "", ""
        parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        header, field = "", None  # field: where the current message body goes (None: in a header)
        opened = False
        pos = 0
        for m in _MARKER_RE.finditer(text):
            seg = text[pos:m.start()]
            if field is None:
                header += seg
            else:
                parts[field].append(seg)
            marker, pos = m.group(), m.end()
            if field is None and marker == MESSAGE:
                field = "reasoning" if channel_of(header) == "analysis" else "content"
                opened = True
                if parts[field]:
                    parts[field].append("\n")
            elif field is not None and marker in (END, RETURN, CALL):
                field, header = None, ""
            elif field is None and marker == START:
                header = ""
            elif field is None:
                header += marker
            else:  # a marker inside a body (malformed output): keep it as text
                parts[field].append(marker)
        tail = text[pos:]
        if field is not None:
            hold = 0 if final else longest_partial_suffix(tail, MARKERS)
            parts[field].append(tail[:len(tail) - hold])
        if final and not opened:
            return "", text  # no harmony message at all: nothing is lost
        return "".join(parts["reasoning"]), "".join(parts["content"])
