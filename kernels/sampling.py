"""Sampling ops: counter-based Gumbel noise, Gumbel-max, penalties, masks, logprobs.

Naming (the package rule, see `pdserve.kernels`): an op with a Triton kernel has its plain
torch code as `name_ref`, the spec and the CPU path, and a public `name` with the same
signature that dispatches on device: CUDA tensors go to `pdserve.kernels.sampling_triton`,
anything else to `name_ref`. Those ops are `gumbel_noise`, `gumbel_argmax`, `greedy_argmax`,
`apply_top_k_top_p` (Triton only when some row uses top-p; see there) and
`topk_logprobs`. `noise_hash`, `apply_penalties` and
`apply_min_p` are element-wise or one reduction in torch already, so their torch code is
also the CUDA path and they have no `_ref` twin.

Every function is pure (returns a new tensor, never writes its inputs), so the sampler can
keep the raw logits for logprobs without a defensive copy, and none reads a device value
on the host: sizes that decide work (`max_top_k`, `any_top_p`, `num_logprobs`) arrive as
host ints from the caller, who knows every row's settings. That makes them safe inside an
async step loop on CUDA (`tests/test_sampler.py` runs the sampler under
`torch.cuda.set_sync_debug_mode("error")`).

What this module does not know: requests, slots, or which rows are greedy. It sees one
[R, V] float32 logits tensor and per-row parameter tensors; the sampler decides which ops
run.

Noise recipe (`noise_hash`, `gumbel_noise`), every value an unsigned 32-bit integer held
in int64, M = 0xFFFFFFFF, `*` meaning multiplication mod 2**32:

    fmix32(h):  h ^= h >> 16; h = h * 0x85EBCA6B; h ^= h >> 13; h = h * 0xC2B2AE35; h ^= h >> 16
    lo, hi    = seed & M, (seed >> 32) & M          # the two words of the int64 seed
    s         = fmix32(lo ^ fmix32(hi ^ 0x9E3779B9))
    r         = fmix32(s ^ fmix32((position & M) ^ 0x85EBCA77))          # per row
    c         = fmix32(v ^ 0xC2B2AE3D)                                   # per vocab index v
    h         = fmix32(r ^ c)                                            # per (row, v)
    u         = (float64(h) + 0.5) * 2**-32         # exact in float64, inside (0, 1)
    noise     = float32(-log(-log(u)))              # computed in float64, rounded once

Why float64 for the last two lines: float32 `log` differs between torch's CPU code and
CUDA/Triton's (`tl.log` lowers to an approximate lg2), so float32 noise could not be
bit-identical across backends. A float64 log is within 1 float64 ULP everywhere; rounding
it to float32 gives the same bits unless the exact value lies within ~2**-29 float32 ULPs
of a rounding boundary (~1 value in 10**8). All 32 hash bits are used; u spans
[2**-33, 1 - 2**-33], so noise is finite and lies in [-3.13, 22.87].
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdserve.kernels import sampling_triton, top_k_top_p_triton

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9  # golden ratio; keeps fmix32(0) = 0 away from seed 0
_POSITION_SALT = 0x85EBCA77  # xxhash PRIME32_2
_VOCAB_SALT = 0xC2B2AE3D  # xxhash PRIME32_3


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64.

    x * c can reach 2**64, past int64's 2**63: signed overflow wraps in practice but is
    undefined behaviour in C++, so split c into 16-bit halves; every partial is < 2**49.
    """
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser: a bijection on [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def noise_hash(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """[R, V] int64 in [0, 2**32): the recipe's `h`, a pure function of (seed, position, v).

    Positions are taken mod 2**32. Within a row the V values are distinct (fmix32 and
    `r ^` are bijections), so a row never repeats a hash.
    """
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64, (
        f"seeds/positions must be int64, got {seeds.dtype}/{positions.dtype}"
    )
    assert seeds.dim() == 1 and seeds.shape == positions.shape, (
        f"seeds {tuple(seeds.shape)} and positions {tuple(positions.shape)} must be equal [R]"
    )
    assert vocab_size >= 1, f"vocab_size must be >= 1, got {vocab_size}"
    # `>>` on int64 is arithmetic, so a negative seed's high word is its two's complement.
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    seed_key = _fmix32(low ^ _fmix32(high ^ _SEED_SALT))
    row_key = _fmix32(seed_key ^ _fmix32((positions & _MASK32) ^ _POSITION_SALT))
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    column_key = _fmix32(vocab ^ _VOCAB_SALT)
    return _fmix32(row_key[:, None] ^ column_key[None, :])


def gumbel_noise_ref(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """[R, V] float32 Gumbel(0, 1) noise; row r depends only on (seeds[r], positions[r]).

    No torch.Generator and no global RNG state: the same (seed, position, v) gives the
    same bits in any batch, on any device, in any order. See the module docstring.
    """
    h = noise_hash(seeds, positions, vocab_size)
    u = (h.to(torch.float64) + 0.5) * 2.0**-32
    return (-torch.log(-torch.log(u))).to(torch.float32)


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    if seeds.is_cuda:
        return sampling_triton.gumbel_noise(seeds, positions, vocab_size)
    return gumbel_noise_ref(seeds, positions, vocab_size)


def gumbel_argmax_ref(
    logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor
) -> Tensor:
    """[R] int64: argmax(logits / T + gumbel_noise) per row, plain argmax where T = 0.

    This is one Gumbel-max draw from softmax(logits / T). Ties go to the lowest index
    (torch.argmax); -inf logits never win unless the whole row is -inf (then index 0).
    Greedy rows divide by 1 rather than 0 so no inf/nan is made, even transiently.
    """
    assert logits.dim() == 2 and temperature.shape == logits.shape[:1], (
        f"temperature {tuple(temperature.shape)} must be [R] for logits {tuple(logits.shape)}"
    )
    is_greedy = temperature == 0
    divisor = torch.where(is_greedy, 1.0, temperature).to(logits.dtype)
    noisy = logits / divisor[:, None] + gumbel_noise_ref(seeds, positions, logits.shape[1])
    return torch.where(is_greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))


def gumbel_argmax(logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    if logits.is_cuda:
        return sampling_triton.gumbel_argmax(logits, temperature, seeds, positions)
    return gumbel_argmax_ref(logits, temperature, seeds, positions)


def greedy_argmax_ref(logits: Tensor) -> Tensor:
    """[R] int64: the plain argmax of each row, lowest index among equal maxima."""
    return logits.argmax(dim=-1)


def greedy_argmax(logits: Tensor) -> Tensor:
    if logits.is_cuda:
        return sampling_triton.greedy_argmax(logits)
    return greedy_argmax_ref(logits)


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
) -> Tensor:
    """Return new [R, V] logits with repetition, then frequency/presence penalties.

    Repetition (HF/vLLM): tokens seen in the prompt or the output get logit / p when the
    logit is >= 0 and logit * p when it is < 0. Frequency and presence (OpenAI): on output
    tokens only, logit -= frequency * count + presence * (count > 0). A row with p = 1 and
    both penalties 0 comes back bit-identical. Does not know why a token was seen: stop
    strings, chat templates and special tokens are penalised like any other.
    """
    assert logits.dim() == 2 and prompt_mask.shape == logits.shape == output_counts.shape, (
        f"logits {tuple(logits.shape)}, prompt_mask {tuple(prompt_mask.shape)} and "
        f"output_counts {tuple(output_counts.shape)} must all be [R, V]"
    )
    assert prompt_mask.dtype == torch.bool, f"prompt_mask must be bool, got {prompt_mask.dtype}"
    in_output = output_counts > 0
    rep = repetition_penalty.to(logits.dtype)[:, None]
    penalised = torch.where(logits < 0, logits * rep, logits / rep)
    out = torch.where(prompt_mask | in_output, penalised, logits)
    frequency = frequency_penalty.to(logits.dtype)[:, None]
    presence = presence_penalty.to(logits.dtype)[:, None]
    return out - (
        frequency * output_counts.to(logits.dtype) + presence * in_output.to(logits.dtype)
    )


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Return new [R, V] logits with -inf where prob < min_p * max prob; min_p 0 is off.

    Compared in log space (logit < max logit + log(min_p)), which is the same test as on
    probabilities without a softmax over [R, V]; log(0) = -inf turns a row off for free.
    Tokens at exactly the threshold are kept.
    """
    assert logits.dim() == 2 and min_p.shape == logits.shape[:1], (
        f"min_p {tuple(min_p.shape)} must be [R] for logits {tuple(logits.shape)}"
    )
    max_logit = logits.amax(dim=-1, keepdim=True)
    threshold = max_logit + torch.log(min_p.to(logits.dtype))[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p_ref(
    logits: Tensor, top_k: Tensor, top_p: Tensor, max_top_k: int, any_top_p: bool
) -> Tensor:
    """Return new [R, V] logits with -inf outside top-k, then outside top-p; top token kept.

    top_k <= 0 or >= V is off. Ties: every token equal to the k-th largest value is kept,
    so a row can keep more than k tokens. top_p >= 1 is off; otherwise, after the top-k
    mask, a token is kept when the probability mass of the tokens with a strictly larger
    logit is < top_p (for distinct logits: the smallest prefix of the sorted row reaching
    top_p). Tokens tied with the boundary token are all kept, as for top-k, so the mask
    does not depend on sort order. Every token tied with the row's max always survives, so
    the argmax of the masked row is the argmax of the input.

    Host ints instead of syncs: `max_top_k` is the largest active k in the batch (0 < k
    < V; an upper bound is fine, 0 = no row uses top-k) and sizes `torch.topk`;
    `any_top_p` says whether any row has top_p < 1, so the [R, V] sort, the costly part,
    is skipped when none does. The caller (`SamplingMetadata`) knows both on the host.
    """
    num_rows, vocab_size = logits.shape
    assert top_k.shape == (num_rows,) and top_p.shape == (num_rows,), (
        f"top_k {tuple(top_k.shape)} and top_p {tuple(top_p.shape)} must be [{num_rows}]"
    )
    out = logits
    max_top_k = min(max_top_k, vocab_size)
    if max_top_k > 0:
        k = top_k.to(torch.int64)
        k_active = torch.where((k > 0) & (k < vocab_size), k, 0)
        top_values = logits.topk(max_top_k, dim=-1).values  # [R, max_top_k], descending
        kth = top_values.gather(1, (k_active - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill((k_active == 0)[:, None], float("-inf"))
        out = out.masked_fill(out < kth, float("-inf"))
    if any_top_p:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], 1)
        # Mass strictly above each token: the mass before the first token of its tie group.
        # mass_before never decreases along a row, so a running max over group starts
        # carries each group's start value to all its members.
        group_start = torch.ones_like(sorted_logits, dtype=torch.bool)
        group_start[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
        mass_above = torch.where(group_start, mass_before, 0.0).cummax(dim=-1).values
        # Off rows are excluded explicitly: float32 cumsum can reach 1.0 before the tail.
        p_active = (top_p < 1.0)[:, None]
        drop_sorted = (mass_above >= top_p.to(probs.dtype)[:, None]) & p_active
        drop_sorted &= sorted_logits < sorted_logits[:, :1]  # top_p = 0 keeps the max
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor, top_p: Tensor, max_top_k: int, any_top_p: bool
) -> Tensor:
    # On CUDA without top-p the torch path stays: torch.topk(max_top_k) beats the Triton
    # count search (H200, V = 151,936: 0.08 vs 0.47 ms at R = 1, 3.0 vs 4.9 ms at R =
    # 1024). Both give the exact k-th value, so a row's mask does not depend on whether
    # another row in its batch asked for top-p.
    if logits.is_cuda and any_top_p:
        return top_k_top_p_triton.apply_top_k_top_p(logits, top_k, top_p, max_top_k, any_top_p)
    return apply_top_k_top_p_ref(logits, top_k, top_p, max_top_k, any_top_p)


def topk_logprobs_ref(
    logits: Tensor, num_logprobs: int, token_ids: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Logprobs of the sampled token and the top `num_logprobs` tokens, without [R, V] logs.

    Returns ids [R, k+1] int64 (column 0 = token_ids, then the top-k by descending logit),
    logprobs [R, k+1] float32 (logit - logsumexp(row)) and ranks [R] int64 of the sampled
    token (1 + number of tokens with a strictly larger logit). Order among tied top-k
    tokens is torch.topk's. Does not know about temperature: pass the logits whose
    distribution the caller wants reported.
    """
    assert logits.dim() == 2 and token_ids.shape == logits.shape[:1], (
        f"token_ids {tuple(token_ids.shape)} must be [R] for logits {tuple(logits.shape)}"
    )
    assert 0 <= num_logprobs <= logits.shape[1], (
        f"num_logprobs must be in [0, V={logits.shape[1]}], got {num_logprobs}"
    )
    token_ids = token_ids.to(torch.int64)
    log_normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    sampled_logit = logits.gather(1, token_ids[:, None])  # [R, 1]
    ranks = (logits > sampled_logit).sum(dim=-1) + 1
    ids, values = token_ids[:, None], sampled_logit
    if num_logprobs > 0:
        top = logits.topk(num_logprobs, dim=-1)
        ids = torch.cat([ids, top.indices], dim=1)
        values = torch.cat([values, top.values], dim=1)
    return ids, values - log_normaliser, ranks


def topk_logprobs(
    logits: Tensor, num_logprobs: int, token_ids: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    if logits.is_cuda:
        return sampling_triton.topk_logprobs(logits, num_logprobs, token_ids)
    return topk_logprobs_ref(logits, num_logprobs, token_ids)
