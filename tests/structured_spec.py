"""The spec of constrained greedy decoding, shared by the structured-output tests: at each
step the argmax of a transformers model's logits over the tokens whose bytes keep the
output in the language (EOS where it may end), found by walking every token's bytes
through the byte DFA: nothing of the engine's token tables, masks or device state."""

from __future__ import annotations

import torch


def constrained_greedy_choices(
    hf, prompt: list[int], dfa, vocab: list[bytes | None], eos: set[int] | frozenset[int],
    out: list[int], max_tokens: int, device: str = "cpu",
) -> list[int]:  # fmt: skip
    """The spec's choice at each step of `out` (an engine's constrained greedy tokens): the
    argmax of transformers' logits over the tokens allowed in the DFA state that `out`'s
    tokens before it reach, for as many steps as the spec takes (up to EOS or `max_tokens`;
    one past the end of an `out` that stopped short of both). It equals `out` exactly when
    constrained greedy decoding from `prompt` gives `out`: a step's choice depends only on
    the prefix before it, here `out`'s own. One forward pass over prompt + out, not one a
    step: SmolLM2's 24-step JSON case took 7 s of CPU, 4.3 of it in 24 passes."""
    ends = bool(out) and out[-1] in eos
    steps = min(max_tokens, len(out) + (0 if ends else 1))
    with torch.no_grad():
        x = torch.tensor([list(prompt) + list(out[: steps - 1])], device=device)
        logits = hf(x).logits[0, len(prompt) - 1 :].float().cpu()
    choices, state = [], dfa.start
    for step in range(steps):
        allowed = torch.tensor([
            bool(dfa.accept[state]) if tok in eos
            else data is not None and dfa.walk(data, state) >= 0
            for tok, data in enumerate(vocab)
        ])  # fmt: skip
        choices.append(int(logits[step].masked_fill(~allowed, float("-inf")).argmax()))
        t = out[step] if step + 1 < steps else None
        if t is None or t in eos or vocab[t] is None:
            break
        state = dfa.walk(vocab[t], state)
        if state < 0:  # `out` left the language: this step's choice already differs
            break
    return choices
