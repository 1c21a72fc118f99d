"""The SM count kernels size their grids by, once per device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU, where kernels run through
    Triton's interpreter: grids then keep their widest per-program shapes (the copy's
    multi-tile loop, several pairs per flat attention program), so tests cover them."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
