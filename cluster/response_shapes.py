"""The pieces of an OpenAI response body that the routes share: ids, creation times,
`usage`, and logprobs in each API's shape (completions, chat, vLLM's prompt_logprobs).

Logprob rows arrive from the workers as [token_id, logprob, rank] per position; `decode`
is the caller's token-to-text function, so nothing here knows a tokenizer.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from pdserve.cluster.openai_api import ApiError

# A client's request id: what ids, UUIDs and trace ids are made of, and nothing that could
# break a log line (it is written into the request log).
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def client_request_id(value: Any, where: str, param: str | None = None) -> str | None:
    """A request id the client chose (vLLM's `X-Request-Id` header or `request_id` field),
    checked; None when not given; a 400 naming `where` (and `param`, a body field) when
    it is not an id."""
    if value is None:
        return None
    if not isinstance(value, str) or not _CLIENT_ID.fullmatch(value):
        raise ApiError(
            f"{where} must be 1-128 characters of letters, digits and ._:/+=@- , got "
            f"{str(value)[:40]!r}",
            param=param,
        )
    return value


def now() -> int:
    return int(time.time())


def usage(
    prompt_tokens: int, completion_tokens: int, cached: int = 0, details: bool = False
) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details where a prefix hit was cached, or always with
    `details` (vLLM's --enable-prompt-tokens-details)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached or details:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _split(token_id: int, rows: list, k: int) -> tuple[list, list]:
    """(the sampled token's row, the top-k rows in rank order) of one position. Rows are
    [token_id, logprob, rank]: the top-k first, then the sampled token if not among them."""
    chosen = next(r for r in rows if int(r[0]) == token_id)
    top = sorted((r for r in rows if int(r[2]) <= k), key=lambda r: int(r[2]))
    return chosen, top


def completion_logprobs(token_ids: list[int], rows_per_token: list, k: int, decode) -> dict:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs (k per position)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for tok, rows in zip(token_ids, rows_per_token, strict=True):
        if rows is None:  # an echoed prompt's first token: nothing before it to predict it
            out["tokens"].append(decode(tok))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen, top = _split(tok, rows, k)
        out["tokens"].append(decode(tok))
        out["token_logprobs"].append(float(chosen[1]))
        out["top_logprobs"].append({decode(int(r[0])): float(r[1]) for r in top})
    return out


def prompt_logprobs_entries(rows: list, decode) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position (the first null), token id (a string
    key) -> logprob, rank and decoded token, the prompt's own token among them."""
    return [
        None
        if pos is None
        else {
            str(int(t)): {"logprob": float(lp), "rank": int(rank), "decoded_token": decode(int(t))}
            for t, lp, rank in pos
        }
        for pos in rows
    ]


def chat_logprobs(token_ids: list[int], rows_per_token: list, k: int, decode) -> list[dict]:
    """OpenAI chat `logprobs.content` entries."""

    def entry(tok: int, logprob: float) -> dict:
        text = decode(tok)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}

    content = []
    for tok, rows in zip(token_ids, rows_per_token, strict=True):
        chosen, top = _split(tok, rows, k)
        item = entry(tok, chosen[1])
        item["top_logprobs"] = [entry(int(r[0]), r[1]) for r in top]
        content.append(item)
    return content
