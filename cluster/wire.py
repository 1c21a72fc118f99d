"""What the router sends workers through Ray: msgpack bytes with a version and a schema.

Ray's own RPC framing is Ray's business; our payloads are plain msgpack (never pickled
objects), checked on arrival, so a worker never runs code it was sent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack

from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.pooling import pooling_from_wire
from pdserve.runner.sampling_params import SamplingParams

# 2: a request's adapter travels as its key and folder (`lora_path`), and `embed` is the
# pooling map ({task, normalize, dimensions, activation}); a version-1 peer is refused.
WIRE_VERSION = 2
# SamplingParams fields a request may carry (the rest are derived or engine-internal).
PARAM_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.init and not f.name.startswith("_")
)


def _unpack(data: bytes, what: str, fields: set[str]) -> dict:
    """A message's msgpack map, checked for this wire version and exactly `fields` (+ v)."""
    body = msgpack.unpackb(data, raw=False)
    if not isinstance(body, dict) or body.get("v") != WIRE_VERSION:
        raise ValueError(f"{what}: wire version must be {WIRE_VERSION}")
    if set(body) != fields | {"v"}:
        raise ValueError(f"{what}: unexpected fields {sorted(body)}")
    return body


@dataclass(frozen=True)
class WorkRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ticket: dict | None = None  # kvtransfer.protocol ticket wire map (decode side, PD mode)
    # The LoRA adapter it runs with (cluster/lora_registry.py): its key and folder; None:
    # the base model
    lora: str | None = None
    lora_path: str | None = None
    # A pooling request (runner/pooling.py `pooling_to_wire`: its task and parameters);
    # None: generate
    embed: dict | None = None

    def encode(self) -> bytes:
        params = {k: getattr(self.params, k) for k in PARAM_FIELDS}
        if params["logit_bias"] is not None:  # msgpack map keys are strings here
            params["logit_bias"] = [[t, b] for t, b in params["logit_bias"].items()]
        if params["structured_outputs"] is not None:
            params["structured_outputs"] = params["structured_outputs"].to_wire()
        body = {
            "v": WIRE_VERSION,
            "id": self.request_id,
            "prompt": self.prompt_token_ids,
            "params": params,
            "ticket": self.ticket,
            "lora": self.lora,
            "lora_path": self.lora_path,
            "embed": self.embed,
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> WorkRequest:
        fields = {"id", "prompt", "params", "ticket", "lora", "lora_path", "embed"}
        body = _unpack(data, "work request", fields)
        prompt = body["prompt"]
        if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
            raise ValueError("work request: prompt must be a list of token ids")
        params = body["params"]
        if not isinstance(params, dict) or not set(params) <= set(PARAM_FIELDS):
            raise ValueError("work request: params must be SamplingParams fields")
        bias = params.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in bias
            ):
                raise ValueError("work request: logit_bias must be [token id, bias] pairs")
            params = {**params, "logit_bias": dict(bias)}
        if body["ticket"] is not None and not isinstance(body["ticket"], dict):
            raise ValueError("work request: ticket must be a map or null")
        if not isinstance(body["id"], str):
            raise ValueError("work request: id must be a string")
        lora, lora_path = body["lora"], body["lora_path"]
        if not (
            (lora is None and lora_path is None)
            or (isinstance(lora, str) and lora and isinstance(lora_path, str) and lora_path)
        ):
            raise ValueError("work request: lora and lora_path must be an adapter's key and "
                             "folder, or both null")  # fmt: skip
        embed = body["embed"]
        if embed is not None:
            try:
                pooling_from_wire(embed)
            except ValueError as e:
                raise ValueError(f"work request: embed: {e}") from None
        return cls(
            body["id"], prompt, SamplingParams(**params), body["ticket"], lora, lora_path, embed
        )

    def lora_request(self) -> LoRARequest | None:
        """The adapter as the engine takes it (keyed by its registry key)."""
        if self.lora is None:
            return None
        return LoRARequest(self.lora, 1, self.lora_path)


@dataclass(frozen=True)
class FirstToken:
    """An early ticket's first token (`--kv-layer-wise`), relayed by the router from the
    prefill worker to the decode worker ahead of the KV: `logprobs` is the ticket's rows
    `[token_id, logprob, rank]` or None."""

    request_id: str
    token: int
    logprobs: list[list[float]] | None = None

    def encode(self) -> bytes:
        body = {"v": WIRE_VERSION, "id": self.request_id, "t": self.token, "l": self.logprobs}
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> FirstToken:
        body = _unpack(data, "first token", {"id", "t", "l"})
        if not isinstance(body["id"], str) or type(body["t"]) is not int:
            raise ValueError("first token: id must be a string and t a token id")
        rows = body["l"]
        if rows is not None and not (
            isinstance(rows, list)
            and all(
                isinstance(r, list)
                and len(r) == 3
                and all(isinstance(x, int | float) and not isinstance(x, bool) for x in r)
                for r in rows
            )
        ):
            raise ValueError("first token: l must be rows of [token_id, logprob, rank] or null")
        return cls(body["id"], body["t"], rows)
