"""Structured output on a tiny random Llama with a byte-level BPE trained here: the test
that runs on the GPU as well (`PDSERVE_TEST_DEVICE=cuda`), where the bundled SmolLM2 is
not carried. There the decode steps replay CUDA graphs and the grammar's mask and advance
run on the device beside them, under async scheduling.

A random model wants no particular text, so its constrained argmax walks odd corners of
each pattern: good for the mask, which must hold wherever the walk goes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import DEVICE
from structured_spec import constrained_greedy_choices

from pdserve import LLM, SamplingParams
from pdserve.runner.structured.patterns import compile_spec
from pdserve.runner.structured.spec import StructuredOutputs
from pdserve.runner.structured.token_bytes import token_byte_strings

CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "poetry"], "ok": true, "x": null}',
    "The quick brown fox jumps over the lazy dog. 0123456789 yes no maybe",
    '[1, 2.5, -3e+2, {"a": {"b": [false]}}] "quoted \\"text\\"" naïve café 東京',
]
SPECS = [
    StructuredOutputs(regex=r"(yes|no|maybe)(, [a-z]{1,8}){0,3}\."),
    StructuredOutputs(
        json={
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer"},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 5},
                    "maxItems": 3,
                },
            },
            "required": ["name", "age"],
        }  # fmt: skip
    ),
    StructuredOutputs(json_object=True),
    StructuredOutputs(choice=("alpha", "beta", "gamma delta")),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  bos_token="<|endoftext|>")  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_structured")
    tok.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _llm(path: str, dtype: str, **kw) -> LLM:
    return LLM(model=path, device=DEVICE, dtype=dtype, max_model_len=256,
               kv_cache_memory_bytes=16 << 20, **kw)  # fmt: skip


def _in_language(spec: StructuredOutputs, text: str, finished: bool) -> bool:
    dfa = compile_spec(spec)
    state = dfa.walk(text.encode())
    return bool(dfa.accept[state]) if finished else state >= 0


def test_constrained_greedy_equals_the_brute_force_spec(tiny_dir):
    """Guards the device tables, mask and advance against the spec in float32
    (tests/structured_spec.py: transformers' argmax over the tokens whose bytes stay in
    the language, EOS where the pattern may end)."""
    from transformers import AutoModelForCausalLM

    llm = _llm(tiny_dir, "float32")
    tok = llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).to(DEVICE).eval()
    vocab = token_byte_strings(tok, 640)
    eos = set(llm.engine.eos_token_ids)
    prompt = tok("yes no", add_special_tokens=False).input_ids
    for spec in SPECS:
        dfa = compile_spec(spec)
        got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=24, structured_outputs=spec), use_tqdm=False
        )[0].outputs[0]  # fmt: skip
        ids = list(got.token_ids)
        want = constrained_greedy_choices(hf, prompt, dfa, vocab, eos, ids, 24, DEVICE)
        assert ids == want, spec.describe()
        assert _in_language(spec, got.text, got.finish_reason == "stop"), got.text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] if DEVICE == "cuda" else ["float32"])
def test_sampled_rows_hold_their_patterns_in_a_mixed_async_batch(tiny_dir, dtype):
    """Guards the constraint where the engine is busiest: 24 sampled rows under four
    patterns and 8 free rows in one batch, async scheduling (each step's mask queued
    before the last token is known), CUDA graphs for the forward on a GPU. Every
    constrained text stays in its language (and is a whole word of it when it stopped);
    the free rows come out as they do alone. The choice rows ask for min_tokens past any
    choice's length: min_tokens yields once a choice is whole (its only way on is EOS), so
    each ends right after its choice."""
    llm = _llm(tiny_dir, dtype, async_scheduling=True)
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tok('{"name": "', add_special_tokens=False).input_ids}
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=40,
            structured_outputs=SPECS[i % 4],
            min_tokens=30 if i % 4 == 3 else 0,
        )
        for i in range(24)
    ] + [SamplingParams(temperature=0, max_tokens=20) for _ in range(8)]
    outs = llm.generate([prompt] * 32, params, use_tqdm=False)
    for i, out in enumerate(outs[:24]):
        comp = out.outputs[0]
        assert _in_language(SPECS[i % 4], comp.text, comp.finish_reason == "stop"), (
            SPECS[i % 4].describe(), comp.text, comp.finish_reason,
        )  # fmt: skip
    eos = set(llm.engine.eos_token_ids)
    for out in outs[3:24:4]:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        assert comp.finish_reason == "stop" and comp.text in SPECS[3].choice, (comp.text, ids)
        assert ids[-1] in eos and tok.decode(ids[:-1]) == comp.text, ids
    alone = llm.generate(prompt, params[24], use_tqdm=False)[0].outputs[0].token_ids
    for out in outs[24:]:
        assert out.outputs[0].token_ids == alone
    finished = [o.outputs[0] for o in outs[:24] if o.outputs[0].finish_reason == "stop"]
    assert finished, "no constrained row ever reached the end of its pattern"
    for comp in finished:
        if comp.text.startswith("{"):
            json.loads(comp.text)
        elif comp.text[:1] in "ynm":
            assert re.fullmatch(SPECS[0].regex, comp.text)
    if DEVICE == "cuda":
        assert llm.engine.steps_by_path().get("cuda_graph", 0) > 0


def test_preempted_rows_resume_in_the_state_their_output_left(tiny_dir):
    """Guards resumption: a request preempted mid-output comes back in a fresh slot whose
    automaton state is rebuilt on the host from the tokens it had (`state_after`), with
    and without async scheduling (where one of its tokens may still be in flight when it
    is preempted). Greedy outputs must equal those of a cache that never preempts."""
    spec = StructuredOutputs(regex=r"([a-z]{1,6} ){5,40}[a-z]{1,6}\.")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    g = torch.Generator().manual_seed(4)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 600, (int(n),), generator=g).tolist()}
        for n in torch.randint(20, 40, (8,), generator=g)
    ]
    want = [o.outputs[0].token_ids for o in _llm(tiny_dir, "float32").generate(
        prompts, params, use_tqdm=False)]  # fmt: skip
    for async_scheduling in (False, True):
        llm = LLM(model=tiny_dir, device=DEVICE, dtype="float32", max_model_len=128,
                  num_gpu_blocks=24, block_size=8, async_scheduling=async_scheduling)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == want
        for o in outs:
            comp = o.outputs[0]
            assert _in_language(spec, comp.text, comp.finish_reason == "stop"), comp.text


def test_the_reference_runner_keeps_the_same_contract(tiny_dir):
    """Guards the fallback runner (transformers, no paging): it masks and advances through
    the same sampling state, so its constrained greedy outputs equal the MRV2 runner's."""
    outs = []
    for runner in ("reference", "mrv2"):
        llm = LLM(model=tiny_dir, device=DEVICE, dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=16 << 20, runner=runner)  # fmt: skip
        assert llm.engine.runner_name == runner
        prompt = {"prompt_token_ids": llm.get_tokenizer()("yes no").input_ids}
        outs.append([
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24,
                         structured_outputs=spec), use_tqdm=False)[0].outputs[0].token_ids
            for spec in SPECS
        ])  # fmt: skip
    assert outs[0] == outs[1]
