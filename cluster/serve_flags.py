"""`pdserve serve`'s flags and its YAML config file (the same keys), read into a
`ServeConfig` (cluster/serve_args.py): flags win over the file, the file over the
environment's keys (ENV_KEYS), and those over the defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields, replace
from pathlib import Path

from pdserve.cluster.cors import json_list
from pdserve.cluster.reasoning import PARSERS as REASONING_PARSERS
from pdserve.cluster.serve_args import (
    ENV_KEYS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MAMBA_DTYPES,
    QUANTIZED_WEIGHTS,
    SCHEDULING_POLICIES,
    SIZE_KEYS,
    UVICORN_LEVELS,
    ServeConfig,
)
from pdserve.cluster.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from pdserve.cluster.vllm_flags import add_vllm_flags
from pdserve.sizes import size_arg


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
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help='keys set on the model\'s config, e.g. \'{"is_matryoshka": true}\' '
                   "or a causal LM made a reranker (classifier_from_token)")  # fmt: skip
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='vLLM\'s per-prompt media limits: only zeros (e.g. \'{"image": 0}\'), '
                   "as images are refused and no vision tower loads")  # fmt: skip
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=None,
                   help="1 only: a worker runs on one GPU")  # fmt: skip
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None,
                   help="1 only: a worker runs on one GPU")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="let the checkpoint's own Python (its config or tokenizer class) run, "
                   "as transformers does with it; pdserve's models are its own")  # fmt: skip
    p.add_argument("--tokenizer", default=None,
                   help="a folder or hub id holding the tokenizer, when not the model's own")  # fmt: skip
    p.add_argument("--revision", default=None,
                   help="a hub model's branch, tag or commit to fetch (default: main)")  # fmt: skip
    p.add_argument("--download-dir", default=None,
                   help="where a hub model is fetched to (default: the hub's cache)")  # fmt: skip
    p.add_argument("--load-format", choices=list(LOAD_FORMATS), default=None,
                   help="dummy: random weights of the checkpoint's shapes, for timing without "
                   "fetching them (config.json and a tokenizer do)")  # fmt: skip
    p.add_argument("--quantized-weights", choices=list(QUANTIZED_WEIGHTS), default=None,
                   help="a GPTQ / AWQ / compressed-tensors checkpoint's integer weights or an "
                   "FP8 one's float8 bytes: auto (dequantized at load where 16-bit weights "
                   "leave the KV cache one max_model_len request, else packed), packed "
                   "(Triton int4/int8/fp8-weight kernels, 1.2-1.5x slower than 16-bit for "
                   "integers; fp8 with a scale a channel in bf16: W8A8 FP8 GEMMs, faster "
                   "than 16-bit) or dequantized")  # fmt: skip
    p.add_argument("-q", "--quantization", default=None, metavar="METHOD",
                   help="the checkpoint's own method (fp8, mxfp4, gptq, awq, "
                   "compressed-tensors) or none: read from its config either way; fp8 on a "
                   "16-bit checkpoint quantizes its Llama-family projections to FP8 at "
                   "load (a scale a channel); any other is refused")  # fmt: skip
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\': drafts from '
                   "the request's own text, verified in one step; its tokens are the same "
                   "as without; a step with drafts is waited for where it launches")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="the paged KV cache's: auto (the model's dtype) or FP8, half the "
                   "bytes a token (fp8 = fp8_e4m3; scales from the checkpoint, else 1.0)")  # fmt: skip
    p.add_argument("--mamba-cache-dtype", choices=list(MAMBA_DTYPES), default=None,
                   help="a hybrid Mamba model's conv state (default auto: the model's dtype)")  # fmt: skip
    p.add_argument("--mamba-ssm-cache-dtype", choices=list(MAMBA_DTYPES), default=None,
                   help="its SSM state (auto: as --mamba-cache-dtype; default float32, where "
                   "vLLM's default is auto)")  # fmt: skip
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template itself) to use instead "
                   "of the tokenizer's")  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="answer tool_choice auto (OpenAI's default with tools): the model "
                   "answers freely and --tool-call-parser reads its calls (needs it)")  # fmt: skip
    p.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default=None,
                   help="the syntax of the model's tool calls: hermes (<tool_call> blocks: "
                   "Hermes, Qwen2.5, Qwen3), llama3_json (JSON objects: Llama 3.1, 3.2), "
                   "pythonic (Llama 3.2, 4), mistral, granite, deepseek_v3, deepseek_v31, "
                   "qwen3_coder, glm45, seed_oss, openai (gpt-oss)")  # fmt: skip
    p.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                   help="return chat replies' thinking (<think> ... </think>) as 'reasoning', "
                   "apart from the answer: qwen3 (Qwen3; a reply not opening with <think> is "
                   "all answer) or deepseek_r1 (DeepSeek-R1, Qwen3 Thinking-2507: the reply "
                   "opens in the thinking), openai_gptoss (gpt-oss) or seed_oss")  # fmt: skip
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='\'{"enable_in_reasoning": true}\': with --reasoning-parser, hold a '
                   "reply to its grammar from the first token, thinking included (default: "
                   "the grammar holds the answer after the thinking, as vLLM's)")  # fmt: skip
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters (--lora-modules) beside the model")  # fmt: skip
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT adapter folders requests may name as 'model': name=path, or "
                   'a JSON object {"name": ..., "path": ...}')  # fmt: skip
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapter slots on each worker's device: adapters one batch mixes "
                   "(default 1)")  # fmt: skip
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the largest adapter rank served (default 16)")  # fmt: skip
    p.add_argument("--responses-store-bytes", type=size_arg, default=None, metavar="SIZE",
                   help="the router's memory for stored Responses API responses (store, "
                   "previous_response_id, GET /v1/responses/{id}), least recently used out "
                   "first; 0 stores none (default 256M)")  # fmt: skip
    p.add_argument("--disable-log-stats", action="store_true", default=None,
                   help="no periodic per-pool stats lines in the log")  # fmt: skip
    p.add_argument("--log-stats-interval", type=float, default=None, dest="log_stats_interval_s",
                   metavar="SECONDS", help=f"default {d.log_stats_interval_s:g}")  # fmt: skip
    p.add_argument("--enable-log-requests", action="store_true", default=None,
                   help="log each request's arrival, route and end (token counts, not text)")  # fmt: skip
    p.add_argument("--disable-log-requests", action="store_false", default=None,
                   dest="enable_log_requests",
                   help="vLLM's older flag: no per-request lines (the default)")  # fmt: skip
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LEVELS, default=None,
                   help=f"default {d.uvicorn_log_level}")  # fmt: skip
    p.add_argument("--disable-uvicorn-access-log", action="store_true", default=None)
    p.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="the most logprobs a request may ask for a token, sampled or of the "
                   f"prompt (default and most {d.max_logprobs})")  # fmt: skip
    p.add_argument("--response-role", default=None, metavar="ROLE",
                   help="a chat reply's role (with add_generation_prompt; default "
                   f"{d.response_role})")  # fmt: skip
    p.add_argument("--return-tokens-as-token-ids", action="store_true", default=None,
                   help="logprobs name tokens as 'token_id:N' unless a request says otherwise")  # fmt: skip
    p.add_argument("--enable-force-include-usage", action="store_true", default=None,
                   help="every stream ends with usage, as with stream_options.include_usage")  # fmt: skip
    p.add_argument("--enable-prompt-tokens-details", action="store_true", default=None,
                   help="usage always has prompt_tokens_details.cached_tokens (by default only "
                   "when a prefix hit was cached)")  # fmt: skip
    p.add_argument("--disable-fastapi-docs", action="store_true", default=None,
                   help="do not serve /openapi.json (no /docs or /redoc are served)")  # fmt: skip
    p.add_argument("--shutdown-timeout", type=float, default=None, dest="shutdown_timeout_s",
                   metavar="SECONDS", help="on SIGTERM or Ctrl-C, how long running requests may "
                   f"finish before each ends with a 503 (default {d.shutdown_timeout_s:g})")  # fmt: skip
    for flag, what in (
        ("origins", "browser origins"),
        ("methods", "HTTP methods"),
        ("headers", "request headers"),
    ):
        p.add_argument(f"--allowed-{flag}", type=_json_list, default=None, metavar="JSON",
                       help=f"CORS: the {what} the API allows, a JSON list (default "
                       "[\"*\"], as vLLM)")  # fmt: skip
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        default=None,
        help="CORS: allow credentials (default off, as vLLM)",
    )
    p.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (PEM; default plain HTTP)")  # fmt: skip
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="the certificate's key, unencrypted (unless --ssl-certfile holds it)")  # fmt: skip
    p.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates that client certificates are checked against")  # fmt: skip
    p.add_argument("--ssl-cert-reqs", type=int, default=None, metavar="N",
                   help="client certificates: 0 none (default), 1 optional, 2 required")  # fmt: skip
    p.add_argument("--ssl-ciphers", default=None, metavar="CIPHERS",
                   help="OpenSSL cipher list (default uvicorn's)")  # fmt: skip
    p.add_argument("--enable-server-load-tracking", action="store_true", default=None,
                   help="GET /load counts the model requests in flight (else it answers 0)")  # fmt: skip
    p.add_argument("--h11-max-incomplete-event-size", type=int, default=None, metavar="BYTES",
                   help="the most bytes of a request line and headers (default uvicorn's)")  # fmt: skip
    p.add_argument("--h11-max-header-count", type=int, default=None, metavar="N",
                   help="the most header fields of a request; more is a 431 (default no bound)")  # fmt: skip
    p.add_argument("--root-path", default=None, metavar="PREFIX",
                   help="the path prefix a proxy publishes the server under, e.g. /pdserve: "
                   "routes answer with and without it")  # fmt: skip
    p.add_argument("--metrics-prefix", default=None,
                   help=f"/metrics series names start with it (default {d.metrics_prefix}; "
                   "vllm: lets vLLM's Grafana dashboards read them)")  # fmt: skip
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
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes to capture CUDA graphs at (vLLM's; default 1, 2, "
                   "4, 8, every 16 to 256, every 32 to 1,024, up to max_num_seqs; sizes above "
                   "a step's bounds are dropped)")  # fmt: skip
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
    p.add_argument("--decode-prefix-slack", type=int, default=None, metavar="N",
                   help="send a prompt to the decode worker holding most of it in its prefix "
                   "cache among those within N requests in flight (or a quarter, if more) of "
                   f"the least busy (default {d.decode_prefix_slack}; 0: only among the least "
                   "busy)")  # fmt: skip
    p.add_argument("--pd-min-prompt-tokens", type=int, default=None, metavar="N",
                   help="pd mode: a prompt with fewer than N tokens not cached on its decode "
                   "worker prefills there, not on a prefill worker (default "
                   f"{d.pd_min_prompt_tokens})")  # fmt: skip
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
    add_vllm_flags(p)
    for role in ("prefill", "decode"):
        for bound in ("min", "max"):
            p.add_argument(f"--{bound}-{role}-workers", type=int, default=None,
                           help=f"--autoscale and /ops/scale bound (default "
                           f"{getattr(d, f'{bound}_{role}_workers')})")  # fmt: skip


def _json_list(text: str) -> list[str]:
    try:
        return json_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    "list[int]": ((list,), "a list of integers"),
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
