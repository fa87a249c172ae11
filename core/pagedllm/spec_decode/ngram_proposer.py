"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the context's tail.

Like vLLM's ``NgramProposer``: try the longest tail first (``prompt_lookup_max`` down to ``prompt_lookup_min``) and
propose up to ``k`` tokens that followed its most recent earlier match in the request's own prompt + output.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` (<= the configured k) proposed next tokens; [] when no tail n-gram occurs earlier."""
        k = min(k, self.k)
        n_tok = len(token_ids)
        if k <= 0 or n_tok < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            tail = arr[n_tok - n:]
            # Windows starting at 0 .. n_tok - n - 1 (the tail's own window excluded); matches need a follower.
            windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []
