"""A serving worker's warm-up: a few short prompts through prefill and decode before the
first request, so that request does not wait for the first-use work of the prefill path
(Triton compiles its kernels per specialization, cuBLAS picks its first kernels). On the
H200 the first real prompt of a fresh PD pair took ~2 s without it (90-245 prompt tokens
per second in the serve log's first interval, 15 prompts waiting).

The warm-up leaves no trace: no request, every block free and the prefix cache empty,
the engine's counters (steps, tokens, prefix queries, steps by path, arrivals) at zero,
so /metrics and the serve log count only real work and seeds derived from the arrival
order are those of a fresh engine.
"""

from __future__ import annotations

import logging
import time

from pdserve.kernels.int_linear import DEQUANT_ROWS
from pdserve.kernels.paged_decode_split import FEW_DECODE_PAIRS, MIN_SPLIT_KEYS
from pdserve.kernels.row_squares import SQ_ROWS
from pdserve.runner.engine import Engine
from pdserve.runner.models.moe import experts_per_pick
from pdserve.runner.models.packed_linear import PackedLinear
from pdserve.runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Batches of prompts, each run to its one decode step. Triton compiles a kernel per
# specialization: integer arguments equal to 1 or divisible by 16 or neither, and the
# skinny linears' row pad (16, 32 or 64 rows; more rows go to cuBLAS). With CUDA graphs
# the capture compiles every decode size, but eager (--enforce-eager, and every prefill)
# meets them in its requests, so the batches' token counts and decode rows cover them all:
# 80 (cuBLAS) and 58 (pad 64) tokens then 2 rows; 64, 32 and 16 tokens (divisible, pads
# 64 / 32 / 16) then 1 row; 23 tokens (pad 32).
_BATCHES = ((48, 32), (37, 21), (64,), (32,), (23,), (16,))
_MAX_STEPS = 64


def decode_variant_batches(engine: Engine) -> list[tuple[int, ...]]:
    """Batches whose decode step meets the decode attention's other compiled variants
    (kernels/paged_decode_split.py), which short prompts of a row or two never reach:
    one row whose context passes MIN_SPLIT_KEYS (a split grid), and more rows than fit
    FEW_DECODE_PAIRS (row, kv head) pairs (the wide tile), each where the engine's limits
    (model length, slots, free blocks) allow it; where the fused preparation may run
    (`auto`, `per_head_prep`), also SQ_ROWS + 1 rows where they fit FEW_DECODE_PAIRS pairs
    (kernels/qkv_attend.py without the folded chain's row scale, which 1-2 decode rows of
    a folded model never meet). Graph capture compiles them all; eager steps met them in
    requests."""
    out: list[tuple[int, ...]] = []
    blocks = engine.kv.num_free_blocks  # each batch must run at once, in one wave
    long = MIN_SPLIT_KEYS + 16
    if engine.config.model.max_model_len - 2 > long and long + 2 <= blocks * engine.kv.block_size:
        out.append((long,))
    hf = engine.config.model.hf_config
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    per_row = -(-5 // engine.kv.block_size)  # 3 prompt tokens, 2 outputs
    wide = FEW_DECODE_PAIRS // kv_heads + 1
    fused = SQ_ROWS + 1  # past the folded chain's rows: the fused kernel's unscaled variant
    prep = engine.config.runner.decode_attention in ("auto", "per_head_prep") and fused < wide
    for rows in [fused, wide] if prep else [wide]:
        if rows <= engine.config.scheduler.max_num_seqs and rows * per_row <= blocks:
            out.append((3,) * rows)
    return out


def moe_variant_batches(engine: Engine) -> list[tuple[int, ...]]:
    """One-prompt batches whose prefill gives the MoE experts' kernels their 32- and
    64-slot blocks (kernels/moe_triton.choose_tiles sizes blocks by the mean run, which
    decode-sized batches keep at 16), where the engine's limits take the prompt in one
    step. Nothing for a dense model."""
    ratio = experts_per_pick(engine.config.model.hf_config)
    if ratio is None:
        return []
    fits = _one_step_prompt(engine)
    sizes = (int(mean_run * ratio) + 1 for mean_run in (32, 80))  # blocks of 32, then 64
    return [(n,) for n in sizes if n <= fits]


def packed_variant_batches(engine: Engine) -> list[tuple[int, ...]]:
    """One prompt of DEQUANT_ROWS + 1 tokens where the model keeps packed integer or FP8
    projections (runner/models/packed_linear.py): a batch that long dequantizes each weight
    with its own kernel and multiplies with cuBLAS (kernels/int_linear.py), which the
    short warm-up prompts never reach. Where the engine's limits take it in one step;
    nothing for other models."""
    model = getattr(engine.runner, "model", None)
    if model is None or not any(isinstance(m, PackedLinear) for m in model.modules()):
        return []
    n = DEQUANT_ROWS + 1
    return [(n,)] if _one_step_prompt(engine) >= n else []


def _one_step_prompt(engine: Engine) -> int:
    """The longest prompt the engine prefills in one step with its blocks all free."""
    return min(
        engine.config.model.max_model_len - 2,
        engine.config.scheduler.max_num_batched_tokens,
        engine.kv.num_free_blocks * engine.kv.block_size - 2,
    )


def warm_up(engine: Engine) -> float:
    """Run the warm-up prompts to completion and reset what they touched. Returns its
    seconds. Call it before the engine serves (nothing else may be queued)."""
    assert not engine.has_unfinished(), "warm up an idle engine"
    start = time.perf_counter()
    vocab = engine.config.model.vocab_size
    limit = engine.config.model.max_model_len - 2
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, seed=0)
    variants = (decode_variant_batches(engine) + moe_variant_batches(engine)
                + packed_variant_batches(engine))  # fmt: skip
    for b, lengths in enumerate(_BATCHES + tuple(variants)):
        for i, n in enumerate(lengths):
            prompt = [(7 * b + 3 * i + j) % vocab for j in range(min(n, limit))]
            engine.add_request(f"warm-up-{b}-{i}", prompt, params)
        for _ in range(_MAX_STEPS):
            if not engine.has_unfinished():
                break
            engine.step()
        if engine.has_unfinished():
            raise RuntimeError("the warm-up prompts did not finish")
    engine.step()  # hands the finished ids to the runner, which frees their slots
    if not engine.kv.reset_prefix_cache():
        raise RuntimeError("the warm-up prompts left blocks in use")
    engine.reset_counters()
    seconds = time.perf_counter() - start
    logger.info("warm-up: %.2f s", seconds)
    return seconds
