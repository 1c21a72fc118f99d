"""Rewrites a bf16 checkpoint directory as a GPTQ one (4-bit, groups of 128, v1 zero
points, no act-order): every decoder projection (`*_proj.weight` of the layers, experts
included) quantized by min/max per group and output, the rest kept. For benchmarks of the
packed-integer path (runner/models/packed_linear.py) on random models; not a test (the
tests pack by their own loops, tests/test_packed_int_checkpoints.py).

    python benchmarks/gptq_checkpoint.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BITS, GROUP = 4, 128


def _words(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of 4-bit codes packed along `dim` (0 or 1), lowest bits first."""
    c = codes.to(torch.int64)
    c = c.reshape(-1, 8, c.shape[1]).permute(0, 2, 1) if dim == 0 else c.reshape(c.shape[0], -1, 8)
    words = (c << torch.arange(0, 32, BITS, device=c.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_parts(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ v1 parts of a [N, K] weight (K a multiple of 128, N of 8)."""
    n, k = w.shape
    wt = w.t().float().reshape(k // GROUP, GROUP, n)  # [G, 128, N]
    lo, hi = wt.amin(1), wt.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = (-lo / s).round().clamp(1, 15).to(torch.int64)  # v1 stores zero - 1 >= 0
    codes = ((wt / s[:, None]).round() + zeros[:, None]).clamp(0, 15).reshape(k, n)
    return {"qweight": _words(codes, 0), "qzeros": _words(zeros - 1, 1), "scales": scales,
            "g_idx": (torch.arange(k) // GROUP).to(torch.int32)}  # fmt: skip


def to_gptq(path: Path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for file in sorted(path.glob("*.safetensors")):
        out = {}
        for name, t in load_file(file).items():
            if ".layers." in name and name.endswith("proj.weight") and t.dim() == 2:
                prefix = name.removesuffix(".weight")
                parts = gptq_parts(t.to(device))
                out.update({f"{prefix}.{p}": v.cpu().contiguous() for p, v in parts.items()})
            else:
                out[name] = t
        save_file(out, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": BITS, "group_size": GROUP, "desc_act": False,
        "sym": False, "checkpoint_format": "gptq",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    to_gptq(Path(sys.argv[1]))
