"""Incremental detokenization: token ids in, newly stable text out, at bounded cost per step.

Decoding the whole output every step costs O(n) per token, O(n^2) per request (a 4k-token
answer would decode 8M tokens). Instead each step decodes a short window, the
prefix_offset/read_offset technique:

    tokens[prefix_offset:read_offset]  -> text already emitted (kept as context)
    tokens[prefix_offset:]             -> that text plus what the new tokens add

and emits the difference. Text ending in U+FFFD is held back: a byte-level (or byte-fallback)
token may carry only part of a multi-byte UTF-8 character (an emoji is 4 bytes, CJK 3) and the
next token may complete it.

Why the pieces add up to `tokenizer.decode(output_ids)`: tokenizers decode bytes with lossy
UTF-8, which, when bytes are appended, can only change the last character and only when it
is U+FFFD (an unfinished sequence); a U+FFFD followed by anything is final. So a window text
that does not end in U+FFFD is a prefix of every later decode of that window.

Exactness holds for decoders that are context-free apart from lossy UTF-8 (byte-level BPE, as
the bundled SmolLM2 uses; tested). Known differences from `decode(output_ids)` elsewhere:
- SentencePiece/Metaspace decoders drop the leading space of a sequence's first token; the
  window starts with up to `NUM_CONTEXT_TOKENS` prompt tokens so the first output word keeps
  its space (" Hello", as a stream should read), where `decode(output_ids)` gives "Hello".
  Deliberate.
- SentencePiece ByteFallback turns *every* byte of a run of byte tokens into U+FFFD when the
  run as a whole is not valid UTF-8 (decode([E4, E4, BD, A0]) is four U+FFFD, not U+FFFD +
  "你"): a property of the whole run, so no bounded window can reproduce it for garbage runs.
  Valid text is unaffected.
- `clean_up_tokenization_spaces` rewrites (" ." -> ".") are not applied: they look across
  window edges. transformers already ignores them for BPE tokenizers.

What this module does not know: which tokens end a request (stop_checker.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token (vLLM uses 5 as well):
# enough for any decoder rule that looks at the previous token.
NUM_CONTEXT_TOKENS = 5
# An unfinished UTF-8 character has at most 3 bytes, so an honest hold lasts at most 3
# tokens. A longer hold is garbage (a run of lone lead bytes) or tokens without text that
# would otherwise grow the window, and the cost of every later step, without bound.
MAX_HELD_TOKENS = 4


@lru_cache(maxsize=8)
def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    # The Rust decoder drops exactly the added tokens marked special (bytes on either side of
    # one merge), so dropping them before they enter the window gives the same text. It also
    # keeps them from becoming the window's only context: a Metaspace decoder would then strip
    # the next word's leading space. Cached: building added_tokens_decoder costs ~100 us.
    return frozenset(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text for logprob display; part of a multi-byte character shows as U+FFFD."""
    return tokenizer.decode(
        [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Streams one request's output text; `flush()` once when the request finishes."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped = _skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        # Look a few tokens further back so that a chat template's trailing specials do not
        # leave the context empty, without scanning a 100k-token prompt.
        kept_prompt = [
            t for t in prompt_token_ids[-4 * NUM_CONTEXT_TOKENS :] if t not in self._skipped
        ]
        context = kept_prompt[-NUM_CONTEXT_TOKENS:]
        if self._decode(context).endswith(REPLACEMENT):
            # The prompt (given as ids) ends mid-character. Output bytes that finish it are
            # not a character of the output; decoding without context shows them as U+FFFD,
            # as decode(output_ids) does.
            context = []
        # The window, tokens[prefix_offset:]: older tokens are dropped, so prefix_offset is 0
        # and _read_offset counts from the window start.
        self._tokens = context
        self._read_offset = len(context)
        # str += copies, but a 16 KB answer copied once per token stays under 1 ms per step.
        self._text = ""
        self._flushed = False

    @property
    def output_text(self) -> str:
        return self._text

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append output tokens; return the text they made stable (possibly "")."""
        assert not self._flushed, "add_tokens after flush: flush is for finished requests"
        self._tokens.extend(t for t in new_token_ids if t not in self._skipped)
        prefix_text = self._decode(self._tokens[: self._read_offset])
        full_text = self._decode(self._tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            return self._emit(prefix_text, full_text, len(self._tokens))
        if len(self._tokens) - self._read_offset > MAX_HELD_TOKENS:
            return self._settle_held(prefix_text, full_text)
        return ""

    def flush(self) -> str:
        """Emit what is still held back (a trailing U+FFFD stays, as decode() shows it)."""
        if self._flushed:
            return ""
        self._flushed = True
        prefix_text = self._decode(self._tokens[: self._read_offset])
        full_text = self._decode(self._tokens)
        return self._emit(prefix_text, full_text, len(self._tokens))

    def _settle_held(self, prefix_text: str, full_text: str) -> str:
        # Emit up to the last token if the window splits cleanly there: when
        # decode(head) + decode(tail) == decode(head + tail), no UTF-8 sequence (or decoder
        # rule) spans the split, so decode(head) can no longer change. Otherwise hold one
        # more step; a sequence spans at most 3 bytes, so this succeeds within 3 steps.
        split = len(self._tokens) - 1
        head_text = self._decode(self._tokens[:split])
        tail_text = self._decode(self._tokens[split:])
        if head_text + tail_text != full_text:
            return ""
        return self._emit(prefix_text, head_text, split)

    def _emit(self, prefix_text: str, text: str, new_read_offset: int) -> str:
        # prefix_text never ends in an unfinished sequence, so it cannot have changed.
        assert text.startswith(prefix_text), (
            f"decoder rewrote already emitted text: {prefix_text!r} -> {text!r}"
        )
        piece = text[len(prefix_text) :]
        self._text += piece
        # The new window starts where the last one's new text started: one step of context.
        del self._tokens[: self._read_offset]
        self._read_offset = new_read_offset - self._read_offset
        return piece

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
