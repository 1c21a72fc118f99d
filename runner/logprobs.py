"""Turn sampler/logprob tensors into per-position `TopLogprobs` on the host."""

from __future__ import annotations

import torch

from pdserve.kernels.sampling import topk_logprobs
from pdserve.runner.runner_output import TopLogprobs


def rows_to_top_logprobs(
    token_ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor, ks: list[int]
) -> list[TopLogprobs]:
    """[N, K+1] tensors -> one TopLogprobs per row keeping that row's own k (<= K)."""
    ids_l, lp_l, rank_l = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
    return [
        TopLogprobs(ids_l[i][: k + 1], lp_l[i][: k + 1], int(rank_l[i])) for i, k in enumerate(ks)
    ]


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TopLogprobs]:
    """[n, V] logits at prompt positions and the [n] next prompt tokens -> n entries."""
    ids, lps, ranks = topk_logprobs(logits.float(), k, targets.long())
    return rows_to_top_logprobs(ids, lps, ranks, [k] * logits.shape[0])


def sampled_logprobs(lp, ks: list[int], keep) -> list[TopLogprobs | None]:
    """Per batch row: the sampled token's logprobs (+ its own top-k), or None where the row
    asked for none (k < 0) or its sample was discarded (`keep` false)."""
    if lp is None:
        return [None] * len(ks)
    rows = rows_to_top_logprobs(lp.token_ids, lp.logprobs, lp.ranks, [max(k, 0) for k in ks])
    return [row if (k >= 0 and kp) else None for row, k, kp in zip(rows, ks, keep)]
