"""Parity of the Triton paged attention (`kernels/paged_attention_triton.py` and the kernels
it launches) with the spec.

The spec is `paged_attention_ref`, itself checked against dense causal attention written
with plain matmuls in float64. Every batch is built on a cache poisoned with NaN: the null
block 0, unused blocks and the slots past each row's context all hold NaN, so a kernel that
reads (and fails to mask) a single key outside a context produces NaN, not a small error.
The reference runs on a NaN-free copy in float64 on the CPU.

Sizes: on CPU the kernels run through Triton's interpreter (TRITON_INTERPRET=1), so the
contexts are a few hundred keys; with CUDA they are thousands, over several tiles and splits.
The CUDA-only checks (dispatch to Triton, no host syncs and CUDA-graph replay, cache
offsets past int32) are in `test_gpu_attention.py`, which imports this module's helpers.

Tolerances:
- fp32 inputs: 1e-5. Both dots run as IEEE fp32 (no TF32), so the only error is fp32
  rounding: ~1e-7 relative per score over D <= 128 products, a few 1e-7 after the softmax
  and the sum over keys; 1e-5 is 30x the worst seen and 1,000x below what a wrong mask,
  scale or head mapping gives (errors ~1e-2..1).
- bf16/fp16 inputs, against the float64 reference on the same (rounded) inputs: Q.K^T is
  exact products with fp32 sums, but P is rounded to 16 bits before P.V (relative 2^-8 in
  bf16) and the output is rounded once more. Hence |err| <= u * (|ref| + max|V|) with
  u = 2^-8 (bf16) or 2^-11 (fp16), checked elementwise (worst seen: 0.64 of it), plus a
  mean error under u / 2 (seen: 0.23 u in bf16, 0.06 u in fp16), which a 16-bit softmax
  state or accumulator breaks even where the worst-case bound hides it. Logic bugs (masks,
  offsets, splits) are the fp32 tests' job: the kernels share their code across dtypes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kernels.attention import paged_attention, paged_attention_ref
from pdserve.kernels.paged_attention_triton import choose_decode_kernel, paged_attention_triton
from pdserve.kernels.paged_decode_packed import packed_num_splits
from pdserve.kernels.paged_decode_split import decode_num_splits, decode_tiles
from pdserve.kernels.workspace import KernelWorkspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
# Context scale: interpreter-sized on CPU, several 64-key tiles and 256-key splits on GPU.
X = 10 if ON_GPU else 1
# Qwen3's 16 q / 8 kv heads of 128 on a GPU. Under the CPU interpreter each (row, kv head)
# is a program run in numpy: the same GQA group of two in 4 / 2 heads takes a quarter of
# the time (head_dim 128 and its tile configs stay).
QH, KH = (16, 8) if ON_GPU else (4, 2)

# (context length after the step, query length). Rows of every kind a step can carry.
DECODE, DECODE_AT_1, PAD = (37 * X, 1), (1, 1), (0, 1)
CHUNK_ON_PREFIX = (70 * X, 20 * X)  # prefix 50*X, queries continue it
FRESH_PROMPT = (23 * X, 23 * X)
LONG_PROMPT = (150 * X, 150 * X)  # > BLOCK_M (64): several query tiles
TWO_QUERIES = (5, 2)
LONG_DECODE = (300 * X, 1)  # several decode splits
MIXED = [DECODE, CHUNK_ON_PREFIX, FRESH_PROMPT, DECODE_AT_1, PAD, LONG_DECODE, TWO_QUERIES]
# The two decode kernels: a program per (row, kv head, split), or per (row, split) over
# every head (kernels/paged_decode_packed.py). Both must meet the spec on any batch.
DECODE_KERNELS = ["per_head", "packed"]


@dataclasses.dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D] on DEVICE
    cache: torch.Tensor  # [num_blocks, 2, bs, Hkv, D] on DEVICE, NaN outside the contexts
    tables: torch.Tensor  # [R + 1, max_blocks] int32 (one extra pad row, as R_pad > R)
    qsl: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R + 1] int32
    rows: list[tuple[int, int]]
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # per row: K, V [ctx, Hkv, D] on CPU
    scale: float
    seq_len_limit: int | None = None  # max_seq_len passed to the kernels, else the longest
    window: int = 0  # sliding window (keys a query sees), 0 = full causal, < 0 chunked
    softcap: float = 0.0  # attention logit softcapping, 0 = none
    sinks: torch.Tensor | None = None  # [Hq] float32 attention sinks (on CPU), None = none

    @property
    def max_query_len(self) -> int:
        return max(q for _, q in self.rows)

    @property
    def max_seq_len(self) -> int:
        return self.seq_len_limit or max(c for c, _ in self.rows)

    def run_triton(self, **kw) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        paged_attention_triton(
            self.q, self.cache, self.tables, self.qsl, self.seq_lens, self.scale, out,
            self.max_query_len, self.max_seq_len, window=self.window, softcap=self.softcap,
            sinks=None if self.sinks is None else self.sinks.to(DEVICE), **kw,
        )  # fmt: skip
        return out

    def run_ref(self) -> torch.Tensor:
        """The spec in float64 on CPU, on a NaN-free copy of the same (rounded) inputs."""
        q = self.q.double().cpu()
        out = torch.zeros_like(q)
        paged_attention_ref(
            q, self.cache.double().cpu().nan_to_num(0.0), self.tables.cpu(), self.qsl.cpu(),
            self.seq_lens.cpu(), self.scale, out, self.max_query_len, self.max_seq_len,
            self.window, self.softcap, None if self.sinks is None else self.sinks.double(),
        )  # fmt: skip
        return out


def run_kernel(batch: Batch, kernel: str, monkeypatch) -> torch.Tensor:
    """`batch.run_triton` with decode kernel `kernel`; for "flat", with an SM count that
    gives each program two (row, kv head) pairs (on the CPU there is one SM, and the flat
    grid would need more than MAX_PAIRS a program, so the per-head kernel would run) and a
    check that the flat kernel did run."""
    if kernel != "flat":
        return batch.run_triton(decode_kernel=kernel)
    import pdserve.kernels.paged_attention_triton as pat

    num_pairs = len(batch.rows) * batch.cache.shape[3]
    ran = []
    real = pat.decode_flat
    monkeypatch.setattr(pat, "decode_flat", lambda *a: (ran.append(1), real(*a))[1])
    monkeypatch.setattr(pat, "_num_sms", lambda device: -(-num_pairs // 2))
    out = batch.run_triton(decode_kernel="flat", num_splits=1)
    assert ran, "the flat kernel did not run"
    return out


def make_batch(rows, hq, hk, d, bs, dtype=torch.float32, seed=0, window=0) -> Batch:
    """Rows' blocks are shuffled over the cache; block 0 (null) and spare blocks stay NaN.
    With a sliding `window` (or chunks), the keys below every query's window are NaN too."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-ctx // bs) for ctx, _ in rows]
    num_blocks = 1 + sum(blocks_per_row) + 5
    cache = torch.full((num_blocks, 2, bs, hk, d), float("nan"), dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).int()
    tables = torch.zeros(len(rows) + 1, max(1, max(blocks_per_row)), dtype=torch.int32)
    contexts, cursor = [], 0
    for r, (ctx, _) in enumerate(rows):
        nb = blocks_per_row[r]
        tables[r, :nb] = perm[cursor : cursor + nb]
        cursor += nb
        k = torch.randn(ctx, hk, d, generator=g).to(dtype)
        v = torch.randn(ctx, hk, d, generator=g).to(dtype)
        pos = torch.arange(ctx)
        blk = tables[r, pos // bs].long()
        cache[blk, 0, pos % bs] = k
        cache[blk, 1, pos % bs] = v
        if window:  # none of the row's queries sees keys below its first query's first key
            unseen = pos[: int(first_seen(torch.tensor(ctx - rows[r][1]), window))]
            cache[tables[r, unseen // bs].long(), :, unseen % bs] = float("nan")
        contexts.append((k.double(), v.double()))
    qlens = torch.tensor([ql for _, ql in rows])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)]).int()
    seq_lens = torch.tensor([ctx for ctx, _ in rows] + [0], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    return Batch(
        q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), qsl.to(DEVICE), seq_lens.to(DEVICE),
        list(rows), contexts, d**-0.5, window=window,
    )  # fmt: skip


