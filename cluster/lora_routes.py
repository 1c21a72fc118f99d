"""vLLM's runtime LoRA routes, served when the server runs with `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` in its environment (vLLM's switch; otherwise they
are not there, a 404), behind `--api-key` like every /v1 route:

    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}  -> 200 text
    POST /v1/unload_lora_adapter {"lora_name"}               -> 200 text

A load checks the folder (adapter_config.json, safetensors, rank <= --max-lora-rank) here
before the name is served; the workers load it into a slot when a request first names it
(the router sends its folder with each request, cluster/lora_registry.py). An unload stops
new requests naming it; those running finish with it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from pdserve.cluster.http_app import AppState, json_object, read_body
from pdserve.cluster.openai_api import ApiError

ENV_SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
CHECK_TIMEOUT_S = 120.0  # reading an adapter's files


def runtime_updates_allowed(environ: dict[str, str] | None = None) -> bool:
    """vLLM's switch: the variable set to 1 or true (any case)."""
    value = (environ if environ is not None else os.environ).get(ENV_SWITCH, "")
    return value.strip().lower() in ("1", "true")


def add_lora_routes(app: FastAPI, state: AppState, max_lora_rank: int) -> None:
    from pdserve.runner.lora.adapter import load_adapter

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = json_object(await read_body(request, state.max_body_bytes))
        name, path = _text(body, "lora_name"), _text(body, "lora_path")
        if name in state.loras or name in state.model_names:
            raise ApiError(f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")  # fmt: skip
        folder = str(Path(path).resolve())
        try:
            await asyncio.wait_for(
                asyncio.to_thread(load_adapter, name, folder, max_lora_rank), CHECK_TIMEOUT_S
            )
        except ValueError as e:
            raise ApiError(str(e), param="lora_path") from None
        except TimeoutError:
            raise ApiError(f"{folder} was not read within {CHECK_TIMEOUT_S:g} s", 500,
                           "server_error") from None  # fmt: skip
        if name in state.loras:  # loaded by a request that ran beside this one
            raise ApiError(f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")  # fmt: skip
        adapter = state.loras.add(name, folder)
        print(f"pdserve: LoRA adapter {name!r} loaded from {folder} (key {adapter.key!r})",
              flush=True)  # fmt: skip
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = json_object(await read_body(request, state.max_body_bytes))
        name = _text(body, "lora_name")
        if name not in state.loras:
            raise ApiError(f"The lora adapter '{name}' cannot be found.", 404,
                           "invalid_request_error", "lora_name", "model_not_found")  # fmt: skip
        state.loras.remove(name)
        print(f"pdserve: LoRA adapter {name!r} unloaded", flush=True)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _text(body: dict, key: str) -> str:
    value = body.get(key)
    if not (isinstance(value, str) and value):
        raise ApiError(f"'{key}' must be a non-empty string", param=key)
    return value
