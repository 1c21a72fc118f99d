"""`pdserve serve` configuration: `ServeConfig`, its checks and what is derived from it
(no heavy imports). The flags and the YAML file that fill it: cluster/serve_flags.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.cluster.cors import CorsConfig
from pdserve.cluster.metric_names import check_prefix
from pdserve.cluster.reasoning import PARSERS as REASONING_PARSERS
from pdserve.cluster.response_store import DEFAULT_STORE_BYTES
from pdserve.cluster.root_path import check_root_path
from pdserve.cluster.tls import TlsConfig
from pdserve.cluster.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from pdserve.json_arg import json_object
from pdserve.runner.sampling_params import MAX_LOGPROBS
from pdserve.sizes import parse_size

# Keys that may come from the environment when neither a flag nor the config file gives
# them (a Helm chart passes them from a Secret, never through the ConfigMap).
ENV_KEYS = {"api_key": "PDSERVE_API_KEY", "admin_key": "PDSERVE_ADMIN_KEY"}
UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SCHEDULING_POLICIES = ("fcfs", "priority")  # runner/config.py's, without importing torch
MAMBA_DTYPES = ("auto", "float32", "bfloat16", "float16")  # runner/config.py's, no torch
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # runner/config.py's names
QUANTIZED_WEIGHTS = ("auto", "packed", "dequantized")  # runner/config.py's names
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # runner/config.py's names
# Keys that take human-readable sizes ("32k", "4G"; pdserve/sizes.py), as vLLM's flags do.
SIZE_KEYS = (
    "max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes", "responses_store_bytes",
)  # fmt: skip
ZERO_SIZES = ("responses_store_bytes",)  # size keys that may be 0 (off)


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
    # (serve_sizing.default_batched_tokens).
    max_num_batched_tokens: int | None = None
    runner: str = "auto"
    # The Triton decode attention kernel: auto | per_head | packed | flat (runner/config.py)
    decode_attention: str = "auto"
    # What a decode CUDA graph holds: layers | step (runner/config.py)
    cuda_graph_scope: str = "step"
    # vLLM's: the decode batch sizes captured (runner/mrv2/cuda_graphs.py); None: default
    cuda_graph_sizes: list[int] | None = None
    dtype: str = "auto"
    device: str = "auto"
    policy: str = "recompute"
    pd_min_prompt_tokens: int = 16
    pd_max_prefill_queue_tokens: int = 0  # conditional disaggregation; 0 = always remote
    # The router sends a prompt to the decode worker with most of it cached among those
    # within this many requests in flight of the least busy (route_policy.prefer_cached).
    decode_prefix_slack: int = 8
    lease_s: float = 30.0
    max_body_bytes: int = 4 << 20
    # The router's memory for stored Responses API responses (`store`, previous_response_id,
    # GET /v1/responses/{id}); least recently used out first; 0 stores none.
    responses_store_bytes: int = DEFAULT_STORE_BYTES
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
    # vLLM's: keys set on the model's transformers config (runner/hf_overrides.py), e.g.
    # {"is_matryoshka": true}, or a causal LM converted into a reranker.
    hf_overrides: dict | None = None
    # vLLM's media limits a prompt: accepted at zero (images are refused, the vision tower
    # never loads: runner/models/text_only.py), refused above.
    limit_mm_per_prompt: dict | None = None
    # One GPU a worker: accepted at 1 so vLLM command lines parse, refused above.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"  # the model's dtype, or FP8 (fp8 = fp8_e4m3, fp8_e5m2)
    # vLLM's: a checkpoint's own Python (config, tokenizer) may run; a hub model's revision
    # and download folder
    trust_remote_code: bool = False
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    # vLLM's: "auto"/"safetensors" read the checkpoint, "dummy" makes random weights of its
    # shapes for timing (runner/models/dummy_weights.py; config.json and a tokenizer do)
    load_format: str = "auto"
    # vLLM's: speculative decoding (runner/config.py SpeculativeConfig), e.g.
    # {"method": "ngram", "num_speculative_tokens": 3}; None: off
    speculative_config: dict | None = None
    # vLLM's: the checkpoint's own quantization method (fp8, mxfp4) or None, or fp8 on a
    # 16-bit checkpoint (quantized at load, runner/models/fp8_online.py); any other is
    # refused at start (runner/models/fp8_weights.py check_quantization)
    quantization: str | None = None
    # a GPTQ / AWQ / compressed-tensors checkpoint's weights: auto, packed or dequantized
    # (runner/config.py QUANTIZED_WEIGHTS)
    quantized_weights: str = "auto"
    # vLLM's: a hybrid Mamba model's state dtypes (runner/config.py CacheConfig)
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "float32"
    # A Jinja chat template (a file, or the template itself) instead of the tokenizer's.
    chat_template: str | None = None
    # vLLM's: tool_choice auto (OpenAI's default with tools) is answered only with both,
    # the reply's calls read by the parser (cluster/tool_parsers/); otherwise a 400.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's: chat replies' thinking (`<think>` ... `</think>`) comes back as `reasoning`,
    # apart from the answer (cluster/reasoning/); None: replies are left as they are.
    reasoning_parser: str | None = None
    # vLLM's: {"enable_in_reasoning": true} holds a reply to its grammar from the first
    # token, thinking included; by default the grammar holds what follows the thinking
    # (cluster/reasoning_api.py). vLLM's backend choices have no meaning here: refused.
    structured_outputs_config: dict | None = None
    # The log: a line per pool every `log_stats_interval_s` (cluster/stats_log.py) unless
    # disabled; with enable_log_requests, lines for each request's arrival, route and end
    # (token counts, never text; cluster/request_log.py); uvicorn's own level and its
    # access log (one line per HTTP request, off at the default level).
    disable_log_stats: bool = False
    log_stats_interval_s: float = 10.0
    enable_log_requests: bool = False
    uvicorn_log_level: str = "warning"
    disable_uvicorn_access_log: bool = False
    # vLLM's --shutdown-timeout: on SIGTERM or Ctrl-C the server takes no new requests and
    # gives those running this long to finish; then each left ends with a 503 (a stream:
    # an error event and [DONE]) and is aborted on its workers (cluster/shutdown.py).
    # vLLM's default, 0, ends them at once; here they get 10 s.
    shutdown_timeout_s: float = 10.0
    # vLLM's --max-logprobs: the most logprobs a request may ask for a token (sampled or
    # of the prompt); pdserve's sampler returns at most MAX_LOGPROBS (20, vLLM's default).
    max_logprobs: int = MAX_LOGPROBS
    # vLLM's --disable-fastapi-docs: no /openapi.json (pdserve serves no /docs or /redoc).
    disable_fastapi_docs: bool = False
    # vLLM's response flags (cluster/openai_api.py ApiDefaults): a chat reply's role, the
    # default of requests' return_tokens_as_token_ids, usage at every stream's end,
    # prompt_tokens_details in every usage.
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    # /metrics names its series `<prefix>name`; "vllm:" lets vLLM's Grafana dashboards
    # and alerts read them unchanged (cluster/metrics.py).
    metrics_prefix: str = "pdserve:"
    # vLLM's LoRA flags (runner/lora/): adapters served beside the model; a request's
    # "model" may name one. `lora_modules` entries: "name=path" or a JSON object (or, in a
    # config file, a mapping) with "name" and "path".
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's TLS flags (cluster/tls.py): ssl_certfile turns TLS on for the router's port.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    ssl_ciphers: str | None = None
    # vLLM's: GET /load counts the model requests in flight (cluster/server_load.py).
    enable_server_load_tracking: bool = False
    # vLLM's bounds on the HTTP parser: bytes of a request's line and headers (uvicorn's
    # h11 setting), header fields of a request (more: a 431, cluster/http_limits.py).
    # None: uvicorn's, and no bound.
    h11_max_incomplete_event_size: int | None = None
    h11_max_header_count: int | None = None
    # vLLM's: the path prefix a proxy publishes the server under; routes answer with and
    # without it (cluster/root_path.py). "": none.
    root_path: str = ""
    # vLLM's CORS flags (cluster/cors.py): which browser origins may call the API.
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    @property
    def lora_module_map(self) -> dict[str, str]:
        """`--lora-modules` as name -> adapter folder (ValueError naming a bad entry)."""
        out: dict[str, str] = {}
        for entry in self.lora_modules:
            item = entry
            if isinstance(entry, str) and entry.lstrip().startswith("{"):
                try:
                    item = json.loads(entry)
                except ValueError:
                    raise ValueError(f"--lora-modules: {entry!r} is not a JSON object") from None
            if isinstance(item, dict):
                name, path = item.get("name"), item.get("path")
            elif isinstance(item, str) and "=" in item:
                name, path = item.split("=", 1)
            else:
                name = path = None
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                raise ValueError(
                    f'--lora-modules: {entry!r} must be name=path or {{"name": ..., "path": ...}}'
                )
            if name in out:
                raise ValueError(f"--lora-modules: the name {name!r} is given twice")
            out[name] = path
        return out

    @property
    def cors(self) -> CorsConfig:
        return CorsConfig(
            self.allowed_origins, self.allow_credentials, self.allowed_methods,
            self.allowed_headers,
        )  # fmt: skip

    @property
    def tls(self) -> TlsConfig:
        return TlsConfig(
            self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs, self.ssl_cert_reqs,
            self.ssl_ciphers,
        )  # fmt: skip

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
            least = 0 if name in ZERO_SIZES else 1
            if value is not None and value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
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
        if self.speculative_config is not None:
            from pdserve.json_arg import json_object
            from pdserve.runner.config import SpeculativeConfig

            spec = json_object("--speculative-config", self.speculative_config)
            SpeculativeConfig.from_dict(spec)  # refused at parse time, by name
            object.__setattr__(self, "speculative_config", spec)
        if self.structured_outputs_config is not None:
            from pdserve.json_arg import json_object

            so = json_object("--structured-outputs-config", self.structured_outputs_config)
            unknown = sorted(set(so) - {"enable_in_reasoning"})
            if unknown:
                raise ValueError(
                    f"--structured-outputs-config: {unknown} not supported; pdserve takes "
                    "enable_in_reasoning (its structured output has one backend, its own)"
                )
            if not isinstance(so.get("enable_in_reasoning", False), bool):
                raise ValueError("--structured-outputs-config: enable_in_reasoning is a boolean")
            object.__setattr__(self, "structured_outputs_config", so)
        if self.hf_overrides is not None:
            from pdserve.runner.hf_overrides import parse_hf_overrides

            object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        if self.override_generation_config is not None:
            from pdserve.runner.generation_defaults import parse_override

            object.__setattr__(
                self, "override_generation_config", parse_override(self.override_generation_config)
            )
        if self.limit_mm_per_prompt is not None:
            object.__setattr__(self, "limit_mm_per_prompt", _media_limits(self.limit_mm_per_prompt))
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
        ):
            if value != 1:
                raise ValueError(
                    f"{flag} {value}: a pdserve worker runs on one GPU; scale out with "
                    "--prefill-workers and --decode-workers"
                )
        if self.cuda_graph_sizes is not None and not (
            self.cuda_graph_sizes
            and all(isinstance(s, int) and s >= 1 for s in self.cuda_graph_sizes)
        ):
            raise ValueError(
                f"cuda_graph_sizes must be positive integers, got {self.cuda_graph_sizes!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.quantized_weights not in QUANTIZED_WEIGHTS:
            raise ValueError(
                f"--quantized-weights must be one of {', '.join(QUANTIZED_WEIGHTS)}, got "
                f"{self.quantized_weights!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
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
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ValueError(
                "--tool-call-parser openai reads the harmony calls that --reasoning-parser "
                "openai_gptoss hands on: give both (gpt-oss)"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser "
                f"({' or '.join(TOOL_CALL_PARSERS)}): the syntax the model writes its tool "
                "calls in"
            )
        if isinstance(self.lora_modules, str | list):  # a config file's one entry, or list
            entries = (
                [self.lora_modules] if isinstance(self.lora_modules, str) else self.lora_modules
            )
            object.__setattr__(self, "lora_modules", tuple(entries))
        if self.lora_module_map and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"--max-loras and --max-lora-rank must be >= 1, got {self.max_loras} and "
                f"{self.max_lora_rank}"
            )
        check_prefix(self.metrics_prefix)
        if self.decode_prefix_slack < 0:
            raise ValueError(f"--decode-prefix-slack must be >= 0, got {self.decode_prefix_slack}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)  # a config file's one string, or its list
            if isinstance(value, str | list):
                object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        _ = self.cors  # CorsConfig checks them
        _ = self.tls  # TlsConfig checks the flags' combinations (the files: at start)
        object.__setattr__(self, "root_path", check_root_path(self.root_path))
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0 <= self.shutdown_timeout_s < float("inf"):
            raise ValueError(
                f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout_s}"
            )
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"--max-logprobs must be in [0, {MAX_LOGPROBS}]: pdserve returns at most "
                f"{MAX_LOGPROBS} logprobs a token (got {self.max_logprobs}; vLLM's -1, the whole "
                "vocabulary, is not available)"
            )
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(
                f"--response-role must be a non-empty name, got {self.response_role!r}"
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
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(
                f"--pd-min-prompt-tokens must be >= 0, got {self.pd_min_prompt_tokens}"
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


def _media_limits(value: dict | str) -> dict:
    """`--limit-mm-per-prompt` as vLLM takes it (a JSON object of media kind -> count): only
    zeros run here, as no request may carry media."""
    value = json_object("--limit-mm-per-prompt", value)
    allowed = {k: v for k, v in value.items() if v not in (0, {"count": 0})}
    if allowed:
        raise ValueError(
            f"--limit-mm-per-prompt {allowed}: pdserve serves text only (images and other "
            "media are refused, no vision tower loads); give 0 for each kind"
        )
    return value


def grammar_in_reasoning(cfg: ServeConfig) -> bool:
    """Whether a grammar holds a reasoning reply from its first token (vLLM's
    `enable_in_reasoning`) rather than the answer after its thinking."""
    return bool((cfg.structured_outputs_config or {}).get("enable_in_reasoning", False))
