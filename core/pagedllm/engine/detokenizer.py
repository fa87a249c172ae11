"""Incremental detokenization with stop strings, one instance per generated sequence.

Text comes from the fast tokenizer's own streaming decoder (``tokenizers.decoders.DecodeStream``), which buffers
tokens until they decode to complete UTF-8 characters; other tokenizers use vLLM's prefix/read-offset algorithm on
``tokenizer.decode``. Either way the decoder is primed with the prompt's tail so the first output token decodes in
context. Stop strings are searched across token boundaries; streamed deltas hold back any tail that could still grow
into a stop string, so a client never sees part of a stop string that is later cut off.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # optional: DecodeStream needs tokenizers >= 0.21.1 (else vLLM's offset algorithm)
    Tokenizer = DecodeStream = None

from pagedllm.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_CONTEXT = 5  # tokens of left context used when decoding a tail (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
_MAX_PRIME = 24
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error on non-monotonic output (vllm#17448)


def _backend_tokenizer(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` behind an HF fast tokenizer (or the tokenizer itself), else None."""
    if DecodeStream is None:
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Feed output tokens with :meth:`update`; emit the returned deltas; call :meth:`finish` when the sequence ends.

    The deltas (including finish()'s) concatenate to :attr:`output_text`. Without a stop-string match or
    ``stop_terminated``, ``output_text`` equals ``tokenizer.decode(token_ids, skip_special_tokens=...)`` for
    byte-level BPE tokenizers (the output is decoded in the prompt's context, as vLLM does).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 *, use_decode_stream: Optional[bool] = None):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.stop_reason: Optional[str] = None  # the stop string that matched
        self._skip = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or [])
        self._hold = bool(self._stops) and not params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._emitted = 0
        self._done = False
        self._backend = _backend_tokenizer(tokenizer) if use_decode_stream is not False else None
        if use_decode_stream and self._backend is None:
            raise ValueError("use_decode_stream=True needs a fast (tokenizers-backed) tokenizer")
        self._ids: list[int] = self._prime(list(prompt_token_ids)) if params.detokenize else []
        self._pending = 0  # trailing tokens fed to the decoder whose text is not out yet
        if self._backend is not None:
            self._stream = DecodeStream(self._ids, skip_special_tokens=self._skip)
        self._prefix_offset = max(len(self._ids) - _CONTEXT, 0)
        self._read_offset = len(self._ids)

    # -- public API ----------------------------------------------------------------------------------------------
    @property
    def output_text(self) -> str:
        """All text so far (truncated at a matched stop string); may include held-back text not yet emitted."""
        return self._text

    @property
    def emitted_text(self) -> str:
        """The text returned as deltas so far (for cumulative streaming)."""
        return self._text[: self._emitted]

    @property
    def finished(self) -> bool:
        return self._done

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> tuple[str, Optional[str]]:
        """Append tokens; return (newly stable text, matched stop string or None).

        ``stop_terminated``: the last token is EOS or a stop token id that ended the sequence; as in vLLM its text is
        left out unless ``include_stop_str_in_output``. After a stop string matches, further calls return ("", None).
        """
        new = list(new_token_ids)
        if self._done or not new:
            return "", None
        skipped = None
        if stop_terminated and not self.params.include_stop_str_in_output:
            skipped = new.pop()
        if not self.params.detokenize:
            self.token_ids.extend(new + ([skipped] if skipped is not None else []))
            return "", None
        check_from = len(self._text)
        for t in new:
            self.token_ids.append(t)
            self._ids.append(t)
            self._text += self._decode_next(t)
            if len(self.token_ids) <= self.params.min_tokens:  # vLLM: no stop strings inside min_tokens
                check_from = len(self._text)
        if skipped is not None:
            self.token_ids.append(skipped)
        if self._stops:
            hit = self._find_stop(check_from)
            if hit is not None:
                self.stop_reason, end = hit
                self._text = self._text[:end]
                self._done = True
                return self._take(len(self._text)), self.stop_reason
        return self._take(len(self._text) - self._held_back()), None

    def finish(self) -> str:
        """End of sequence without a stop-string match: flush undecodable bytes and held-back text as a last delta."""
        if self._done:
            return ""
        self._done = True
        check_from = len(self._text)
        if self._pending:
            self._text += self._tail_text()
            self._pending = 0
        if self._stops:
            hit = self._find_stop(check_from)
            if hit is not None:
                self.stop_reason, end = hit
                self._text = self._text[:end]
        return self._take(len(self._text))

    # -- decoding ------------------------------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self._skip)
        return self.tokenizer.decode(list(ids), skip_special_tokens=self._skip)

    def _prime(self, prompt: list[int]) -> list[int]:
        """The shortest prompt tail (>= 4 tokens) that decodes cleanly, as vLLM picks it."""
        if len(prompt) <= 4:
            return prompt
        for n in range(4, min(len(prompt), _MAX_PRIME) + 1):
            if _REPLACEMENT not in self._decode(prompt[-n:]):
                return prompt[-n:]
        return prompt[-_MAX_PRIME:]

    def _decode_next(self, token_id: int) -> str:
        if self._backend is not None:
            try:
                chunk = self._stream.step(self._backend, token_id)
            except Exception as e:  # tokenizers raises a plain Exception here
                if _INVALID_PREFIX not in str(e):
                    raise
                self._stream = DecodeStream(skip_special_tokens=self._skip)
                chunk = self._stream.step(self._backend, token_id)
            if chunk is None:
                self._pending += 1
                return ""
            self._pending = 0
            return chunk
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self._pending = 0
            return new_text[len(prefix_text):]
        self._pending = len(ids) - self._read_offset
        return ""

    def _tail_text(self) -> str:
        """Lossy text of the pending tokens (e.g. an unfinished multi-byte character), decoded in context."""
        start = len(self._ids) - self._pending
        ctx = self._ids[max(start - _CONTEXT, 0):start]
        before, full = self._decode(ctx), self._decode(ctx + self._ids[start:])
        return full[len(before):] if full.startswith(before) else self._decode(self._ids[start:])

    # -- stop strings --------------------------------------------------------------------------------------------
    def _find_stop(self, check_from: int) -> Optional[tuple[str, int]]:
        """Earliest stop string ending after ``check_from``: (stop, length to truncate the text to)."""
        best = None
        for s in self._stops:
            i = self._text.find(s, max(check_from - len(s) + 1, 0))
            if i >= 0 and (best is None or (i, i + len(s)) < best[:2]):
                best = (i, i + len(s), s)
        if best is None:
            return None
        start, end, s = best
        return s, (end if self.params.include_stop_str_in_output else start)

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string (it may still match)."""
        if not self._hold:
            return 0
        text = self._text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._text[self._emitted:upto]
        self._emitted = upto
        return delta
