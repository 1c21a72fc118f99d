"""The engine against itself (DESIGN §6): scheduling choices must not change tokens."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from conftest import DEVICE

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


def _prompts(n: int, seed: int = 3, lo: int = 5, hi: int = 70) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 990) for _ in range(rng.randint(lo, hi))]}
        for _ in range(n)
    ]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _llm(model_dir: str, **kw) -> LLM:
    kw.setdefault("device", DEVICE)
    kw.setdefault("dtype", "float32")
    return LLM(model=model_dir, **kw)


def test_chunked_equals_unchunked_prefill(tiny_llama_dir):
    """Guards chunk boundaries: positions, slot mapping and causal masks of a prompt split
    over several steps must reproduce the one-step prefill exactly."""
    prompts = _prompts(6, lo=40, hi=120)
    whole = _llm(tiny_llama_dir, max_num_batched_tokens=2048)
    chunked = _llm(tiny_llama_dir, max_num_batched_tokens=16)
    assert _tokens(whole.generate(prompts, GREEDY, use_tqdm=False)) == _tokens(
        chunked.generate(prompts, GREEDY, use_tqdm=False)
    )


def test_prefix_cache_hit_equals_miss(tiny_qwen3_dir):
    """Guards prefix caching: blocks reused from an earlier request must hold exactly the KV
    a fresh computation would write, and the hit must be reported."""
    shared = [random.Random(5).randrange(3, 990) for _ in range(70)]
    prompts = [{"prompt_token_ids": shared + [11 + i, 12 + i]} for i in range(3)]
    cold = _llm(tiny_qwen3_dir, enable_prefix_caching=False)
    warm = _llm(tiny_qwen3_dir, enable_prefix_caching=True)
    first = warm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    hits = warm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in hits), [o.num_cached_tokens for o in hits]
    assert warm.engine.kv.prefix_cache_hits > 0
    assert _tokens(hits) == _tokens(cold.generate(prompts, GREEDY, use_tqdm=False))


def test_cache_salt_separates_prefix_hits_offline(tiny_qwen3_dir):
    """Guards `cache_salt` in `LLM.generate` (it travels in SamplingParams): a prompt
    cached unsalted is not a hit under a salt, the same salt hits it, and the answer is
    the same either way."""
    prompt = [{"prompt_token_ids": [random.Random(7).randrange(3, 990) for _ in range(70)]}]
    llm = _llm(tiny_qwen3_dir, enable_prefix_caching=True)
    salted = replace(GREEDY, cache_salt="tenant-a")
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)
    first = llm.generate(prompt, salted, use_tqdm=False)
    again = llm.generate(prompt, salted, use_tqdm=False)
    other = llm.generate(prompt, replace(GREEDY, cache_salt="tenant-b"), use_tqdm=False)
    cached = [o[0].num_cached_tokens for o in (plain, first, again, other)]
    assert cached[0] == cached[1] == cached[3] == 0 and cached[2] >= 64, cached
    assert _tokens(plain) == _tokens(first) == _tokens(again) == _tokens(other)


def test_preemption_equals_no_preemption(tiny_llama_dir):
    """Guards recompute preemption: a request evicted mid-decode and re-prefilled with its
    output as prompt continues exactly where it left off."""
    prompts = _prompts(8, seed=9, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    roomy = _llm(tiny_llama_dir, max_model_len=128)
    tight = _llm(tiny_llama_dir, max_model_len=128, num_gpu_blocks=24, block_size=8)
    expected = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    got = _tokens(tight.generate(prompts, params, use_tqdm=False))
    assert tight.engine.scheduler.num_preemptions > 0, "the test must force preemption"
    assert got == expected
    assert tight.engine.kv.num_free_blocks == 23, "every block is back after the batch"


def test_batch_of_one_equals_batch_of_64(tiny_qwen3_dir):
    """Guards cross-request leaks: slot gathers, block tables and batched decode attention
    must keep 64 concurrent requests independent."""
    prompts = _prompts(64, seed=11, lo=1, hi=40)
    llm = _llm(tiny_qwen3_dir, max_num_batched_tokens=512)
    together = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[::8]]
    assert alone == together[::8]
    fresh = _llm(tiny_qwen3_dir, enable_prefix_caching=False)
    assert _tokens(fresh.generate(prompts[1::8], GREEDY, use_tqdm=False)) == together[1::8]


def test_seeded_request_same_alone_and_in_batch(tiny_llama_dir):
    """Guards sampler state leaking across rows: a seeded request draws the same tokens
    alone and among differently seeded (and unseeded) requests."""
    prompts = _prompts(12, seed=13)
    target = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4242)
    others = [
        SamplingParams(
            temperature=0.7 + 0.1 * i, top_k=20, max_tokens=16, seed=None if i % 3 == 0 else i
        )
        for i in range(11)
    ]
    llm = _llm(tiny_llama_dir)
    alone = llm.generate(prompts[:1], target, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts, [target] + others, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    # And the draw is a real sample: another seed gives another continuation.
    other = llm.generate(
        prompts[:1],
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4243),
        use_tqdm=False,
    )
    assert other[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("runner", ["mrv2", "reference"])
def test_engine_seed_reproduces_unseeded_requests(tiny_qwen3_dir, runner):
    """Guards the seed derivation: the same engine seed and submission order reproduce
    unseeded samples, and n=2 children differ from each other."""
    prompts = _prompts(3, seed=17)
    params = SamplingParams(temperature=1.0, max_tokens=10, n=2)
    a = _llm(tiny_qwen3_dir, seed=5, runner=runner).generate(prompts, params, use_tqdm=False)
    b = _llm(tiny_qwen3_dir, seed=5, runner=runner).generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    assert all(o.outputs[0].token_ids != o.outputs[1].token_ids for o in a)


def test_mrv2_and_reference_runner_agree(tiny_qwen2_dir):
    """The oracle runner (transformers, unpaged) and mrv2 give the same greedy and the same
    seeded samples: the runners share the sampler and its pure-function noise."""
    prompts = _prompts(4, seed=19)
    params = [GREEDY, SamplingParams(temperature=0.8, max_tokens=12, seed=77)] * 2
    m_llm, r_llm = _llm(tiny_qwen2_dir, runner="mrv2"), _llm(tiny_qwen2_dir, runner="reference")
    m = m_llm.generate(prompts, params, use_tqdm=False)
    r = r_llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(m) == _tokens(r)
    # Same scheduler, same steps with tokens: the oracle runs each eagerly, mrv2 counts each
    # under the path that ran it (what /metrics' engine_steps reports).
    ref_paths, mrv2_paths = r_llm.engine.steps_by_path(), m_llm.engine.steps_by_path()
    assert set(ref_paths) == {"eager"} and ref_paths["eager"] > 0
    assert sum(mrv2_paths.values()) == ref_paths["eager"], (mrv2_paths, ref_paths)
