"""Layouts, fill rule and source-process launcher shared by tests/test_gpu_cuda_ipc.py,
tests/test_gpu_peer_ipc.py and their source process (gpu_ipc_source_proc.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from pdserve.kernels.kv_pack import bitwise_view
from pdserve.kvtransfer.layout import (
    KVLayout,
    MambaStateGroup,
    PagedGQAGroup,
    PagedMLAGroup,
)

_GQA = PagedGQAGroup("kv", 28, 16, 8, 128, "bfloat16")  # the Qwen3-0.6B shape
_MLA = PagedMLAGroup("latent", 4, 16, 512, 64, "bfloat16")  # DeepSeek-style latent
_MAMBA = MambaStateGroup("mamba", 3, (96, 3), (8, 64, 16), "bfloat16", "float32")

# name -> (layout, units per storage)
LAYOUTS = {
    "paged_gqa": (KVLayout("qwen3-shape", (_GQA,)), (64,)),
    "paged_mla": (KVLayout("mla", (_MLA,)), (40,)),
    "mamba_state": (KVLayout("mamba", (_MAMBA,)), (6,)),
    "hybrid": (KVLayout("hybrid", (_GQA, _MAMBA)), (64, 6)),
}
# name -> (source units per group, destination units per group)
_GQA_UNITS = ((3, 4, 5, 9, 40, 41, 63), (10, 11, 12, 2, 50, 51, 0))
UNITS = {
    "paged_gqa": ((_GQA_UNITS[0],), (_GQA_UNITS[1],)),
    "paged_mla": (((1, 2, 39, 7),), ((30, 31, 0, 8),)),
    "mamba_state": (((4,),), ((1,),)),
    "hybrid": ((_GQA_UNITS[0], (4,)), (_GQA_UNITS[1], (1,))),
}


def fill(storages, seed: int) -> None:
    """Random bits (NaN payloads included), generated on the CPU so both processes agree."""
    gen = torch.Generator().manual_seed(seed)
    for storage in storages:
        for t in storage.tensors:
            bits = bitwise_view(t)
            info = torch.iinfo(bits.dtype)
            host = torch.randint(
                info.min, info.max, tuple(t.shape), generator=gen, dtype=bits.dtype
            )
            bits.copy_(host.to(t.device))


@contextlib.contextmanager
def source_process(name: str, device: str = "cuda", visible: str | None = None) -> Iterator[str]:
    """gpu_ipc_source_proc.py serving layout `name` from `device` (seeing the GPUs as
    `visible`, a CUDA_VISIBLE_DEVICES value, when given); yields its cuda_ipc endpoint and
    checks it exits cleanly once told to stop."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible) if visible is not None else None
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "gpu_ipc_source_proc.py"), name, device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield "cuda_ipc+" + proc.stdout.readline().strip()
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0
