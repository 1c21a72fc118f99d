"""A PEFT LoRA adapter read from its folder: `adapter_config.json` and
`adapter_model.safetensors` (a pickled `adapter_model.bin` is refused: no pickle).

Each targeted projection `W` of decoder layer `i` gets `W x + s * B (A x)` with
`A [r, in]`, `B [out, r]` and `s = lora_alpha / r` (`lora_alpha / sqrt(r)` with
`use_rslora`). What PEFT can express beyond that (DoRA, trained biases, extra saved
modules, per-module ranks, embedding or LM-head adapters) is refused by name rather than
served wrong.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# The projections an adapter may target, by the names PEFT saves them under (Phi-3's
# checkpoints fuse q/k/v and gate/up, so its adapters target the fused ones; Granite
# 4.0-H's shared MLP is `input_linear` (gate and up) and `output_linear`; a Mamba mixer's
# are `in_proj` and `out_proj`).
TARGETS = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj",
    "gate_proj", "up_proj", "gate_up_proj", "down_proj",
    "input_linear", "output_linear", "in_proj", "out_proj",
)  # fmt: skip
# The modules that hold them: attention, MLPs (Bamba's `feed_forward`, Granite 4.0-H's
# `shared_mlp`), Mamba mixers, and NemotronH's one-mixer blocks (its MoE blocks' shared
# expert: `mixer.shared_experts`)
_CONTAINERS = (
    "self_attn", "mlp", "feed_forward", "shared_mlp", "mamba", "mixer", "mixer.shared_experts",
)  # fmt: skip
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:"
    + "|".join(map(re.escape, _CONTAINERS))
    + r")\.("
    + "|".join(TARGETS)
    + r")\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
# adapter_config.json entries that change the math; refused when set
_REFUSED = {
    "use_dora": "DoRA",
    "modules_to_save": "extra saved modules",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "fan_in_fan_out": "fan-in-fan-out weights",
}


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    # (layer, target) -> (A [r, in], B [out, r] times the scaling), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {folder}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} ({key}) are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r})")
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise ValueError(
            f"LoRA adapter {name!r} has rank {rank}; the engine serves ranks up to "
            f"{max_rank}: raise max_lora_rank (--max-lora-rank)"
        )
    alpha = float(config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(
            f"LoRA adapter {name!r}: no adapter_model.safetensors in {folder} (a pickled "
            "adapter_model.bin is not read; convert it with safetensors)"
        )
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(weights_file), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _KEY.search(key)
            if match is None:
                raise ValueError(
                    f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B of a decoder "
                    f"layer's projection ({', '.join(TARGETS)})"
                )
            layer, target, half = int(match[1]), match[2], match[3]
            halves[(layer, target, half)] = f.get_tensor(key).float()
    weights = {}
    for (layer, target, half), tensor in halves.items():
        if half == "B":
            continue
        b = halves.get((layer, target, "B"))
        if b is None:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} has A but no B")
        a = tensor
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {target} A {tuple(a.shape)} / B "
                f"{tuple(b.shape)} do not have rank r={rank}"
            )
        weights[(layer, target)] = (a, b * scale)
    unpaired = {(layer, t) for layer, t, h in halves if h == "B"} - set(weights)
    if unpaired:
        raise ValueError(f"LoRA adapter {name!r}: B without A at {sorted(unpaired)}")
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {weights_file}")
    return LoraAdapter(name, rank, weights)
