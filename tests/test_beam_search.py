"""Beam search (`LLM.beam_search`, runner/beam_search.py) on the bundled SmolLM2 against a
beam search written here on transformers' float32 logits; the ranking rules on made-up
candidates; the parameters' bounds."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE

from pdserve import LLM, BeamSearchParams
from pdserve.runner.beam_search import BeamSearch, top_candidates


@pytest.fixture(scope="module")
def smol(smollm_dir) -> LLM:
    return LLM(
        model=smollm_dir, device=DEVICE, dtype="float32", max_model_len=64,
        kv_cache_memory_bytes=32 << 20,
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


def hf_beams(hf, prompt, width, max_tokens, eos, length_penalty=1.0, ignore_eos=False):
    """The spec: every live beam's top 2 * width next tokens by transformers' logprobs,
    EOS candidates set aside as complete, the width best others live on; at the end all
    of them ranked by cum / length ** length_penalty (a final EOS not counted)."""
    live, complete = [(list(prompt), 0.0, False)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum, _ in live:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].double()
            top = torch.topk(torch.log_softmax(logits, -1), 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                ended = t in eos and not ignore_eos
                (complete if ended else grown).append((tokens + [t], cum + v, ended))
        live = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
        if not live:
            break

    def score(b):
        return b[1] / ((len(b[0]) - b[2]) ** length_penalty)

    return sorted(complete + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize(
    "prompt, width, max_tokens, length_penalty",
    [("The capital of France is", 3, 8, 1.0), ("Water boils at", 2, 6, 0.0)],
)
def test_beams_equal_a_beam_search_on_transformers(smol, hf, prompt, width, max_tokens,
                                                   length_penalty):  # fmt: skip
    """Guards the whole search (candidates, EOS handling, pruning, the final ranking and
    its length penalty) against the spec above: the same beams, token for token, in the
    same order, with the same cumulative logprobs (float32 logits: 1e-3)."""
    tok = smol.get_tokenizer()
    ids = tok(prompt).input_ids
    eos = frozenset(smol.engine.eos_token_ids)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty)  # fmt: skip
    (out,) = smol.beam_search([{"prompt_token_ids": ids}], params)
    want = hf_beams(hf, ids, width, max_tokens, eos, length_penalty)
    assert [s.tokens for s in out.sequences] == [b[0] for b in want]
    for seq, (_, cum, ended) in zip(out.sequences, want, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
        assert seq.finish_reason == ("stop" if ended else "length")
        body = seq.output_token_ids[:-1] if ended else seq.output_token_ids
        assert seq.text == tok.decode(body, skip_special_tokens=True)
        assert math.fsum(seq.logprobs) == pytest.approx(seq.cum_logprob, abs=1e-9)


def test_ignore_eos_and_the_model_length_end_beams_as_length(smol):
    """Guards `ignore_eos` (no beam completes on EOS) and the model's length (a beam that
    reaches it stops growing): a 60-token prompt in a 64-token model gets 4 tokens."""
    tok = smol.get_tokenizer()
    ids = (tok("Count: one two three four five six seven").input_ids * 8)[:60]
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    (out,) = smol.beam_search([{"prompt_token_ids": ids}], params)
    assert [len(s.tokens) for s in out.sequences] == [64, 64]
    assert {s.finish_reason for s in out.sequences} == {"length"}


def test_the_ranking_rules_on_made_up_candidates():
    """Guards the bookkeeping with numbers chosen to separate the rules: EOS candidates
    complete (and keep their EOS in `tokens`, not in `text` unless asked), only the width
    best of the rest live on (ties keep candidate order), and the length penalty decides
    between a short complete beam and a longer live one."""
    eos = frozenset({0})
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    s = BeamSearch([7, 7], params, eos, max_model_len=100)
    s.advance([[(0, -0.5), (5, -1.0), (6, -1.0), (9, -3.0)]])
    assert [b.tokens for b in s.complete] == [[7, 7, 0]]
    assert [b.tokens for b in s.live] == [[7, 7, 5], [7, 7, 6]]  # 9 pruned, tie in order
    s.advance([[(1, -0.1)], [(2, -0.2)]])
    out = s.answer(lambda ids: ",".join(map(str, ids)))
    # Lengths count the prompt, not a final EOS: -0.5 / 2 = -0.25 beats -1.1 / 4 = -0.275
    # and -1.2 / 4 = -0.3, so the complete beam comes first, then the first live one.
    assert [b.tokens for b in out.sequences] == [[7, 7, 0], [7, 7, 5, 1]]
    assert [b.text for b in out.sequences] == ["", "5,1"]
    assert [b.finish_reason for b in out.sequences] == ["stop", "length"]
    shown = BeamSearch([7, 7], BeamSearchParams(2, 1, include_stop_str_in_output=True), eos, 100)
    shown.advance([[(0, -0.5)]])
    assert shown.answer(lambda ids: ",".join(map(str, ids))).sequences[0].text == "0"
    # A position's candidates: ranks 1..k, whatever else its rows carry (the sampled token).
    assert top_candidates([(4, -2.0, 3), (3, -1.0, 2), (2, -0.5, 1), (9, -0.1, 9)], 2) == [
        (2, -0.5), (3, -1.0)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(beam_width=0, max_tokens=4), "beam_width must be an integer in [1, 10]"),
        (dict(beam_width=11, max_tokens=4), "beam_width"),
        (dict(beam_width=True, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    ],
)
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BeamSearchParams(**kwargs)