def first_seen(pos: torch.Tensor, window: int) -> torch.Tensor:
    """The first key position p sees: 0; p - window + 1 for a sliding window; the first of
    its block of -window positions for chunked attention (window < 0)."""
    if window > 0:
        return (pos - window + 1).clamp(min=0)
    if window < 0:
        return torch.div(pos, -window, rounding_mode="floor") * -window
    return pos * 0


def dense_causal(q, k, v, scale, window=0, softcap=0.0, sinks=None) -> torch.Tensor:
    """Attention of the last q_len positions of a context, by plain float64 matmuls; with a
    `window`, position p sees keys from `first_seen(p, window)` to p; with a `softcap`, the scaled scores
    become softcap * tanh(scores / softcap); with `sinks`, each head's softmax has one more
    logit in its denominator."""
    q_len, hq, _ = q.shape
    ctx, hk, _ = k.shape
    k = k.repeat_interleave(hq // hk, dim=1).transpose(0, 1)  # [Hq, ctx, D]
    v = v.repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, q_len, ctx]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    keys, queries = torch.arange(ctx)[None, :], torch.arange(ctx - q_len, ctx)[:, None]
    visible = (keys <= queries) & (keys >= first_seen(queries, window))
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, q_len, 1)], dim=-1)
    p = s.softmax(-1)[..., :ctx]
    return (p @ v).transpose(0, 1)


