"""The spec of constrained greedy decoding, shared by the structured-output tests: at each
step the argmax of a transformers model's logits over the tokens whose bytes keep the
output in the language (EOS where it may end), found by walking every token's bytes
through the byte DFA: nothing of the engine's token tables, masks or device state."""

from __future__ import annotations

import torch


def constrained_greedy(
    hf, prompt: list[int], dfa, vocab: list[bytes | None], eos: set[int] | frozenset[int],
    max_tokens: int, device: str = "cpu",
) -> list[int]:  # fmt: skip
    ids, out, state = list(prompt), [], dfa.start
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
        allowed = torch.tensor([
            bool(dfa.accept[state]) if t in eos
            else data is not None and dfa.walk(data, state) >= 0
            for t, data in enumerate(vocab)
        ])  # fmt: skip
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(t)
        if t in eos:
            break
        state = dfa.walk(vocab[t], state)
        ids.append(t)
    return out
