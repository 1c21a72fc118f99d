"""LoRA adapters on the hybrid Mamba models (runner/lora/slots.py): PEFT adapters on their
attention, their dense MLPs (Bamba's `feed_forward`, Granite 4.0-H's fused
`shared_mlp.input_linear` / `output_linear`, NemotronH's relu^2 `up_proj` / `down_proj`) and
their Mamba mixers' `in_proj` / `out_proj` give the tokens of transformers running the
merged model, beside the base model in one batch. Granite folds its residual multiplier
into the out projections at load, so their deltas must be scaled alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from conftest import hf_greedy
from safetensors.torch import load_file, save_file
from test_lora import _generate, _llm, _merged, _prompts
from test_mamba_hybrid import _granite_hybrid, _nemotron_moe

from pdserve import LoRARequest

MAMBA = ("in_proj", "out_proj")


def hybrid_adapter(base_dir: str, folder: Path, targets: tuple[str, ...], seed: int):
    """A rank-4 PEFT adapter (alpha 8) on every base projection named in `targets`,
    whichever layers have it; returns the merged weights' deltas by base name."""
    base = load_file(next(Path(base_dir).glob("*.safetensors")))
    pattern = re.compile(  # not the experts (`block_sparse_moe`): no LoRA there
        r"^(model|backbone)\.layers\.\d+\.(self_attn|feed_forward|shared_mlp|mamba|mixer"
        r"|mixer\.shared_experts)\.("
        + "|".join(targets) + r")\.weight$"
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for name in sorted(base):
        if not pattern.match(name):
            continue
        w = base[name]
        a = torch.randn(4, w.shape[1], generator=g) * 0.3
        b = torch.randn(w.shape[0], 4, generator=g) * 0.3
        prefix = f"base_model.model.{name.removesuffix('.weight')}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
        deltas[name] = 2.0 * (b @ a)
    assert {n.split(".")[-2] for n in deltas} == set(targets), "every target is somewhere"
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": list(targets),
              "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return deltas


def _check(base_dir: str, targets: tuple[str, ...], tmp_path: Path, seed: int) -> None:
    deltas = hybrid_adapter(base_dir, tmp_path / "a", targets, seed)
    merged = _merged(base_dir, deltas, tmp_path / "merged")
    prompts = _prompts(seed=seed)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    got = _generate(_llm(base_dir), prompts, [lora, None, lora, None])
    want = hf_greedy(merged, prompts[0::2], 12)
    assert got[0::2] == want
    assert got[1::2] == hf_greedy(base_dir, prompts[1::2], 12)
    assert want != hf_greedy(base_dir, prompts[0::2], 12), "the adapter must change tokens"


def test_bamba_adapter_matches_the_merged_model(tiny_bamba_dir, tmp_path):
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    _check(tiny_bamba_dir, targets + MAMBA, tmp_path, seed=1)


def test_granite_hybrid_adapter_matches_the_merged_model(tmp_path_factory, tmp_path):
    base = _granite_hybrid(tmp_path_factory, "granite-lora", num_local_experts=4,
                           intermediate_size=48, num_experts_per_tok=2)  # fmt: skip
    targets = ("q_proj", "v_proj", "o_proj", "input_linear", "output_linear")
    _check(base, targets + MAMBA, tmp_path, seed=2)


def test_nemotron_h_adapter_matches_the_merged_model(tiny_nemotron_h_dir, tmp_path):
    targets = ("q_proj", "k_proj", "o_proj", "up_proj", "down_proj")
    _check(tiny_nemotron_h_dir, targets + MAMBA, tmp_path, seed=3)


def test_nemotron_h_moe_adapter_matches_the_merged_model(tmp_path_factory, tmp_path):
    """Nemotron 3 Nano's form: the MoE blocks' shared expert (`mixer.shared_experts`)
    takes the adapter's up/down; the routed experts take none."""
    base = _nemotron_moe(tmp_path_factory, "nemotron-moe-lora")
    names = load_file(next(Path(base).glob("*.safetensors")))
    assert any(".mixer.shared_experts.up_proj." in n for n in names)
    _check(base, ("q_proj", "o_proj", "up_proj", "down_proj") + MAMBA, tmp_path, seed=4)


def test_jamba_adapter_matches_the_merged_model(tiny_jamba_dir, tmp_path):
    """Jamba: its attention, its dense layers' MLP and its Mamba1 mixers' in/out projections
    (the MoE layers' experts take none)."""
    targets = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    _check(tiny_jamba_dir, targets + MAMBA, tmp_path, seed=5)
