"""Structured output as clients ask for it: OpenAI's `response_format` and vLLM's fields.

- `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}` (JSON mode:
  any JSON object), `{"type": "json_schema", "json_schema": {"schema": {...}}}`, and
  vLLM's `{"type": "structural_tag", "structures": [...], "triggers": [...]}` or
  `{"type": "structural_tag", "format": {...}}` (runner/structured/structural_tag.py).
- vLLM's `structured_outputs`: `{"json": schema}`, `{"regex": "..."}`,
  `{"choice": [...]}`, `{"grammar": ...}` (GBNF, runner/structured/ebnf_parse.py, or
  Lark, lark_parse.py), `{"structural_tag": "<its JSON text>"}` or `{"json_object":
  true}`; and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one may be given. The pattern is parsed as the request is read, so a bad regex
or an unsupported schema keyword is a 400 naming it; then `compile_checked` builds its byte
DFA (cached per process) on a thread, so a new schema's 0.01-0.5 s of compiling does not
hold the router's event loop and every stream on it, and a pattern that cannot become an
automaton (too many states, or no string matches) is a 400 too, before any worker sees the
request. A grammar's recursion is unrolled to at most 8 levels (fewer when its automaton
would pass the state limit): runner/structured/ebnf_unroll.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.cluster.openai_api import ApiError
from pdserve.runner.structured.patterns import compile_spec, pattern_node
from pdserve.runner.structured.spec import StructuredOutputs

COMPILE_TIMEOUT_S = 60.0  # a DFA is bounded at 20,000 states: ~1 s at worst

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def parse_structured(body: dict) -> StructuredOutputs | None:
    asked = [(name, value) for name, value in _candidates(body) if value is not None]
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(f"'{n}'" for n, _ in asked)
        raise ApiError(f"give at most one structured output constraint (got {names})",
                       param=asked[1][0])  # fmt: skip
    param, spec = asked[0]
    try:
        pattern_node(spec)
    except ValueError as e:
        raise ApiError(f"'{param}': {e}", param=param) from e
    return spec


def structured_param(body: dict) -> str:
    """The field a request's structured output constraint came from."""
    return next(name for name, value in _candidates(body) if value is not None)


async def compile_checked(
    spec: StructuredOutputs, param: str, timeout_s: float = COMPILE_TIMEOUT_S
) -> None:
    """`spec`'s byte DFA, compiled on a thread (or found in the cache); a 400 naming
    `param` when it cannot be built."""
    try:
        await asyncio.wait_for(asyncio.to_thread(compile_spec, spec), timeout_s)
    except ValueError as e:
        raise ApiError(f"'{param}': {e}", param=param) from e
    except TimeoutError as e:
        raise ApiError(f"'{param}': not compiled within {timeout_s:.0f} s", param=param) from e


def _candidates(body: dict) -> list[tuple[str, StructuredOutputs | None]]:
    out = [("response_format", _response_format(body.get("response_format")))]
    if body.get("structured_outputs") is not None:
        out.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            out.append((name, _spec(name, {key: body[name]})))
    return out


def _response_format(value: Any) -> StructuredOutputs | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(
                "'response_format' of type json_schema needs 'json_schema': {'name': ..., "
                "'schema': {...}}",
                param="response_format",
            )
        return _spec("response_format", {"json": schema})
    if kind == "structural_tag":
        return _spec("response_format", {"structural_tag": value})
    raise ApiError(
        "'response_format' must have 'type' text, json_object, json_schema or structural_tag "
        f"(got {kind!r})",
        param="response_format",
    )


def _structured_outputs(value: Any) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise ApiError("'structured_outputs' must be an object", param="structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if "reasoning" in given:  # the server's --reasoning-parser sets it, never the client
        raise ApiError(
            "'structured_outputs' field 'reasoning' is not supported here",
            param="structured_outputs",
        )
    return _spec("structured_outputs", given)


def _spec(param: str, fields: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs.from_wire(fields)
    except (ValueError, TypeError) as e:
        raise ApiError(f"'{param}': {e}", param=param) from e
