"""N-gram ("prompt lookup") draft proposer for speculative decoding.

Text often repeats itself: code edits copy the prompt, answers quote their sources, lists
repeat a pattern. So when the last few tokens of a request (prompt + output so far) also
appeared earlier, the tokens that followed them then are a cheap, model-free guess at what
comes next. The target model verifies the guess in one step; a wrong guess only costs the
rejected draft positions.

The rule, for a sequence of L known tokens:

* Try pattern lengths n from `prompt_lookup_max` down to `prompt_lookup_min`, using only
  n < L, and stop at the first n that has a match. The pattern is the last n tokens.
* A match is an earlier occurrence of the pattern: a start i with i + n <= L - 1 (so the
  suffix itself does not count) and token_ids[i:i+n] == pattern. The most recent one, the
  largest such i, wins, since nearby context is the better guide.
* The draft is what followed it: token_ids[i+n], token_ids[i+n+1], ... When that runs past
  the known tokens, the draft goes on with its own earlier draft tokens, i.e. draft[j] =
  token_ids[i+n+j] if i+n+j < L else draft[j - (L-i-n)]: the stretch from i+n to the end
  repeats with period L-i-n (a sequence stuck in a loop is guessed to stay in it).
* At most min(num_speculative_tokens, max_tokens) draft tokens are returned; none when no
  pattern length matches, or when max_tokens <= 0.

The search starts from where the last token occurred before (with prompt_lookup_min 1):
none, the usual case on text that does not repeat, is one numpy pass and no draft; a few
are extended backwards one by one; many (text that repeats) go to a byte search, the
tokens as int64 bytes and each pattern's last occurrence (`bytes.rfind`, in C, from the
end) that starts on a token boundary, longest pattern first: repeating text finds it near
the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Per call with an int64 ndarray input (min=1, max=4, k=4; this dev box's shared CPU), this
# search against the numpy passes over every length it replaced: a 16-token phrase
# repeated to 512 / 4,096 tokens 4.8 / 6.9 us against 13.5 / 19.7; 4,096 random tokens of a
# 32k vocabulary 2.9 against 4.5 (one earlier hit: 5.0 against 11.0); 4,096 of an alphabet
# of 3, 9.5 against 19.7; 2,048 of an alphabet of 50 (~40 hits, no long match) 16.8 against
# 9.3, the one case it loses. A Python list input adds its conversion (~60 us at L=4096 to
# ~170 us at L=8192), so callers keep arrays (runner/speculative/drafter.py).
_WORD = 8  # bytes a token
_FEW_HITS = 8  # earlier occurrences of the last token extended one by one


class NgramProposer:
    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(
        self, token_ids: Sequence[int] | np.ndarray, max_tokens: int | None = None
    ) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) draft tokens to follow `token_ids`
        (a request's prompt + output so far), or [] when no n-gram matches."""
        k = self.num_speculative_tokens
        if max_tokens is not None:
            k = min(k, max_tokens)
        if k <= 0:
            return []
        t = np.asarray(token_ids, dtype=np.int64)
        if t.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {t.shape}")
        n_len = t.shape[0]
        max_n = min(self.prompt_lookup_max, n_len - 1)
        if max_n < self.prompt_lookup_min:
            return []
        lo = self.prompt_lookup_min
        if lo == 1:
            # Where the last token occurred before: every match ends at one of those, and
            # text that does not repeat has none (one numpy pass, then no draft).
            hits = np.flatnonzero(t[: n_len - 1] == t[n_len - 1])
            if hits.size == 0:
                return []
            if hits.size <= _FEW_HITS:  # match lengths at each, the latest first
                end, best = -1, 0
                for p in hits[::-1].tolist():
                    n = 1
                    while n < max_n and p >= n and t[p - n] == t[n_len - 1 - n]:
                        n += 1
                    if n > best:
                        end, best = p + 1, n
                return _continue(t, end, k)
        # Many: the longest pattern's bytes from the end (text that repeats finds its match
        # near there), down to the shortest.
        data = t.tobytes()
        for n in range(max_n, lo - 1, -1):
            end = _last_match(data, n_len, n)
            if end >= 0:
                return _continue(t, end, k)
        return []


def _continue(t: np.ndarray, end: int, k: int) -> list[int]:
    """k tokens from `end` on, looping over t[end:] when they run past it."""
    return t[end + np.arange(k) % (t.shape[0] - end)].tolist()


def _last_match(data: bytes, n_len: int, n: int) -> int:
    """Where the continuation of the last earlier occurrence of the last n tokens starts
    (start + n), or -1: a match ends before the last token and starts on a token boundary."""
    pattern = data[(n_len - n) * _WORD :]
    stop = (n_len - 1) * _WORD
    while (i := data.rfind(pattern, 0, stop)) > 0 and i % _WORD:
        stop = i + len(pattern) - 1  # inside a token: look further back
    return -1 if i < 0 else i // _WORD + n
