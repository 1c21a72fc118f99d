"""`pdserve serve`: Ray, the pools, the router, the ops endpoints and the HTTP server.

With no arguments: the bundled SmolLM2, 1 prefill + 1 decode worker on this machine
(CPU, or sharing one GPU with fractional `num_gpus`), PD mode, http://127.0.0.1:8000,
the dashboard at /dashboard. `--ray-address` joins a running cluster instead
(cluster/serve_placement.py); local workers' KV and step budgets are sized before Ray
starts (cluster/serve_sizing.py). Ctrl-C (or SIGTERM) stops uvicorn, then the workers,
then Ray (or leaves the joined cluster): no stray processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from pdserve.cluster.serve_args import (
    ServeConfig,
    auto_tool_parser,
    decode_capacity,
    grammar_in_reasoning,
    served_names,
)
from pdserve.cluster.serve_placement import join_auth_env
from pdserve.cluster.serve_sizing import default_batched_tokens, local_kv_bytes
from pdserve.cluster.startup_report import StartupLines


def check_lora_modules(cfg: ServeConfig, ecfg: Any, model_names) -> dict[str, str]:
    """`--lora-modules` read and checked at start (each adapter's files and rank, the
    model's family, names apart from the model's): name -> absolute folder."""
    from pdserve.runner.lora.adapter import load_adapter
    from pdserve.runner.lora.slots import check_model_class
    from pdserve.runner.models import MODEL_REGISTRY

    modules = {name: str(Path(path).resolve()) for name, path in cfg.lora_module_map.items()}
    if not cfg.enable_lora:
        return modules
    check_model_class(MODEL_REGISTRY[ecfg.model.architecture], ecfg.model.hf_config)
    for name, path in modules.items():
        if name in model_names:
            raise ValueError(f"--lora-modules: {name!r} is also the model's served name")
        load_adapter(name, path, cfg.max_lora_rank)
        print(f"pdserve: LoRA adapter {name!r} from {path}", flush=True)
    return modules


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before Ray starts: a port another process holds fails at
    once with a clear error instead of after the workers' start-up, and while Ray starts
    its own processes (which take ports at random) cannot take this one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def run_serve(cfg: ServeConfig) -> int:
    # The port first, before the heavy imports and the model: one another process holds
    # is a clear error in well under a second.
    http_sock = listen_socket(cfg.host, cfg.port)
    join_auth_env(cfg, os.environ)
    try:
        cfg.tls.load_check()  # as the server will load them, before Ray and the model
        return _serve(cfg, http_sock)
    finally:
        http_sock.close()


def _serve(cfg: ServeConfig, http_sock: socket.socket) -> int:
    import ray
    import torch
    import uvicorn

    from pdserve.cluster.autoscale import Autoscaler, autoscale_config, autoscale_loop
    from pdserve.cluster.chat_template import load_chat_template
    from pdserve.cluster.controller import Controller
    from pdserve.cluster.gpu_binding import actor_env, node_gpu_ids
    from pdserve.cluster.http_app import AppState, build_app
    from pdserve.cluster.lora_routes import ENV_SWITCH as LORA_SWITCH
    from pdserve.cluster.lora_routes import runtime_updates_allowed
    from pdserve.cluster.membership import membership_loop, sync_members
    from pdserve.cluster.metrics import Metrics
    from pdserve.cluster.openai_api import ApiDefaults
    from pdserve.cluster.ops_api import OpsState, add_ops_routes
    from pdserve.cluster.pool_actors import TierActor
    from pdserve.cluster.pool_control import PoolControl
    from pdserve.cluster.ray_pool import PoolSpec
    from pdserve.cluster.request_log import RequestLog
    from pdserve.cluster.response_store import ResponseStore
    from pdserve.cluster.route_policy import RouterConfig
    from pdserve.cluster.router import Router
    from pdserve.cluster.serve_placement import (
        actor_resources,
        kv_transport,
        local_placement,
        pool_bounds,
        start_ray,
    )
    from pdserve.cluster.server_load import LoadCounter
    from pdserve.cluster.shutdown import GracefulServer
    from pdserve.cluster.stats_log import stats_log_loop
    from pdserve.cluster.token_stream import TokenSubscriber
    from pdserve.runner.config import SchedulerConfig
    from pdserve.runner.config_resolve import resolve_engine_config
    from pdserve.runner.generation_defaults import sampling_defaults
    from pdserve.runner.hybrid import WHY as HYBRID_WHY
    from pdserve.runner.hybrid import is_hybrid
    from pdserve.runner.pooling import model_pooling
    from pdserve.runner.tokenizer import eos_token_ids, load_tokenizer

    # Resolve (and convert, once) the model here, so the workers only load it.
    ecfg = resolve_engine_config(
        model=cfg.model, dtype=cfg.dtype, device=cfg.device, max_model_len=cfg.max_model_len,
        block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs, runner=cfg.runner,
        hf_overrides=cfg.hf_overrides, kv_cache_dtype=cfg.kv_cache_dtype,
        mamba_cache_dtype=cfg.mamba_cache_dtype,
        mamba_ssm_cache_dtype=cfg.mamba_ssm_cache_dtype, quantization=cfg.quantization,
        quantized_weights=cfg.quantized_weights,
        trust_remote_code=cfg.trust_remote_code, tokenizer=cfg.tokenizer, revision=cfg.revision,
        download_dir=cfg.download_dir, load_format=cfg.load_format,
        speculative_config=cfg.speculative_config, async_scheduling=cfg.async_scheduling,
    )  # fmt: skip
    if cfg.load_format == "dummy":
        print(f"pdserve: --load-format dummy: {ecfg.model.architecture} runs on random weights "
              "(runner/models/dummy_weights.py), so its outputs mean nothing", flush=True)  # fmt: skip
    tier_bytes = cfg.tier_bytes
    hybrid = is_hybrid(ecfg.model.hf_config)
    if cfg.mode == "pd" and hybrid:
        if cfg.kv_layer_wise:
            raise ValueError(
                f"--kv-layer-wise is refused for {ecfg.model.architecture}: {HYBRID_WHY}"
            )
        if tier_bytes > 0:
            print(f"pdserve: the KV tier is off for {ecfg.model.architecture}: {HYBRID_WHY}",
                  flush=True)  # fmt: skip
            tier_bytes = 0
    if cfg.mode == "pd" and ecfg.runner.runner != "mrv2":
        raise ValueError(
            f"--mode pd moves paged KV blocks, which the {ecfg.runner.runner} runner does not "
            "have; use --mode colocated with it"
        )
    tokenizer = load_tokenizer(ecfg.model.tokenizer_path, cfg.trust_remote_code)
    if tokenizer is None:
        raise ValueError(
            f"{ecfg.model.tokenizer_path} has no tokenizer; the HTTP API needs one (--tokenizer)"
        )
    model_names = served_names(cfg)
    chat_template = load_chat_template(cfg.chat_template)
    defaults = sampling_defaults(
        cfg.generation_config, Path(ecfg.model.path), cfg.override_generation_config or {}
    )
    if defaults:
        print(f"pdserve: default sampling parameters (generation config): {defaults}", flush=True)
    if auto_tool_parser(cfg) is not None:
        print(f"pdserve: tool_choice auto: calls read by the {cfg.tool_call_parser} parser",
              flush=True)  # fmt: skip
    if cfg.reasoning_parser is not None:
        held = "whole replies" if grammar_in_reasoning(cfg) else "the answer after it"
        print(f"pdserve: chat replies' reasoning split off by the {cfg.reasoning_parser} "
              f"parser; structured output holds {held}", flush=True)  # fmt: skip
    lora_modules = check_lora_modules(cfg, ecfg, model_names)
    runtime_lora_rank = None
    if runtime_updates_allowed() and not cfg.enable_lora:
        print(f"pdserve: {LORA_SWITCH} is ignored without --enable-lora", flush=True)
    elif runtime_updates_allowed():
        runtime_lora_rank = cfg.max_lora_rank
        print("pdserve: LoRA adapters may be loaded and unloaded at run time "
              "(/v1/load_lora_adapter, /v1/unload_lora_adapter)", flush=True)  # fmt: skip
    engine_kwargs = dict(
        model=ecfg.model.path, dtype=cfg.dtype, device=cfg.device,
        max_model_len=ecfg.model.max_model_len, block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs, runner=cfg.runner, decode_attention=cfg.decode_attention,
        cuda_graph_scope=cfg.cuda_graph_scope, enforce_eager=cfg.enforce_eager,
        cuda_graph_sizes=cfg.cuda_graph_sizes,
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_num_batched_tokens=cfg.max_num_batched_tokens or default_batched_tokens(cfg, ecfg),
        scheduling_policy=cfg.scheduling_policy, num_gpu_blocks=cfg.num_gpu_blocks_override,
        enable_chunked_prefill=cfg.enable_chunked_prefill, async_scheduling=cfg.async_scheduling,
        enable_lora=cfg.enable_lora, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
        hf_overrides=cfg.hf_overrides, kv_cache_dtype=cfg.kv_cache_dtype,
        mamba_cache_dtype=cfg.mamba_cache_dtype,
        mamba_ssm_cache_dtype=cfg.mamba_ssm_cache_dtype,
        trust_remote_code=cfg.trust_remote_code, tokenizer=ecfg.model.tokenizer,
        load_format=cfg.load_format, speculative_config=cfg.speculative_config,
        quantized_weights=cfg.quantized_weights,
    )  # fmt: skip
    # The step budget's rules (e.g. no chunking needs a budget of max_model_len), refused
    # here rather than in every worker's start.
    SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=engine_kwargs["max_num_batched_tokens"],
        max_model_len=ecfg.model.max_model_len,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        policy=cfg.scheduling_policy,
    )
    if engine_kwargs["max_num_batched_tokens"] < cfg.max_num_seqs:  # vLLM's rule
        raise ValueError(
            f"--max-num-batched-tokens ({engine_kwargs['max_num_batched_tokens']}) must be >= "
            f"--max-num-seqs ({cfg.max_num_seqs}): each running request decodes a token of "
            "every step's budget"
        )
    local_gpu = torch.cuda.is_available() and cfg.device != "cpu" and cfg.ray_address is None
    transport = kv_transport(cfg, local_gpu)
    if transport == "cuda_ipc" and not (local_gpu or cfg.ray_address):
        raise ValueError("--kv-transport cuda_ipc needs the workers on a GPU (this runs on CPU)")
    num_workers = cfg.decode_workers + (cfg.prefill_workers if cfg.mode == "pd" else 0)
    local = None
    if cfg.ray_address is None:  # sizes that cannot fit are refused before Ray starts
        local = local_placement(cfg, torch.cuda.device_count() if local_gpu else 0, num_workers)
        kv_bytes = local_kv_bytes(cfg, Path(ecfg.model.path), local, num_workers)
        if kv_bytes is not None:
            engine_kwargs["kv_cache_memory_bytes"] = kv_bytes
    placement = start_ray(cfg, local)
    if placement.joined and transport == "cuda_ipc":
        print(
            "pdserve: warning: --kv-transport cuda_ipc moves KV only between workers on one "
            "node; in a multi-node cluster keep each prefill and decode pair on one node, or "
            "use tcp",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    try:  # until the try below owns the cleanup: a refusal here must not leave Ray up
        if placement.joined:
            # Workers on other nodes resolve (and convert) the model themselves, and each takes
            # whole GPUs: its engine sizes its KV cache from its own GPU.
            engine_kwargs["model"] = cfg.model
            engine_kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            engine_kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        host = placement.host
        stream_bind = f"tcp://{host}:{_free_port(host)}"
        tier = None
        if tier_bytes > 0 and cfg.mode == "pd":  # prefill workers are its writers
            tier = (
                ray.remote(TierActor)
                .options(
                    num_cpus=0, name="pdserve-tier",
                    resources=actor_resources(cfg.pool_resources, "tier"),
                )
                .remote(tier_bytes)
            )  # fmt: skip
        whole = placement.gpus_per_worker >= 1 < placement.num_gpus and not placement.joined
        spec = PoolSpec(
            engine_kwargs,
            cfg.prefill_workers if cfg.mode == "pd" else 0,
            cfg.decode_workers,
            stream_bind,
            cfg.policy,
            cfg.lease_s,
            gpus_per_worker=placement.gpus_per_worker,
            tier=tier,
            kv_transport=transport,
            kv_layer_wise=cfg.kv_layer_wise,
            dist_init_method=(f"tcp://{host}:{_free_port(host)}" if transport == "nccl" else None),
            # Whole-GPU workers see the node's other GPUs too (cuda_ipc between GPUs).
            actor_env=actor_env(node_gpu_ids(placement.num_gpus)) if whole else None,
            pool_resources=cfg.pool_resources,
            bind_node_ip=placement.joined,
        )
        bounds = pool_bounds(cfg, placement)
        controller = (
            ray.remote(Controller)
            .options(num_cpus=0, name="pdserve-controller")
            .remote(spec, cfg.health_interval_s, bounds, cfg.worker_start_timeout_s)
        )
    except BaseException:
        ray.shutdown()
        raise
    try:
        print(f"pdserve: starting {num_workers} worker(s) on Ray ({ecfg.model.source})", flush=True)
        members = ray.get(controller.start.remote(), timeout=900)
        announced = StartupLines(_print)
        announced.update(members)
        router = Router(
            RouterConfig(
                mode=cfg.mode,
                pd_min_prompt_tokens=cfg.pd_min_prompt_tokens,
                decode_prefix_slack=cfg.decode_prefix_slack,
                pd_max_prefill_queue_tokens=cfg.pd_max_prefill_queue_tokens,
                block_size=cfg.block_size,
                policy=cfg.policy,
                seed=cfg.seed,
                decode_capacity=decode_capacity(cfg),
                prefix_caching=cfg.enable_prefix_caching,
                state_snapshots=hybrid,
            ),
            [],
            [],
        )
        sync_members(router, members)
        router.tier = tier
        state = AppState(
            router, tokenizer, list(model_names), ecfg.model.max_model_len,
            Metrics(model_names[0], cfg.metrics_prefix),
            cfg.api_key, cfg.max_body_bytes, ecfg.runner.runner, defaults, chat_template,
            RequestLog(_print) if cfg.enable_log_requests else None, ecfg.model.vocab_size,
            cfg.scheduling_policy, auto_tool_parser(cfg), cfg.reasoning_parser, cfg.cors,
            ResponseStore(cfg.responses_store_bytes), lora_modules,
            model_pooling(ecfg.model.path, ecfg.model.hf_config, ecfg.model.classifier),
            runtime_lora_rank, eos_token_ids(ecfg.model.path, ecfg.model.hf_config, tokenizer),
            grammar_in_reasoning(cfg), not cfg.disable_fastapi_docs,
            ApiDefaults(cfg.max_logprobs, cfg.response_role, cfg.return_tokens_as_token_ids,
                        cfg.enable_force_include_usage, cfg.enable_prompt_tokens_details),
            LoadCounter(cfg.enable_server_load_tracking),
        )  # fmt: skip
        app = build_app(state)
        control = PoolControl(controller)
        autoscaler = (
            Autoscaler(autoscale_config(cfg.autoscale_policy), bounds) if cfg.autoscale else None
        )
        add_ops_routes(app, OpsState(control, cfg.admin_key, cfg.host, autoscaler), router,
                       state.metrics)  # fmt: skip

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            subscriber = TokenSubscriber(stream_bind, router.on_delta)
            subscriber.start()
            loops = [
                asyncio.create_task(
                    membership_loop(controller, router, cfg.health_interval_s, announced)
                )
            ]
            if autoscaler is not None:
                loops.append(asyncio.create_task(autoscale_loop(autoscaler, control, router)))
            if not cfg.disable_log_stats:
                loops.append(
                    asyncio.create_task(stats_log_loop(router, cfg.log_stats_interval_s, _print))
                )
            try:
                yield
            finally:
                for task in loops:
                    task.cancel()
                await asyncio.wait(loops, timeout=10)
                await state.background.close()
                await router.close()
                await subscriber.close()

        app.router.lifespan_context = lifespan
        root = f"{cfg.tls.scheme}://{cfg.host}:{cfg.port}"
        print(
            f"pdserve: serving {model_names[0]!r} at {root}/v1 — mode "
            f"{cfg.mode}, {len(router.prefill_workers)} prefill + {len(router.decode_workers)} "
            "decode worker(s), "
            + (f"KV over {transport}, " if cfg.mode == "pd" else "")
            + f"{'1 KV tier actor, ' if tier is not None else ''}"
            f"runner {ecfg.runner.runner}, "
            + (
                f"speculative {ecfg.speculative.describe()} "
                f"({'async' if ecfg.runner.async_scheduling else 'synchronous'} scheduling), "
                if ecfg.speculative is not None
                else ""
            )
            + (
                f"Ray cluster at {cfg.ray_address} ({placement.num_gpus} GPU(s))"
                if placement.joined
                else f"device {ecfg.runner.device}"
            )
            + f"; dashboard at {root}/dashboard"
            + (f", autoscaling within {bounds}" if autoscaler is not None else "")
            + (f"; every route also under {cfg.root_path} (--root-path)" if cfg.root_path else ""),
            flush=True,
        )
        server = GracefulServer(
            uvicorn.Config(
                _wrapped(app, cfg),
                host=cfg.host, port=cfg.port, log_level=cfg.uvicorn_log_level,
                access_log=not cfg.disable_uvicorn_access_log,
                h11_max_incomplete_event_size=cfg.h11_max_incomplete_event_size,
                **cfg.tls.uvicorn_kwargs(),
            ),
            cfg.shutdown_timeout_s, router.stop_requests,
        )  # fmt: skip
        # As uvicorn.run does: Ctrl-C ends the server (it re-raises the signal once its
        # graceful shutdown is done: cluster/shutdown.py) and the workers and Ray stop below.
        # SIGTERM comes back as Ray's driver handler makes it, SystemExit(15): a stop asked
        # for, done as Ctrl-C's.
        try:
            server.run(sockets=[http_sock])
        except KeyboardInterrupt:
            pass
        except SystemExit as e:
            if e.code != signal.SIGTERM:
                raise
    finally:
        http_sock.close()  # no new connections while the workers stop
        with contextlib.suppress(Exception):
            ray.get(controller.stop.remote(), timeout=30)
        if tier is not None:
            ray.kill(tier)
        ray.shutdown()
        print("pdserve: stopped", flush=True)
    return 0


def _wrapped(app: Any, cfg: ServeConfig) -> Any:
    """The ASGI app uvicorn runs: the API under `--root-path` too, behind the header-count
    bound."""
    from pdserve.cluster.http_limits import HeaderCountLimit
    from pdserve.cluster.root_path import RootPath

    if cfg.root_path:
        app = RootPath(app, cfg.root_path)
    if cfg.h11_max_header_count is not None:
        app = HeaderCountLimit(app, cfg.h11_max_header_count)
    return app


def _print(line: str) -> None:
    print(line, flush=True)
