"""Kernel functions of the runner, each as `name(...)` plus `name_ref(...)` in plain torch.

The `_ref` functions are the specification and the CPU path. The public functions
dispatch: today every device runs the reference; [gpu-path] adds Triton kernels behind
the same signatures for CUDA tensors. Nothing here knows about requests or scheduling.
"""