def check_ref_against_dense(batch: Batch) -> None:
    """The spec on `batch` equals `dense_causal` row by row (with the batch's window,
    softcap and sinks), to float64 rounding."""
    ref, qsl = batch.run_ref(), batch.qsl.tolist()
    for r, ((ctx, _), (k, v)) in enumerate(zip(batch.rows, batch.contexts)):
        if ctx:
            q = batch.q[qsl[r] : qsl[r + 1]].cpu()
            dense = dense_causal(q, k, v, batch.scale, batch.window, batch.softcap, batch.sinks)
            torch.testing.assert_close(ref[qsl[r] : qsl[r + 1]], dense, rtol=1e-10, atol=1e-10)


def check(batch: Batch, out: torch.Tensor) -> None:
    """Real rows match the reference within the dtype's tolerance; pad rows are zeros."""
    ref, out = batch.run_ref(), out.double().cpu()
    qsl = batch.qsl.tolist()
    real = torch.zeros(out.shape[0], dtype=torch.bool)
    for r, (ctx, _) in enumerate(batch.rows):
        if ctx == 0:
            assert torch.equal(out[qsl[r] : qsl[r + 1]], torch.zeros_like(out[qsl[r] : qsl[r + 1]]))
        else:
            real[qsl[r] : qsl[r + 1]] = True
    out, ref = out[real], ref[real]
    assert not out.isnan().any(), "NaN: a key outside some context was read unmasked"
    dtype = batch.q.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    v_max = max(float(v.abs().max()) for _, v in batch.contexts if v.numel())
    err = (out - ref).abs()
    bound = u * (ref.abs() + v_max)
    assert (err <= bound).all(), f"max excess {float((err - bound).max()):.3g} over u(|ref|+|V|max)"
    assert float(err.mean()) < u / 2, f"mean error {float(err.mean()):.3g} >= u/2 = {u / 2:.3g}"


