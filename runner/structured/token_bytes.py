"""The bytes each token id stands for: what a grammar walks when the token is sampled.

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) spell each byte as one
printable character; the map is rebuilt here and inverted. SentencePiece vocabularies
(Llama 2, Mistral) spell a space as U+2581 and bytes without a piece of their own as
`<0xNN>`. Special tokens (BOS, EOS, chat markers) stand for no text: None, so a grammar
never allows them as text (EOS is allowed separately, where the pattern may end).
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted (character -> byte). Printable
    Latin-1 bytes stand for themselves; the other 68 take the code points from 256 up, in
    byte order, so that no token contains a space or a control character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


def token_byte_strings(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """[vocab_size] the bytes of each id; None for special tokens and for ids the
    tokenizer does not have (a model's vocabulary may be padded past the tokenizer's)."""
    n = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, tok in added.items() if getattr(tok, "special", False)}
    byte_level = _is_byte_level(tokenizer)
    alphabet = byte_level_alphabet() if byte_level else {}
    out: list[bytes | None] = [None] * vocab_size
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        if i in added:  # an added non-special token is its own text
            out[i] = added[i].content.encode()
        elif byte_level:
            try:
                out[i] = bytes(alphabet[c] for c in piece)
            except KeyError:  # not of the byte alphabet: a token with no text form
                continue
        else:
            m = _BYTE_PIECE.fullmatch(piece)
            out[i] = (
                bytes((int(m.group(1), 16),)) if m else piece.replace(_SPIECE_SPACE, " ").encode()
            )
    return out
