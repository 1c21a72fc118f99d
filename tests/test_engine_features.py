"""Sampling features end to end through the engine, against transformers where it has them."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def smol(smollm_dir) -> LLM:
    return LLM(
        model=smollm_dir,
        device=DEVICE,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
    )


@pytest.fixture(scope="module")
def hf_smol(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


PROMPT = "The three primary colors are"


def test_logprobs_match_transformers(smol, hf_smol):
    """Guards the top-k logprob path: values are raw log-softmax of the model's logits at
    each generated position, ranks are right, and the chosen token is included."""
    out = smol.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False
    )[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.inference_mode():
        logits = hf_smol(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    n = len(out.prompt_token_ids)
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[n - 1 + i]
        top = torch.topk(row, 3)
        assert list(lp)[:3] == top.indices.tolist() or set(lp) >= set(top.indices.tolist())
        assert lp[tok].rank == 1  # greedy picks the top token
        for t, entry in lp.items():
            assert entry.logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert entry.decoded_token == smol.get_tokenizer().decode([t])
    assert comp.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs))
    )


def test_prompt_logprobs_match_transformers(smol, hf_smol):
    out = smol.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    ids = out.prompt_token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smol(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry[ids[i]].logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert entry[ids[i]].rank == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert len(entry) in (2, 3)


def test_prompt_logprobs_survive_chunked_prefill(smollm_dir):
    """Guards chunk bookkeeping of prompt logprobs: every prompt position gets exactly one
    entry when the prompt spans several steps."""
    llm = LLM(
        model=smollm_dir,
        device=DEVICE,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=8,
        kv_cache_memory_bytes=32 << 20,
    )
    whole = LLM(
        model=smollm_dir,
        device=DEVICE,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
    )
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a = llm.generate(PROMPT * 3, p, use_tqdm=False)[0].prompt_logprobs
    b = whole.generate(PROMPT * 3, p, use_tqdm=False)[0].prompt_logprobs
    assert len(a) == len(b) and a[0] is None and all(x is not None for x in a[1:])
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        for t in x:
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)


def test_repetition_penalty_matches_transformers(smol, hf_smol):
    """Guards the penalty path (prompt + output tokens) against transformers' processor."""
    ids = smol.get_tokenizer()(PROMPT).input_ids
    out = smol.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=16, min_tokens=16, repetition_penalty=1.5),
        use_tqdm=False,
    )
    with torch.inference_mode():
        ref = hf_smol.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=16,
            repetition_penalty=1.5,
            pad_token_id=0,
        )
    assert out[0].outputs[0].token_ids == ref[0, len(ids) :].tolist()


def test_logit_bias_and_allowed_ids_match_transformers(smol, hf_smol):
    """Guards logit_bias and allowed_token_ids through the engine against transformers'
    own processors (`sequence_bias` of single tokens, `prefix_allowed_tokens_fn`), greedy,
    the three requests in one batch: the bias turns the output away from the plain one,
    the allowed ids hold every token, and the plain request beside them is unchanged."""
    ids = smol.get_tokenizer()(PROMPT).input_ids
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = smol.generate({"prompt_token_ids": ids}, plain, use_tqdm=False)[0].outputs[0]
    first, later = alone.token_ids[0], alone.token_ids[3]
    bias = {first: -100.0, later: 6.0}
    allowed = sorted({*alone.token_ids[1:5], 13, 28, 253})
    outs = smol.generate(
        [{"prompt_token_ids": ids}] * 3,
        [
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
            plain,
        ],
        use_tqdm=False,
    )
    biased, restricted, beside = (o.outputs[0].token_ids for o in outs)
    with torch.inference_mode():
        common = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
        want_biased = hf_smol.generate(
            torch.tensor([ids]), sequence_bias={(t,): b for t, b in bias.items()}, **common
        )[0, len(ids) :].tolist()
        want_restricted = hf_smol.generate(
            torch.tensor([ids]), prefix_allowed_tokens_fn=lambda _b, _ids: allowed, **common
        )[0, len(ids) :].tolist()
    assert biased == want_biased and biased[0] != first
    assert restricted == want_restricted and set(restricted) <= set(allowed)
    assert restricted != alone.token_ids
    assert beside == alone.token_ids
    with pytest.raises(ValueError, match=r"logit_bias and allowed_token_ids must name token"):
        smol.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def _contains(tokens: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(seq)]) == seq for i in range(len(tokens)))