@pytest.mark.parametrize("hq,hk,d,bs", [(6, 3, 20, 16), (4, 1, 36, 1)])
def test_ref_matches_dense_matmul(hq, hk, d, bs):
    """Guards the spec itself: prefix offsets in the causal mask, GQA head mapping
    (repeat_interleave, not repeat) and block-table gathers, against plain matmuls."""
    batch = make_batch(MIXED, hq, hk, d, bs)
    ref, qsl = batch.run_ref(), batch.qsl.tolist()
    for r, ((ctx, _), (k, v)) in enumerate(zip(batch.rows, batch.contexts)):
        if ctx:
            q = batch.q[qsl[r] : qsl[r + 1]].cpu()
            dense = dense_causal(q, k, v, batch.scale)
            torch.testing.assert_close(ref[qsl[r] : qsl[r + 1]], dense, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "hq,hk,d,bs",
    [
        (6, 3, 24, 16),
        (4, 1, 80, 1),
        (2, 2, 128, 16),
        (QH, KH, 128, 16),
        (6, 3, 20, 8),
        (4, 1, 36, 32),
    ],
)
@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_mixed_batch_fp32(hq, hk, d, bs, kernel):
    """Guards both kernels in one step: decode rows (split-K) beside prefill chunks with and
    without a cached prefix, a pad row, block sizes 1..32 over shuffled blocks, head dims
    that need a padded, masked D tile, and GQA groups of 1, 2 and 4."""
    batch = make_batch(MIXED, hq, hk, d, bs)
    check(batch, batch.run_triton(decode_kernel=kernel))


