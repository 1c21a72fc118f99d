"""Bad input raises ValueError naming the rule, and the engine keeps serving the others."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from pdserve import LLM, SamplingParams
from pdserve.runner.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir) -> Engine:
    return Engine.from_args(model=tiny_qwen3_dir, device=DEVICE, dtype="float32", max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be an integer >= -1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be <= max_tokens"),
        ({"logprobs": 50}, "logprobs must be None or an integer in"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        # Every integer must fit int64 (msgpack to the workers, int64 tensors there).
        ({"seed": 2**63}, r"seed must be an integer in \[-2\*\*63, 2\*\*63\)"),
        ({"seed": -(2**63) - 1}, "seed must be an integer in"),
        ({"top_k": 2**63}, "top_k must be an integer >= -1 and < 2"),
        ({"max_tokens": 2**63}, "max_tokens must be an integer >= 1 and < 2"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids must be non-negative integer token ids"),
        ({"priority": 10**30}, r"priority must be an integer in \[-2\*\*63"),
        ({"logit_bias": {2**64: 1.0}}, "logit_bias must map non-negative integer token ids"),
        ({"n": 2**63}, "n must be an integer >= 1 and < 2"),
        ({"n": True}, "n must be an integer"),
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0 and finite"),
    ],
)
def test_bad_sampling_params(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        SamplingParams(**kwargs)


def test_bad_requests_do_not_disturb_a_running_one(engine):
    """Guards isolation: rejected requests leave no trace and a live request finishes with
    the same tokens as when it runs alone."""
    good = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    engine.add_request("solo", [5, 6, 7, 8], good)
    alone = _drain(engine)["solo"]

    engine.add_request("good", [5, 6, 7, 8], good)
    first = [t for d in engine.step() for t in d.new_token_ids]
    free_before = engine.kv.num_free_blocks
    cases = [
        ("empty", [], "prompt must contain at least one token"),
        ("long", list(range(3, 68)), "longer than max_model_len=64"),
        ("oov", [5, 99999], r"prompt token ids must be integers in \[0, 997\)"),
        ("bool", [5, True], r"prompt token ids must be integers in \[0, 997\)"),
        ("good", [1, 2], "already in use"),
    ]
    for rid, ids, rule in cases:
        with pytest.raises(ValueError, match=rule):
            engine.add_request(rid, ids, good)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("x", [1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("x", [1, 2], {"max_tokens": 3})
    assert engine.kv.num_free_blocks == free_before
    assert set(engine.scheduler.requests) == {"good"}
    assert first + _drain(engine)["good"] == alone


def test_integers_past_int32_run_as_their_meaning(engine):
    """Guards a worker crash (fuzzing found it: top_k 3e9 killed the decode worker's
    loop): a top_k of the vocabulary or more samples as top_k 0 does, and a min_tokens no
    sequence can reach runs to the context's end, both beside a request that keeps going."""
    tokens: dict[str, list[int]] = {}
    engine.add_request("bystander", [9, 8, 7], SamplingParams(temperature=0, max_tokens=50))
    for k in (0, 997, 3_000_000_000, 2**63 - 1):
        params = SamplingParams(temperature=1.0, seed=7, top_k=k, max_tokens=12)
        engine.add_request(f"k{k}", [5, 6, 7, 8], params)
        _step_until(engine, f"k{k}", tokens)
    assert tokens["k0"] == tokens["k997"] == tokens["k3000000000"] == tokens[f"k{2**63 - 1}"]
    engine.add_request("long", [5, 6, 7, 8], SamplingParams(max_tokens=2**41, min_tokens=2**40))
    _step_until(engine, "long", tokens)
    assert len(tokens["long"]) == 64 - 4  # to max_model_len
    _step_until(engine, "bystander", tokens)
    assert len(tokens["bystander"]) == 50


def _step_until(engine: Engine, rid: str, tokens: dict[str, list[int]]) -> None:
    """Step until `rid` has finished (it may have already), collecting every request's
    tokens into `tokens`."""
    for _ in range(1000):
        if rid in tokens and rid not in engine.scheduler.requests:
            return
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    raise AssertionError(f"{rid} did not finish within 1000 steps")


def test_abort_frees_blocks_and_reports(engine):
    free = engine.kv.num_free_blocks
    engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    assert engine.kv.num_free_blocks < free
    assert engine.abort("a") and not engine.abort("a")
    assert engine.kv.num_free_blocks == free
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", "abort")]
    assert not engine.has_unfinished()


def test_unknown_model_path():
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model="/nonexistent/model/dir", device=DEVICE, dtype="float32")


def test_llm_generate_validates_whole_batch_first(tiny_qwen3_dir):
    llm = LLM(model=tiny_qwen3_dir, device=DEVICE, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        llm.generate(
            [{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": []}],
            SamplingParams(max_tokens=2),
            use_tqdm=False,
        )
    assert not llm.engine.has_unfinished(), "nothing of a rejected batch was queued"
    out = llm.generate({"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def _drain(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            return tokens
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    raise AssertionError("engine did not finish within 1000 steps")


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        (
            {"max_num_batched_tokens": 16, "enable_chunked_prefill": False},
            "without chunked prefill, max_num_batched_tokens must be >= max_model_len",
        ),
        ({"max_model_len": 4096}, r"max_model_len \(4096\) must be <= the model's"),
        ({"dtype": "int8"}, "dtype must be 'auto' or one of"),
        ({"num_gpu_blocks": 3}, "cannot hold one request of max_model_len=64"),
        ({"decode_attention": "flash"}, "decode_attention must be one of"),
    ],
)
def test_bad_engine_config(tiny_qwen3_dir, kwargs, rule):
    kwargs = {"max_model_len": 64, "dtype": "float32", **kwargs}
    with pytest.raises(ValueError, match=rule):
        Engine.from_args(model=tiny_qwen3_dir, device=DEVICE, **kwargs)
