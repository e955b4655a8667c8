"""The global stream of packed sequences: what sequence i is, for any i >= 0.

Let T be the corpus token stream (every document with BOS and EOS, in dataset order;
`TokenIndex.tokens`) and W = seq_len + 1. The infinite stream is T repeated
(T T T ...), and sequence i is its tokens [i*W, (i+1)*W). A sequence may span the
end of one pass and the start of the next, exactly as torchtitan's re-looping
HuggingFaceTextDataset carries its token buffer across passes: at DP degree 1 the
stream equals stock torchtitan's, batch for batch.

Nothing here depends on the DP degree, and finding sequence i is arithmetic on i
(a memory-mapped slice): O(1) in the position.
"""

from __future__ import annotations

import numpy as np


class GlobalStream:
    def __init__(self, tokens: np.ndarray, seq_len: int, identity: dict | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(tokens) == 0:
            raise ValueError("empty token stream")
        self.tokens = tokens
        self.seq_len = seq_len
        self.window = seq_len + 1
        self.n_tokens = int(len(tokens))
        self.identity = dict(identity or {})

    @property
    def sequences_per_pass(self) -> float:
        """Sequences in one pass over the corpus (fractional: passes are not aligned)."""
        return self.n_tokens / self.window

    def epoch_of(self, i: int) -> int:
        """Which pass over the corpus sequence i starts in (0-based)."""
        return (i * self.window) // self.n_tokens

    def sequences(self, start: int, count: int) -> np.ndarray:
        """Sequences start .. start+count-1 as an int64 array [count, seq_len + 1]."""
        if start < 0 or count < 0:
            raise ValueError(f"bad range start={start} count={count}")
        n = count * self.window
        offset = (start * self.window) % self.n_tokens  # Python ints: no overflow
        if offset + n <= self.n_tokens:
            flat = np.asarray(self.tokens[offset:offset + n], dtype=np.int64)
        else:  # wraps into the next pass (possibly several times for a tiny corpus)
            idx = (offset + np.arange(n, dtype=np.int64)) % self.n_tokens
            flat = np.asarray(self.tokens[idx], dtype=np.int64)
        return flat.reshape(count, self.window)

    def sequence(self, i: int) -> np.ndarray:
        return self.sequences(i, 1)[0]