@pytest.mark.parametrize(
    "hq,hk,d,bs,dtype",
    [
        (QH, KH, 128, 16, torch.bfloat16),
        (6, 3, 24, 16, torch.bfloat16),
        (4, 1, 36, 1, torch.bfloat16),
        (QH, KH, 128, 16, torch.float16),
    ],
)
@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_mixed_batch_16bit(hq, hk, d, bs, dtype, kernel):
    """Guards the tensor-core path: P rounded to 16 bits before P.V, fp32 softmax state
    (an fp16 running sum overflows, a bf16 one drifts), output cast to the q dtype, and the
    16-bit tile config (BLOCK_M 64, BLOCK_N 64) with a prompt longer than one query tile."""
    batch = make_batch([*MIXED, LONG_PROMPT], hq, hk, d, bs, dtype=dtype)
    check(batch, batch.run_triton(decode_kernel=kernel))


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 7])
def test_decode_splits(num_splits, kernel):
    """Guards the split-K decode: every split count gives the same answer (partials merged by
    lse; splits past a short row's context write nothing and are not merged, not read as
    garbage), pad rows of a CUDA-graph-padded batch (q_len 1, seq_len 0) get zeros."""
    rows = [LONG_DECODE, DECODE, (64 * X, 1), (65 * X, 1), DECODE_AT_1, PAD, PAD]
    batch = make_batch(rows, 4, 1, 36, 16)
    if num_splits not in (None, 1):
        split_len = -(-batch.max_seq_len // num_splits)
        assert batch.max_seq_len > split_len, "test must put contexts across several splits"
    check(batch, batch.run_triton(num_splits=num_splits, decode_kernel=kernel))


def test_decode_reads_no_block_past_the_context():
    """Guards what the unsplit decode reads and writes: the block-table entries past a row's
    blocks are whatever an earlier request left there (here ids below 0 and past the cache:
    reading through one is an out-of-bounds access), so a row must see only its own keys,
    and a row with several queries (the prefill kernel's) must not be written by the decode
    one. (A decode that loaded its first tile before the row's length, `8dec0a5`, clamped
    such ids; it measured slower and was reverted.)"""
    rows = [DECODE, (3, 1), DECODE_AT_1, PAD, TWO_QUERIES, (16, 1)]
    clean = make_batch(rows, 4, 2, 24, 16, seed=3)
    num_blocks, block_size = clean.cache.shape[0], clean.cache.shape[2]
    tables = clean.tables.cpu().clone()
    for r, (ctx, _) in enumerate(rows + [PAD]):
        used = -(-ctx // block_size)
        tables[r, used:] = torch.tensor([-7, num_blocks + 100, num_blocks])[
            torch.arange(tables.shape[1] - used) % 3
        ]
    batch = dataclasses.replace(clean, tables=tables.to(DEVICE))
    # The spec runs on the clean tables (it gathers whole table rows). The prefill row's
    # output is the prefill kernel's: a decode program writing it too would break the match.
    check(clean, batch.run_triton(num_splits=1, decode_kernel="per_head"))


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_decode_splits_per_row_in_a_long_limit(kernel):
    """Guards the per-row split partition: a CUDA graph captures max_seq_len as the model's
    limit, far above the live contexts, and each row must still cut its own context into
    its slices (short rows, a row shorter than one tile, pad rows) and the merge must
    merge exactly the slices that were written."""
    rows = [DECODE, (64 * X, 1), (3, 1), DECODE_AT_1, PAD, LONG_DECODE]
    batch = make_batch(rows, 4, 2, 24, 16, seed=7)
    batch.seq_len_limit = 8 * LONG_DECODE[0]
    for num_splits in (None, 2, 5):
        check(batch, batch.run_triton(num_splits=num_splits, decode_kernel=kernel))


@pytest.mark.parametrize(
    "kernel,counter", [("per_head", "decode_attention"), ("packed", "decode_packed")]
)
def test_split_merge_counters_return_to_zero_across_calls(kernel, counter):
    """Guards the in-kernel merge: the last split of a (row, kv head) to finish merges all
    of them and resets its arrival counter. A counter left at any other value (a split that
    skips without counting in, a pad row's lone split) would make a later call on the same
    workspace merge too early or never, as a CUDA graph replay reuses it every step."""
    ws = KernelWorkspace()
    rows = [LONG_DECODE, DECODE, (3, 1), PAD, DECODE_AT_1]
    for seed, num_splits in ((1, 5), (2, 3), (3, 5)):
        batch = make_batch(rows, 4, 2, 24, 16, seed=seed)
        check(batch, batch.run_triton(num_splits=num_splits, workspace=ws, decode_kernel=kernel))
        counters = ws.counters(counter, 1, batch.q.device)
        assert counters.numel() >= len(rows)
        assert int(counters.abs().sum()) == 0, counters


@pytest.mark.parametrize(
    "hq,hk,heads,dtype",
    [(8, 4, 1, torch.float32), (8, 4, 2, torch.bfloat16), (6, 3, 1, torch.bfloat16),
     (16, 8, 2, torch.bfloat16)],
)  # fmt: skip
def test_packed_head_groups(monkeypatch, hq, hk, heads, dtype):
    """Guards `PackedConfig.heads`: a program per (row, slice, group of kv heads), each
    reading and writing only its group's query heads, partials and arrival counter. A
    group that read another group's K/V or wrote another's output rows, or a merge that
    mixed groups, fails the spec; counters must be back at zero for the next call."""
    import pdserve.kernels.paged_attention_triton as pat

    for name in ("PACKED_16BIT", "PACKED_WIDE"):
        monkeypatch.setattr(pat, name, getattr(pat, name)._replace(heads=heads))
    ws = KernelWorkspace()
    rows = [LONG_DECODE, DECODE, (3, 1), PAD, DECODE_AT_1, (64 * X, 1)]
    # Unsplit (each group writes its rows directly) and split (partials, counters, merge):
    # the two paths a group's programs take; `packed` is not a kernel `auto` runs.
    for seed, num_splits in ((2, 1), (3, 3)):
        batch = make_batch(rows, hq, hk, 24 if dtype == torch.float32 else 128, 16, dtype, seed)
        out = batch.run_triton(num_splits=num_splits, workspace=ws, decode_kernel="packed")
        check(batch, out)
        assert int(ws.counters("decode_packed", 1, batch.q.device).abs().sum()) == 0


def test_packed_head_groups_must_divide_the_kv_heads():
    from pdserve.kernels.paged_decode_packed import DEFAULT_CONFIG, heads_per_program

    assert heads_per_program(8, DEFAULT_CONFIG) == 8
    assert heads_per_program(8, DEFAULT_CONFIG._replace(heads=2)) == 2
    with pytest.raises(ValueError, match="does not divide 8 kv heads"):
        heads_per_program(8, DEFAULT_CONFIG._replace(heads=3))
    # A program per (row, group): fewer splits fill the same target.
    assert packed_num_splits(32, 8, 4096, DEFAULT_CONFIG._replace(heads=2)) == 3  # 264/128


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("rows", [[LONG_DECODE], [CHUNK_ON_PREFIX], [PAD]], ids=str)
def test_single_row(rows, kernel):
    """Guards batch size 1: the split heuristic gives a lone decode row its most splits, a
    lone prefill chunk runs without decode rows, and a lone pad row writes zeros."""
    batch = make_batch(rows, 6, 3, 24, 16)
    check(batch, batch.run_triton(decode_kernel=kernel))


def test_many_rows_and_tile_edges():
    """Guards the border between the unmasked and the causally masked key loops: query tiles
    whose first position + 1 sits one before, on and one after a key-tile edge (32 keys in
    fp32; prefixes 30..32 and 62..64, and again in the second query tile of 64), so a key
    one past a query's position never lands in an unmasked tile; block size 1, and a batch
    of many rows of all kinds."""
    rows = [(p + 70, 70) for p in (30, 31, 32, 62, 63, 64)] + [(129, 1), (128, 1), (96, 33)]
    rows += [(int(c), int(q)) for c, q in zip(torch.arange(3, 40, 3), torch.arange(1, 14))]
    rows += [PAD] * 3
    batch = make_batch(rows, 4, 2, 24, 1, seed=3)
    check(batch, batch.run_triton())


def test_many_rows_and_padded_tokens():
    """Guards the prefill kernel's slot -> row search: more rows than one search step (128),
    prefill rows after long runs of decode rows, and padded tokens past the last row (their
    slots must exit, not read query_start_loc out of bounds or write `out`)."""
    pattern = [(9, 1), (12, 3), (7, 1), PAD, (20, 5), (5, 2)]
    rows = [pattern[i % len(pattern)] for i in range(200)] + [(130, 130), (3, 1)]
    batch = make_batch(rows, 2, 1, 16, 16, seed=5)
    num_real = batch.q.shape[0]
    batch.q = torch.cat([batch.q, torch.randn(70, 2, 16, device=DEVICE)])  # padded tokens
    out = batch.run_triton()
    assert out[num_real:].isnan().all(), "padded tokens must be left untouched"
    check(batch, out)


def test_num_splits_heuristic():
    """Guards the split choice: none once the batch has ~256 (row, kv head) programs (32 rows
    of 8 kv heads ran fastest unsplit on the H200 at every context up to 4,096 tokens, and a
    graph's split programs past short contexts cost launch slots), many for a lone long row,
    never a slice under 256 keys, and a result that depends on host ints only
    (graph-capturable); the 5-stage tile only for an unsplit grid of few programs."""
    assert decode_num_splits(32, 8, 4096) == 1
    assert decode_num_splits(512, 8, 256) == 1
    assert decode_num_splits(8, 8, 4096) == 4  # 256 programs
    assert decode_num_splits(1, 8, 2048) == 8  # 2048 / 256
    assert decode_num_splits(1, 1, 100_000) == 64  # capped
    assert decode_num_splits(4, 2, 0) == 1
    assert decode_tiles(torch.bfloat16, 128, 256, 1).num_stages == 5
    assert decode_tiles(torch.bfloat16, 128, 257, 1).num_stages == 3
    assert decode_tiles(torch.bfloat16, 128, 64, 4).num_stages == 3
    assert decode_tiles(torch.float32, 128, 8, 1).block_n == 32  # fp32: the wide tile
    # The packed kernel: a program per (row, slice) over every head, ~264 programs.
    assert packed_num_splits(32, 8, 4096) == 9  # ceil(264 / 32)
    assert packed_num_splits(1, 8, 100_000) == 16  # capped: the merge loads all at once
    assert packed_num_splits(32, 8, 40) == 2  # no slice under 32 tokens
    assert packed_num_splits(300, 8, 4096) == 1
    # "auto" keeps the per-head kernel: the packed one measured slower on the H200.
    assert choose_decode_kernel(32, 8) == "per_head"
    assert choose_decode_kernel(512, 8) == "per_head"


def test_dispatch_cpu_runs_reference(monkeypatch):
    """Guards the dispatch in `paged_attention`: CPU tensors take the torch reference (the
    CPU model path must not depend on Triton's interpreter)."""
    import pdserve.kernels.attention as attention

    def fail(*args, **kwargs):
        raise AssertionError("CPU tensors must not reach the Triton kernels")

    monkeypatch.setattr(attention, "paged_attention_triton", fail)
    batch = make_batch([DECODE, FRESH_PROMPT], 4, 2, 24, 16)
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    args = (batch.tables.cpu(), batch.qsl.cpu(), batch.seq_lens.cpu(), batch.scale, out)
    q, cache = batch.q.double().cpu(), batch.cache.double().cpu().nan_to_num(0.0)
    paged_attention(q, cache, *args, batch.max_query_len, batch.max_seq_len)
    torch.testing.assert_close(out, batch.run_ref(), rtol=0, atol=0)


@pytest.mark.parametrize("pairs_per_program", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "hq,hk,d,bs,dtype",
    [
        (4, 2, 24, 16, torch.float32),
        (6, 3, 20, 8, torch.float32),
        (4, 1, 36, 1, torch.float32),
        (QH, KH, 128, 16, torch.bfloat16),
    ],
)
def test_flat_decode_walks_several_pairs_per_program(
    monkeypatch, pairs_per_program, hq, hk, d, bs, dtype
):
    """Guards the flat decode kernel (kernels/paged_decode_flat.py): a program walks the key
    tiles of 1-4 (row, kv head) pairs in one loop, so the running softmax must restart at
    each pair's first tile and each pair's output land at its last one, whatever the mix
    in a step: decode rows of 1 to 300 keys, a pad row (zeros), and prefill rows that get
    no tiles (the prefill kernel writes them). The SM count is set so the grid gives each
    program that many pairs; the spy checks the flat kernel ran with that grid."""
    import pdserve.kernels.paged_attention_triton as pat

    batch = make_batch(MIXED, hq, hk, d, bs, dtype=dtype, seed=pairs_per_program)
    num_pairs = len(MIXED) * hk
    grids = []
    real = pat.decode_flat

    def spy(*args):
        grids.append(args[7])
        return real(*args)

    monkeypatch.setattr(pat, "decode_flat", spy)
    monkeypatch.setattr(pat, "_num_sms", lambda device: -(-num_pairs // pairs_per_program))
    # One split: the flat kernel serves unsplit grids (the heuristic would split this
    # small batch's longest row).
    check(batch, batch.run_triton(decode_kernel="flat", num_splits=1))
    assert len(grids) == 1 and -(-num_pairs // grids[0]) == pairs_per_program


def test_flat_programs_and_fallbacks(monkeypatch):
    """Guards the flat kernel's grid: at most one program per SM, the pairs spread evenly
    (256 pairs on 132 SMs: 128 programs of 2, not 124 of 2 and 8 of 1), and no flat grid
    when a program would need more than MAX_PAIRS pairs; then, as with splits, the
    per-head kernel runs (its answer checked on the same batch)."""
    import pdserve.kernels.paged_attention_triton as pat
    from pdserve.kernels.paged_decode_flat import MAX_PAIRS, flat_programs

    assert flat_programs(256, 132) == 128
    assert flat_programs(133, 132) == 67
    assert flat_programs(132, 132) == 132
    assert flat_programs(1, 132) == 1
    assert flat_programs(MAX_PAIRS * 132, 132) == 132
    assert flat_programs(MAX_PAIRS * 132 + 1, 132) is None
    calls = []
    real = pat.decode_flat
    monkeypatch.setattr(pat, "decode_flat", lambda *a: (calls.append(a[7]), real(*a)))
    batch = make_batch([DECODE, PAD, (3, 1), LONG_DECODE, DECODE_AT_1], 4, 2, 24, 16, seed=9)
    monkeypatch.setattr(pat, "_num_sms", lambda device: 2)  # 10 pairs: 5 a program
    check(batch, batch.run_triton(decode_kernel="flat", num_splits=1))
    assert calls == []
    monkeypatch.setattr(pat, "_num_sms", lambda device: 3)  # 4 pairs a program
    check(batch, batch.run_triton(decode_kernel="flat", num_splits=3))  # split: per-head
    assert calls == []
    check(batch, batch.run_triton(decode_kernel="flat", num_splits=1))
    assert calls == [3]
