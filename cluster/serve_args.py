"""`pdserve serve` configuration: flags and YAML with the same keys (no heavy imports)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "pd"
    prefill_workers: int = 1
    decode_workers: int = 1
    api_key: str | None = None
    max_model_len: int | None = 4096
    block_size: int = 16
    max_num_seqs: int = 64
    # Tokens per engine step (prefill chunks + decodes); None: vLLM's server default, 8,192
    # on GPUs of >= 70 GiB, else 2,048 (serve.default_batched_tokens).
    max_num_batched_tokens: int | None = None
    runner: str = "auto"
    # The Triton decode attention kernel: auto | per_head | packed | flat (runner/config.py)
    decode_attention: str = "auto"
    # What a decode CUDA graph holds: layers | step (runner/config.py)
    cuda_graph_scope: str = "step"
    dtype: str = "auto"
    device: str = "auto"
    policy: str = "recompute"
    pd_min_prompt_tokens: int = 16
    pd_max_prefill_queue_tokens: int = 0  # conditional disaggregation; 0 = always remote
    lease_s: float = 30.0
    max_body_bytes: int = 4 << 20
    health_interval_s: float = 2.0
    tier_bytes: int = 1 << 30  # host memory of the KV tier actor; 0 = no tier
    # How decode workers pull KV: "tcp" | "cuda_ipc" (one node, GPU) | "nccl" (P2P in a
    # process group of all workers; gloo on CPU)
    kv_transport: str = "tcp"
    # Layer-wise early tickets: a prompt's ticket goes out when its last chunk is
    # scheduled, and its KV streams to the decode worker layer by layer as the prefill
    # forward writes it (tcp only).
    kv_layer_wise: bool = False
    gpu_memory_utilization: float = 0.9  # of one GPU, shared by all its workers

    def __post_init__(self) -> None:
        if self.mode not in ("pd", "colocated"):
            raise ValueError(f"--mode must be pd or colocated, got {self.mode!r}")
        if self.decode_workers < 1:
            raise ValueError("--decode-workers must be >= 1")
        if self.mode == "pd" and self.prefill_workers < 1:
            raise ValueError("--mode pd needs --prefill-workers >= 1")
        if self.kv_transport not in ("tcp", "cuda_ipc", "nccl"):
            raise ValueError(
                f"--kv-transport must be tcp, cuda_ipc or nccl, got {self.kv_transport!r}"
            )
        if self.kv_layer_wise and self.kv_transport != "tcp":
            raise ValueError(
                "--kv-layer-wise streams KV over tcp; it cannot be used with "
                f"--kv-transport {self.kv_transport}"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.pd_max_prefill_queue_tokens < 0:
            raise ValueError(
                "--pd-max-prefill-queue-tokens must be >= 0, got "
                f"{self.pd_max_prefill_queue_tokens}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("--config", default=None, help="YAML file with the same keys (flags win)")
    p.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct")
    p.add_argument("--host", default=None, help=f"default {d.host}")
    p.add_argument("--port", type=int, default=None, help=f"default {d.port}")
    p.add_argument("--mode", choices=["pd", "colocated"], default=None, help="default pd")
    p.add_argument("--prefill-workers", type=int, default=None)
    p.add_argument("--decode-workers", type=int, default=None)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step (default: 8192 on GPUs of >= 70 GiB, else 2048)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"share of each GPU for weights + KV cache (default {d.gpu_memory_utilization})",
    )
    p.add_argument("--runner", choices=["auto", "mrv2", "reference"], default=None)
    p.add_argument("--decode-attention", choices=["auto", "per_head", "packed", "flat"],
                   default=None,
                   help="GPU decode attention kernel: a program per kv head, all heads packed "
                   "in one, or per kv head with one program per SM walking several (flat: "
                   "slower at small batches on an H200) (default auto: chosen by batch shape)")  # fmt: skip
    p.add_argument("--cuda-graph-scope", choices=["layers", "step"], default=None,
                   help="GPU: what a decode CUDA graph holds: the layers, or the whole step "
                   "(input prep and, for greedy steps, LM head, argmax and token update: about "
                   "half the host time a step) (default step)")  # fmt: skip
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--kv-transport", choices=["tcp", "cuda_ipc", "nccl"], default=None,
                   help="how decode workers pull KV from prefill workers (default tcp)")  # fmt: skip
    p.add_argument("--kv-layer-wise", action="store_true", default=None,
                   help="pd mode, tcp: stream each layer's KV to the decode worker as the "
                   "prefill forward writes it, with the ticket sent before the forward")  # fmt: skip
    p.add_argument("--pd-max-prefill-queue-tokens", type=int, default=None,
                   help="pd mode: when every prefill worker has this many prompt tokens in "
                   "flight, prefill on the decode worker instead (default 0: always remote)")  # fmt: skip
    p.add_argument("--policy", choices=["recompute", "fail"], default=None,
                   help="when a remote prefill or KV pull fails (default recompute)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    values: dict = {}
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: the config file must be a mapping")
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in fields(ServeConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{args.config}: unknown keys {unknown}; known: {sorted(known)}")
        values.update(data)
    for f in fields(ServeConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return ServeConfig(**values)
