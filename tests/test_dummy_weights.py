"""`--load-format dummy` (runner/models/dummy_weights.py): a model folder with config.json
and no weights runs on random weights of the checkpoint's shapes, the same ones in every
process (a PD pair's two sides must agree), through the family's own loader; without the
flag such a folder is refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import DEVICE

from pdserve import LLM, SamplingParams
from pdserve.runner.models.dummy_weights import DUMMY_RANGE, dummy_weights

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)


@pytest.fixture(scope="module")
def config_only_dir(tiny_qwen3_dir, tmp_path_factory) -> str:
    """The tiny Qwen3 (fused q/k/v and gate/up, q/k norms) without its safetensors."""
    out = tmp_path_factory.mktemp("config-only")
    shutil.copy(f"{tiny_qwen3_dir}/config.json", out / "config.json")
    return str(out)


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, device=DEVICE, dtype="float32", load_format="dummy", **kw)


def test_a_config_alone_runs_on_the_same_random_weights_each_time(config_only_dir):
    first, second = _llm(config_only_dir), _llm(config_only_dir)
    a, b = (dict(llm.engine.runner.model.named_parameters()) for llm in (first, second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    qkv = a["layers.0.self_attn.qkv_proj.weight"]
    assert 0 < qkv.abs().max() <= DUMMY_RANGE and qkv.std() > DUMMY_RANGE / 4
    # the fused rows are q, k and v's own draws (one seed for all would repeat q's first
    # rows in k and v)
    attn = first.engine.runner.model.layers[0].self_attn
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert not torch.equal(q[: attn.kv_size], k) and not torch.equal(k, v)
    assert first.engine.execution_path["weights"] == "dummy->float32"
    prompt = [{"prompt_token_ids": list(range(5, 40))}]
    outs = [llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0] for llm in (first, second)]
    assert len(outs[0].token_ids) == 6 and outs[0].token_ids == outs[1].token_ids


@pytest.mark.parametrize(
    "family",
    ["tiny_mixtral_dir", "tiny_deepseek_v3_dir", "tiny_phi3_dir", "tiny_bamba_dir",
     "tiny_jamba_dir", "tiny_nemotron_h_dir", "tiny_qwen3_next_dir", "tiny_glm4_moe_dir"],
)  # fmt: skip
def test_other_layouts_load_dummy_weights(family, request, tmp_path):
    """Families whose load fuses, stacks, splits or derives tensors (MoE experts, MLA's
    compressed projections, Phi-3's stored-fused q/k/v, the Mamba and Gated DeltaNet
    mixers) take the dummy tensors through it: every parameter drawn (none left zero),
    all finite, and a greedy run of 6 tokens."""
    shutil.copy(f"{request.getfixturevalue(family)}/config.json", tmp_path / "config.json")
    llm = _llm(str(tmp_path))
    params = dict(llm.engine.runner.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    drawn = [n for n, p in params.items() if p.abs().max() > 0]
    assert len(drawn) == len(params), sorted(set(params) - set(drawn))
    out = llm.generate([{"prompt_token_ids": list(range(5, 30))}], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_the_reference_runner_holds_the_same_weights(config_only_dir):
    mrv2 = _llm(config_only_dir).engine.runner.model
    ref = _llm(config_only_dir, runner="reference").engine.runner.model
    assert torch.equal(ref.model.embed_tokens.weight, mrv2.embed_tokens.weight)
    assert torch.equal(ref.model.norm.weight, mrv2.norm.weight)


def test_the_draws_are_seeded_by_name():
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    one = dict(dummy_weights(cfg, torch.float32, torch.device("cpu")))
    two = dict(dummy_weights(cfg, torch.float32, torch.device("cpu")))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    up, gate = one["model.layers.0.mlp.up_proj.weight"], one["model.layers.0.mlp.gate_proj.weight"]
    assert not torch.equal(up, gate)


def test_a_folder_without_weights_is_refused_without_dummy(config_only_dir):
    with pytest.raises(ValueError, match="no \\*.safetensors.*--load-format dummy"):
        LLM(model=config_only_dir, device=DEVICE, dtype="float32")
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, dummy"):
        LLM(model=config_only_dir, device=DEVICE, dtype="float32", load_format="pt")


@pytest.fixture(scope="module")
def weightless_chat_dir(smollm_dir, tmp_path_factory) -> str:
    """A small Llama's config.json beside SmolLM2's tokenizer: no weights at all."""
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("weightless")
    LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(out)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{smollm_dir}/{name}", out)
    return str(out)


def test_a_pd_server_with_the_bundled_tokenizer_runs_dummy_weights_alike(
    weightless_chat_dir, tmp_path
):
    """`pdserve serve --load-format dummy` in PD mode: the prompt prefills on the prefill
    worker and decodes on the decode worker from its KV, and the text equals the offline
    engine's on the same dummy weights; it could not if the two workers drew different
    ones. The server says at start that the weights are random."""
    from serve_server import Server
    from test_serve_e2e import _metric

    prompt = "Paris is the capital and largest city of France; the Seine runs through it, and"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=weightless_chat_dir, device="cpu", max_model_len=256, load_format="dummy")
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    del llm
    server = Server(tmp_path, "--model", weightless_chat_dir, "--device", "cpu",
                    "--max-model-len", "256", "--load-format", "dummy")  # fmt: skip
    try:
        out = server.client().completions.create(
            model=weightless_chat_dir, prompt=prompt, max_tokens=12, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.choices[0].text == want and out.usage.completion_tokens == 12
        metrics = server.metrics()
        assert _metric(metrics, "pdserve:pd_decisions_total", reason="remote_prefill") == 1
        assert "--load-format dummy: LlamaForCausalLM runs on random weights" in (
            server.log.read_text()
        )
    finally:
        server.stop()
