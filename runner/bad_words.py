"""`bad_words` (vLLM's sampling field): words a request must never generate.

A word becomes token sequences here, once per request; each step the sampler bans a
sequence's last token in the rows whose output so far ends with the rest of it (a
one-token word is banned outright). Only generated tokens count as the history, not the
prompt, as in vLLM, so a prompt ending with a word's first half does not ban its second.

A word is tokenized as it reads at the start of a text and as it reads after a space,
since byte-pair vocabularies spell the two differently ("Paris" and " Paris"), and both
spellings are banned. vLLM keeps the spaced one only when it has as many tokens as the
bare one, so a word that is two tokens bare and one after a space (SmolLM2's
"skyscrapers") is still generated mid-sentence there; here it is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def bad_word_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences (one or two per word, see the module note)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = word.lstrip()
        plain = tuple(tokenizer.encode(bare, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + bare, add_special_tokens=False))
        out.append(plain)
        if spaced != plain:
            out.append(spaced)
    return tuple(out)


def ban_values(
    entries: list[tuple[int, tuple[int, ...]]],  # (batch row, token sequence)
    recent: torch.Tensor,  # [E, W]: each entry's row's last W tokens (W >= its length - 1)
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, tokens, values) to add to the logits: -inf at a sequence's last token where
    the row's recent tokens end with the rest of it, 0 where they do not. Matching runs on
    the device (the newest token may not have reached the host), from one host copy."""
    width = recent.shape[1]
    # Each entry's wanted tokens, right-aligned; -1 where it wants none (ids are >= 0).
    wanted = np.full((len(entries), 2 + width), -1, dtype=np.int64)
    for i, (row, seq) in enumerate(entries):
        wanted[i, :2] = row, seq[-1]
        if len(seq) > 1:
            wanted[i, 2 + width - len(seq) + 1 :] = seq[:-1]
    packed = to_device(wanted)
    want = packed[:, 2:]
    matched = ((recent.long() == want) | (want < 0)).all(dim=1)
    zero = torch.zeros((), dtype=torch.float32, device=packed.device)
    return packed[:, 0], packed[:, 1], torch.where(matched, float("-inf"), zero)
