"""Async scheduling (plan step N+1 before step N's tokens reach the host) must not change
any output: the same tokens, finish reasons and texts as the synchronous loop."""

from __future__ import annotations

import random

from conftest import DEVICE

from pdserve import LLM, SamplingParams


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 990) for _ in range(rng.randint(lo, hi))]}
        for _ in range(n)
    ]


def _run(model_dir: str, prompts, params, **kw):
    llm = LLM(model=model_dir, device=DEVICE, dtype="float32", **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def test_async_equals_sync_with_staggered_finishes(tiny_llama_dir):
    """Guards placeholder accounting: requests finishing at different steps (max_tokens
    1..20, EOS allowed) while others keep decoding and new prompts are chunked in."""
    prompts = _prompts(10, seed=1)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=1 + 2 * i)
        for i in range(10)
    ]
    _, sync = _run(tiny_llama_dir, prompts, params, max_num_batched_tokens=32)
    _, asyn = _run(
        tiny_llama_dir, prompts, params, max_num_batched_tokens=32, async_scheduling=True
    )
    assert asyn == sync


def test_async_equals_sync_under_preemption(tiny_llama_dir):
    """Guards a request preempted while its token is in flight: it must receive that token
    and resume from it."""
    prompts = _prompts(8, seed=9, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    kw = {"max_model_len": 128, "num_gpu_blocks": 24, "block_size": 8}
    _, sync = _run(tiny_llama_dir, prompts, params, **kw)
    llm, asyn = _run(tiny_llama_dir, prompts, params, async_scheduling=True, **kw)
    assert llm.engine.scheduler.num_preemptions > 0
    assert asyn == sync
    assert llm.engine.kv.num_free_blocks == 23


def test_async_stop_strings_and_eos(smollm_dir):
    """Stops discovered one step late must still cut text and tokens at the same place,
    and bad words banned from the device's history ban the same tokens."""
    prompts = ["The three primary colors are", "Once upon a time"]
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop=[" and"]),
        SamplingParams(temperature=0, max_tokens=30),
    ]
    kw = {"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}
    sync_llm = LLM(model=smollm_dir, device=DEVICE, dtype="float32", **kw)
    async_llm = LLM(model=smollm_dir, device=DEVICE, dtype="float32", async_scheduling=True, **kw)
    a = sync_llm.generate(prompts, params, use_tqdm=False)
    b = async_llm.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert (x.outputs[0].text, x.outputs[0].token_ids, x.outputs[0].finish_reason) == (
            y.outputs[0].text,
            y.outputs[0].token_ids,
            y.outputs[0].finish_reason,
        )
    # bad_words: a ban reads the device's token history, where under async scheduling
    # the newest token is still in flight when the next step is planned.
    tok = sync_llm.get_tokenizer()
    plain = a[1].outputs[0].token_ids
    banned = SamplingParams(
        temperature=0, max_tokens=30, bad_words=[tok.decode(plain[4:6]), tok.decode(plain[9:10])]
    )
    c, d = (llm.generate(prompts[1], banned, use_tqdm=False)[0].outputs[0]
            for llm in (sync_llm, async_llm))  # fmt: skip
    assert c.token_ids == d.token_ids != plain
    assert not async_llm.engine.has_unfinished()
    assert async_llm.engine.runner.state.num_live <= 2  # freed on the next step
