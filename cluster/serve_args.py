"""`pdserve serve` configuration: flags and YAML with the same keys (no heavy imports)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from pdserve.cluster.reasoning import PARSERS as REASONING_PARSERS
from pdserve.cluster.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from pdserve.sizes import parse_size, size_arg

# Keys that may come from the environment when neither a flag nor the config file gives
# them (a Helm chart passes them from a Secret, never through the ConfigMap).
ENV_KEYS = {"api_key": "PDSERVE_API_KEY", "admin_key": "PDSERVE_ADMIN_KEY"}
UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SCHEDULING_POLICIES = ("fcfs", "priority")  # runner/config.py's, without importing torch
# Keys that take human-readable sizes ("32k", "4G"; pdserve/sizes.py), as vLLM's flags do.
SIZE_KEYS = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")


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
    # Requests the router may put on a decode worker beyond its max_num_seqs running ones
    # (prefilled ahead, they wait there); more wait in the router for the first worker
    # with room, so workers added by scaling take them. None: max_num_seqs.
    max_waiting_per_decode_worker: int | None = None
    # vLLM's: fcfs (arrival order) or priority (requests' `priority`, lower first), in the
    # router's queue and in every worker's scheduler.
    scheduling_policy: str = "fcfs"
    # Tokens per engine step (prefill chunks + decodes); None: vLLM's server default, 8,192
    # on GPUs of >= 70 GiB, else 2,048, and without chunked prefill at least max_model_len
    # (serve.default_batched_tokens).
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
    # How decode workers pull KV: "auto" (cuda_ipc for local GPU workers, else tcp;
    # serve_placement.kv_transport) | "tcp" | "cuda_ipc" (one node, GPU) | "nccl" (P2P in a
    # process group of all workers; gloo on CPU)
    kv_transport: str = "auto"
    # Layer-wise early tickets: a prompt's ticket goes out when its last chunk is
    # scheduled, and its KV streams to the decode worker layer by layer as the prefill
    # forward writes it (tcp only).
    kv_layer_wise: bool = False
    gpu_memory_utilization: float = 0.9  # of one GPU, shared by all its workers
    # vLLM's explicit KV sizes, per worker: bytes (then gpu_memory_utilization is not
    # used) or a number of blocks; None: sized from gpu_memory_utilization (GPU) or
    # 0.5 GiB (CPU).
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # Ray: None starts a local instance (and stops it at the end); "auto" or "HOST:PORT"
    # joins a running cluster (the Helm chart's head pod). Joined, the workers bind their
    # sockets to their node's address and resolve the model themselves.
    ray_address: str | None = None
    # Workers ask for a custom Ray resource per role (pdserve_prefill / pdserve_decode /
    # pdserve_tier, one unit each), so a cluster's node groups decide where each pool runs.
    pool_resources: bool = False
    gpus_per_worker: float | None = None  # None: whole GPUs where enough, else shares
    # Guards /ops/scale and /ops/drain (Bearer). Without it they are open only when the
    # server listens on a loopback address.
    admin_key: str | None = None
    # The pools follow load between these bounds (cluster/autoscale.py).
    autoscale: bool = False
    min_prefill_workers: int = 1
    max_prefill_workers: int = 4
    min_decode_workers: int = 1
    max_decode_workers: int = 4
    # Overrides of the autoscaler's marks and timings (config file only), e.g.
    # {"decode_kv_high": 0.9, "up_after_s": 30}: keys of cluster/autoscale.py's
    # AutoscaleConfig.
    autoscale_policy: dict | None = None
    # How long a worker added by scaling may take to start (a cluster autoscaler may have
    # to bring up a GPU node first) before it is given up.
    worker_start_timeout_s: float = 1200.0
    # vLLM's names for the same things (an operator's `vllm serve` flags carry over):
    # the names requests may give as "model" (the first is the one responses carry;
    # default: the model as given, or SmolLM2-135M-Instruct for the bundled one);
    served_model_name: tuple[str, ...] | None = None
    # the seed of the seeds the router picks for requests that give none (None: random);
    seed: int | None = None
    enable_prefix_caching: bool = True
    # Prompts longer than a step's token budget run in chunks (off: the budget must hold
    # max_model_len, as in vLLM); the CPU plans step N+1 while the GPU runs step N (None:
    # on a GPU, off on the CPU).
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None
    enforce_eager: bool = False  # no CUDA graphs
    # where requests' default sampling parameters come from: auto (the model's
    # generation_config.json), vllm (none) or a folder; the override's keys win
    # (runner/generation_defaults.py).
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # One GPU a worker: accepted at 1 so vLLM command lines parse, refused above.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"  # the KV cache is in the model's dtype
    # A Jinja chat template (a file, or the template itself) instead of the tokenizer's.
    chat_template: str | None = None
    # vLLM's: tool_choice auto (OpenAI's default with tools) is answered only with both,
    # the reply's calls read by the parser (cluster/tool_parsers/); otherwise a 400.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's: chat replies' thinking (`<think>` ... `</think>`) comes back as `reasoning`,
    # apart from the answer (cluster/reasoning/); None: replies are left as they are.
    reasoning_parser: str | None = None
    # The log: a line per pool every `log_stats_interval_s` (cluster/stats_log.py) unless
    # disabled; with enable_log_requests, lines for each request's arrival, route and end
    # (token counts, never text; cluster/request_log.py); uvicorn's own level and its
    # access log (one line per HTTP request, off at the default level).
    disable_log_stats: bool = False
    log_stats_interval_s: float = 10.0
    enable_log_requests: bool = False
    uvicorn_log_level: str = "warning"
    disable_uvicorn_access_log: bool = False

    def __post_init__(self) -> None:
        for name in SIZE_KEYS:  # a config file's "32k" or "4G"; flags arrive parsed
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, parse_size(value))
                except ValueError as e:
                    raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
        for name in SIZE_KEYS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                "--num-gpu-blocks-override must be >= 2 (block 0 is the reserved null "
                f"block), got {self.num_gpu_blocks_override}"
            )
        if isinstance(self.served_model_name, str):  # one name, from a config file
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        elif self.served_model_name is not None:
            object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        if self.served_model_name is not None and not (
            self.served_model_name and all(isinstance(n, str) and n for n in self.served_model_name)
        ):
            raise ValueError("--served-model-name needs one or more non-empty names")
        if self.override_generation_config is not None:
            from pdserve.runner.generation_defaults import parse_override

            object.__setattr__(
                self, "override_generation_config", parse_override(self.override_generation_config)
            )
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
        ):
            if value != 1:
                raise ValueError(
                    f"{flag} {value}: a pdserve worker runs on one GPU; scale out with "
                    "--prefill-workers and --decode-workers"
                )
        if self.kv_cache_dtype != "auto":
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype}: only auto (the model's dtype) is "
                "supported"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser "
                f"({' or '.join(TOOL_CALL_PARSERS)}): the syntax the model writes its tool "
                "calls in"
            )
        if not self.log_stats_interval_s > 0:
            raise ValueError(f"--log-stats-interval must be > 0, got {self.log_stats_interval_s}")
        if self.uvicorn_log_level not in UVICORN_LEVELS:
            raise ValueError(
                f"--uvicorn-log-level must be one of {', '.join(UVICORN_LEVELS)}, got "
                f"{self.uvicorn_log_level!r}"
            )
        if self.mode not in ("pd", "colocated"):
            raise ValueError(f"--mode must be pd or colocated, got {self.mode!r}")
        if self.decode_workers < 1:
            raise ValueError("--decode-workers must be >= 1")
        if self.mode == "pd" and self.prefill_workers < 1:
            raise ValueError("--mode pd needs --prefill-workers >= 1")
        if self.kv_transport not in ("auto", "tcp", "cuda_ipc", "nccl"):
            raise ValueError(
                f"--kv-transport must be auto, tcp, cuda_ipc or nccl, got {self.kv_transport!r}"
            )
        if self.kv_layer_wise and self.kv_transport not in ("auto", "tcp"):
            raise ValueError(
                "--kv-layer-wise streams KV over tcp; it cannot be used with "
                f"--kv-transport {self.kv_transport}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if (
            self.max_waiting_per_decode_worker is not None
            and self.max_waiting_per_decode_worker < 0
        ):
            raise ValueError(
                "--max-waiting-per-decode-worker must be >= 0, got "
                f"{self.max_waiting_per_decode_worker}"
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
        for name in ("api_key", "admin_key"):  # an unset variable in a launch script
            if getattr(self, name) is not None and not getattr(self, name).strip():
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} is empty: give a key, or leave {flag} out to run without one"
                )
        if self.worker_start_timeout_s <= 0:
            raise ValueError(
                f"worker_start_timeout_s must be > 0, got {self.worker_start_timeout_s}"
            )
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        for role in ("prefill", "decode"):
            lo = getattr(self, f"min_{role}_workers")
            hi = getattr(self, f"max_{role}_workers")
            if not 0 <= lo <= hi:
                raise ValueError(
                    f"--min-{role}-workers / --max-{role}-workers must satisfy "
                    f"0 <= min <= max, got {lo} and {hi}"
                )
        if self.autoscale_policy is not None:
            from pdserve.cluster.autoscale import autoscale_config

            autoscale_config(self.autoscale_policy)  # raises naming a bad key or value
        if self.autoscale:
            if self.kv_transport == "nccl":
                raise ValueError("--autoscale cannot resize an nccl KV group; use tcp or cuda_ipc")
            if not self.min_decode_workers <= self.decode_workers <= self.max_decode_workers:
                raise ValueError(
                    f"--decode-workers {self.decode_workers} is outside --min/--max-decode-"
                    f"workers [{self.min_decode_workers}, {self.max_decode_workers}]"
                )
            if self.mode == "pd" and not (
                max(1, self.min_prefill_workers) <= self.prefill_workers <= self.max_prefill_workers
            ):
                raise ValueError(
                    f"--prefill-workers {self.prefill_workers} is outside --min/--max-prefill-"
                    f"workers [{self.min_prefill_workers}, {self.max_prefill_workers}]"
                )


def auto_tool_parser(cfg: ServeConfig) -> str | None:
    """The parser that reads tool_choice auto's calls; None: auto is refused. As in vLLM, a
    parser without --enable-auto-tool-choice does not answer auto."""
    return cfg.tool_call_parser if cfg.enable_auto_tool_choice else None


def decode_capacity(cfg: ServeConfig) -> int:
    """The router's slots per decode worker: its max_num_seqs running requests and
    max_waiting_per_decode_worker more (default as many again) waiting on it."""
    waiting = cfg.max_waiting_per_decode_worker
    return cfg.max_num_seqs + (cfg.max_num_seqs if waiting is None else waiting)


def served_names(cfg: ServeConfig) -> tuple[str, ...]:
    """The names requests may give as "model", as vLLM picks them: `--served-model-name`,
    else the model as given (a Hub id or a path), else the bundled model's name."""
    if cfg.served_model_name:
        return cfg.served_model_name
    return (cfg.model,) if cfg.model else ("SmolLM2-135M-Instruct",)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")  # fmt: skip
    p.add_argument("--config", default=None, help="YAML file with the same keys (flags win)")
    p.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may give as 'model'; responses carry the first "
                   "(default: the model as given)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling seeds for requests that give none "
                   "(default: random)")  # fmt: skip
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None, help="prefill long prompts in chunks of the step budget; "
                   "off needs --max-num-batched-tokens >= --max-model-len (default on)")  # fmt: skip
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 while the GPU runs step N (default: on a GPU)")  # fmt: skip
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse cached KV blocks of shared prompt prefixes "
                   "(default on)")  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="GPU: run without CUDA graphs")  # fmt: skip
    p.add_argument("--generation-config", default=None,
                   help="requests' default sampling parameters: auto (the model's "
                   "generation_config.json), vllm (none) or a folder (default auto)")  # fmt: skip
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='default sampling parameters over the generation config\'s, e.g. '
                   '\'{"temperature": 0.7}\'')  # fmt: skip
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=None,
                   help="1 only: a worker runs on one GPU")  # fmt: skip
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None,
                   help="1 only: a worker runs on one GPU")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default=None, help="auto only: the model's dtype")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template itself) to use instead "
                   "of the tokenizer's")  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="answer tool_choice auto (OpenAI's default with tools): the model "
                   "answers freely and --tool-call-parser reads its calls (needs it)")  # fmt: skip
    p.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default=None,
                   help="the syntax of the model's tool calls: hermes (<tool_call> blocks: "
                   "Hermes, Qwen2.5, Qwen3) or llama3_json (JSON objects: Llama 3.1, 3.2)")  # fmt: skip
    p.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                   help="return chat replies' thinking (<think> ... </think>) as 'reasoning', "
                   "apart from the answer: qwen3 (Qwen3; a reply not opening with <think> is "
                   "all answer) or deepseek_r1 (DeepSeek-R1, Qwen3 Thinking-2507: the reply "
                   "opens in the thinking)")  # fmt: skip
    p.add_argument("--disable-log-stats", action="store_true", default=None,
                   help="no periodic per-pool stats lines in the log")  # fmt: skip
    p.add_argument("--log-stats-interval", type=float, default=None, dest="log_stats_interval_s",
                   metavar="SECONDS", help=f"default {d.log_stats_interval_s:g}")  # fmt: skip
    p.add_argument("--enable-log-requests", action="store_true", default=None,
                   help="log each request's arrival, route and end (token counts, not text)")  # fmt: skip
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LEVELS, default=None,
                   help=f"default {d.uvicorn_log_level}")  # fmt: skip
    p.add_argument("--disable-uvicorn-access-log", action="store_true", default=None)
    p.add_argument("--host", default=None, help=f"default {d.host}")
    p.add_argument("--port", type=int, default=None, help=f"default {d.port}")
    p.add_argument("--mode", choices=["pd", "colocated"], default=None, help="default pd")
    p.add_argument("--prefill-workers", type=int, default=None)
    p.add_argument("--decode-workers", type=int, default=None)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (env PDSERVE_API_KEY)",
    )
    p.add_argument("--max-model-len", type=size_arg, default=None,
                   help="longest prompt + output, e.g. 4096 or 32k (= 32,000) or 32K "
                   "(= 32,768) (default 4096, at most the model's)")  # fmt: skip
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-waiting-per-decode-worker", type=int, default=None, metavar="N",
                   help="requests the router may queue on a decode worker beyond its "
                   "--max-num-seqs running ones; more wait in the router for the first "
                   "worker with room, a newly scaled one included (default: --max-num-seqs)")  # fmt: skip
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=None,
                   help="fcfs: requests in arrival order; priority: by each request's "
                   "'priority' field (lower first, then arrival), in the router's queue and "
                   "the workers' schedulers (default fcfs)")  # fmt: skip
    p.add_argument(
        "--max-num-batched-tokens",
        type=size_arg,
        default=None,
        help="tokens per engine step (default: 8192 on GPUs of >= 70 GiB, else 2048)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"share of each GPU for weights + KV cache (default {d.gpu_memory_utilization})",
    )
    p.add_argument("--kv-cache-memory-bytes", type=size_arg, default=None, metavar="SIZE",
                   help="each worker's KV cache in bytes, e.g. 8G (= 8 GiB); then "
                   "--gpu-memory-utilization is not used (default: sized from it on a GPU, "
                   "0.5 GiB on the CPU)")  # fmt: skip
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="each worker's KV cache in blocks of --block-size tokens, whatever "
                   "the memory (default: sized from memory)")  # fmt: skip
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
    p.add_argument("--kv-transport", choices=["auto", "tcp", "cuda_ipc", "nccl"], default=None,
                   help="how decode workers pull KV from prefill workers (default auto: "
                   "cuda_ipc when the workers are on this node's GPUs, else tcp)")  # fmt: skip
    p.add_argument("--kv-layer-wise", action="store_true", default=None,
                   help="pd mode, tcp: stream each layer's KV to the decode worker as the "
                   "prefill forward writes it, with the ticket sent before the forward")  # fmt: skip
    p.add_argument("--pd-max-prefill-queue-tokens", type=int, default=None,
                   help="pd mode: when every prefill worker has this many prompt tokens in "
                   "flight, prefill on the decode worker instead (default 0: always remote)")  # fmt: skip
    p.add_argument("--policy", choices=["recompute", "fail"], default=None,
                   help="when a remote prefill or KV pull fails (default recompute)")  # fmt: skip
    p.add_argument("--ray-address", default=None,
                   help="join a running Ray cluster ('auto' or HOST:PORT) instead of starting "
                   "a local one")  # fmt: skip
    p.add_argument("--pool-resources", action="store_true", default=None,
                   help="workers ask for the Ray resources pdserve_prefill / pdserve_decode / "
                   "pdserve_tier, so node groups decide where each pool runs")  # fmt: skip
    p.add_argument("--gpus-per-worker", type=float, default=None,
                   help="GPUs each worker takes (default: whole GPUs where there are enough, "
                   "else equal shares)")  # fmt: skip
    p.add_argument("--admin-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /ops/scale and /ops/drain "
                   "(env PDSERVE_ADMIN_KEY; without one they are open only on a loopback host)")  # fmt: skip
    p.add_argument("--autoscale", action="store_true", default=None,
                   help="scale the pools with load, within the --min/--max-*-workers bounds")  # fmt: skip
    for role in ("prefill", "decode"):
        for bound in ("min", "max"):
            p.add_argument(f"--{bound}-{role}-workers", type=int, default=None,
                           help=f"--autoscale and /ops/scale bound (default "
                           f"{getattr(d, f'{bound}_{role}_workers')})")  # fmt: skip


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
        for key, value in data.items():
            check_file_value(args.config, key, value)
        values.update(data)
    for f in fields(ServeConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
        values["model"] = tag
    return with_env(ServeConfig(**values), os.environ)


# What each annotation of ServeConfig takes from a YAML file (sizes may also be strings).
_FILE_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "dict": ((dict,), "a mapping"),
    "tuple[str, ...]": ((str, list), "a name or a list of names"),
}


def check_file_value(path: str, key: str, value) -> None:
    """Refuse a config file's value whose YAML type the key cannot take (`port: "80"`,
    `autoscale: yes please`), naming the key, before anything compares it to a number."""
    annotation = next(f.type for f in fields(ServeConfig) if f.name == key)
    kinds = [k.strip() for k in str(annotation).split("|")]
    if value is None and "None" in kinds:
        return
    base = next(k for k in kinds if k != "None")
    types, described = _FILE_TYPES[base]
    if key in SIZE_KEYS:
        types, described = (int, str), "an integer or a size like 32k"
    elif key == "override_generation_config":  # as the flag takes it, or as YAML
        types, described = (dict, str), "a mapping or a JSON object"
    if isinstance(value, bool) and bool not in types:  # YAML's true is not the number 1
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        none = " or null" if "None" in kinds else ""
        raise ValueError(f"{path}: {key} must be {described}{none}, got {value!r}")


def with_env(cfg: ServeConfig, env) -> ServeConfig:
    """`cfg` with the keys of ENV_KEYS that flags and file left unset taken from `env`."""
    found = {k: env[v] for k, v in ENV_KEYS.items() if getattr(cfg, k) is None and env.get(v)}
    return replace(cfg, **found) if found else cfg