def test_bad_words_match_transformers(smol, hf_smol):
    """Guards bad_words through the engine against transformers' `bad_words_ids` with the
    same token sequences, greedy, in one batch with a plain request: a one-token word
    (the plain answer's first) is banned from the start, a two-token word (the plain
    answer's 4th and 5th tokens) only where its first token was just generated; no banned
    sequence is generated, and the plain request beside them is unchanged."""
    from pdserve.runner.bad_words import bad_word_ids

    tok = smol.get_tokenizer()
    ids = tok(PROMPT).input_ids
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = smol.generate({"prompt_token_ids": ids}, plain, use_tqdm=False)[0].outputs[0]
    one_token = tok.decode(alone.token_ids[:1])
    two_tokens = tok.decode(alone.token_ids[3:5])
    cases = [[one_token], [two_tokens]]
    seqs = [bad_word_ids(tok, words) for words in cases]
    assert [len(s) for s in seqs[1]] == [2, 2]  # bare and spaced forms, two tokens each
    assert tuple(alone.token_ids[3:5]) in seqs[1]
    outs = smol.generate(
        [{"prompt_token_ids": ids}] * 3,
        [*(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=words)
           for words in cases), plain],
        use_tqdm=False,
    )  # fmt: skip
    got = [o.outputs[0].token_ids for o in outs]
    with torch.inference_mode():
        common = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        want = [
            hf_smol.generate(torch.tensor([ids]), bad_words_ids=[list(s) for s in seq], **common)[
                0, len(ids) :
            ].tolist()
            for seq in seqs
        ]
    assert got[:2] == want
    for tokens, seq in zip(got, seqs):
        assert tokens != alone.token_ids and not any(_contains(tokens, s) for s in seq)
    assert got[1][:3] == alone.token_ids[:3]  # the ban acts only once its start is there
    assert got[2] == alone.token_ids
    with pytest.raises(ValueError, match="bad_words must be a list of strings"):
        SamplingParams(bad_words=["ok", "  "])


def test_stop_strings_stop_ids_and_lengths(smol):
    base = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
        0
    ].outputs[0]
    assert base.finish_reason in ("stop", "length")
    text = base.text
    word = text.split()[2]
    cut = smol.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[word]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == text[: text.index(word)]
    incl = smol.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=24, stop=word, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert incl.text == text[: text.index(word) + len(word)]
    stop_id = base.token_ids[3]
    by_id = smol.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    short = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[
        0
    ].outputs[0]
    assert short.finish_reason == "length" and short.token_ids == base.token_ids[:3]


def test_min_tokens_suppresses_eos_and_ignore_eos_runs_on(smol):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    done = smol.chat(q, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    n = len(done.outputs[0].token_ids)
    assert done.outputs[0].finish_reason == "stop" and n < 40
    longer = smol.chat(
        q, SamplingParams(temperature=0, max_tokens=40, min_tokens=n + 3), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= n + 3
    assert 2 not in longer.token_ids[: n + 3], "EOS must be suppressed before min_tokens"
    on = smol.chat(
        q, SamplingParams(temperature=0, max_tokens=n + 4, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert on.finish_reason == "length" and len(on.token_ids) == n + 4
    assert on.token_ids[:n] == done.outputs[0].token_ids


def test_stream_deltas_add_up_to_the_final_text(smol):
    """Guards the streaming hold-back: deltas concatenate to the final (stop-truncated) text
    and never contain a stop string's first characters."""
    eng = smol.engine
    base = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
        0
    ].outputs[0]
    stop = base.text[10:14]
    ids = smol.get_tokenizer()(PROMPT).input_ids
    eng.add_request("s", ids, SamplingParams(temperature=0, max_tokens=24, stop=stop))
    pieces = []
    while eng.has_unfinished():
        pieces += [d.new_text for d in eng.step() if d.request_id == "s"]
    assert "".join(pieces) == base.text[: base.text.index(stop)]
