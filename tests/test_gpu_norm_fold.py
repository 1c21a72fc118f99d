"""The folded-norm chain in bf16 on the GPU: the path small decode batches take there.

test_norm_fold.py checks the chain against the plain model in float32. Here the model is
loaded as the engine loads it on CUDA in bf16 (norms folded by the loader), and the chain
is compared with the same folded weights run through the norm kernels (unit weights,
cuBLAS). The two round at different points (the chain scales a projection of the raw
residual stream; the norm path rounds the normed rows to bf16 before the projection), so
hidden states agree to bf16 noise, not bitwise: relative 2e-2 over 4 layers; a dropped
scale, residual or bias is off by O(1).
"""

from __future__ import annotations

import copy

import torch
from test_norm_fold import _load, _run_steps

from pdserve.runner.models.norm_fold import chain_applies


def test_bf16_chain_close_to_norm_path(qwen3_shaped_dir):
    chain = _load(qwen3_shaped_dir, torch.bfloat16)
    assert chain.norms_folded and chain_applies(chain, 32)
    norm_path = copy.deepcopy(chain)
    norm_path.folded_chain_max_tokens = 0  # same weights, norm kernels with unit weights
    h_chain, c_chain, l_chain = _run_steps(chain)
    h_norm, c_norm, l_norm = _run_steps(norm_path)
    for step, (a, b) in enumerate(zip(h_chain, h_norm, strict=True)):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert rel < 2e-2, f"step {step}: relative difference {rel:.3g}"
    for layer, (a, b) in enumerate(zip(c_chain, c_norm, strict=True)):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert rel < 2e-2, f"layer {layer} cache: relative difference {rel:.3g}"
    assert torch.equal(l_chain.argmax(-1), l_norm.argmax(-1))
