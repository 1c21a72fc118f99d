"""CUDA-only checks of the Triton kernels: KV-cache offsets past int32, public functions
dispatching CUDA tensors to their `_triton` launchers, and the launchers of one step
running without host syncs and replaying correctly in a CUDA graph. conftest does not
collect this module without a GPU; the parity tests and their helpers live in
`test_triton_index_kernels.py` and `test_triton_layer_kernels.py`.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention_triton import check as check_attention
from test_paged_attention_triton import make_batch
from test_skinny_linear import check as check_skinny
from test_skinny_linear import make as make_skinny
from test_triton_index_kernels import DEVICE, _batch, _qkv_views
from test_triton_layer_kernels import _TRITON_LAUNCHERS, _cpu_calls

from pdserve.kernels import activation, attention, block_table, input_prep, kv_write, norm, rope
from pdserve.kernels import skinny_linear as sl
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.paged_attention_triton import paged_attention_triton
from pdserve.kernels.workspace import KernelWorkspace

DECODE_COUNTERS = [("per_head", "decode_attention"), ("packed", "decode_packed")]


def test_write_kv_offsets_past_int32():
    """Guards 32-bit cache offsets: slots in a cache of more than 2^31 elements (4.3 GB of
    bf16) must land at their true address, not wrap into the start of the cache."""
    heads, d, block_size = 8, 128, 16
    num_blocks = 2**31 // (2 * block_size * heads * d) + 2
    cache = torch.zeros(num_blocks, 2, block_size, heads, d, dtype=torch.bfloat16, device=DEVICE)
    key = torch.randn(3, heads, d, device=DEVICE).to(torch.bfloat16)
    value = torch.randn(3, heads, d, device=DEVICE).to(torch.bfloat16)
    last = num_blocks * block_size - 1
    slot_mapping = torch.tensor([last, last - block_size - 3, 5], device=DEVICE)
    kv_write.write_kv_triton(key, value, cache, slot_mapping)
    for i, slot in enumerate(slot_mapping.tolist()):
        assert torch.equal(cache[slot // block_size, 0, slot % block_size], key[i])
        assert torch.equal(cache[slot // block_size, 1, slot % block_size], value[i])
    assert int(torch.count_nonzero(cache[:2])) == 2 * heads * d  # only slot 5's K and V
    del cache
    torch.cuda.empty_cache()


def test_public_functions_on_cuda_run_triton(monkeypatch):
    """Guards a public function that keeps calling the torch reference on CUDA tensors
    (correct, but with host syncs that break CUDA-graph capture and the async loop)."""
    called = []
    for name, (module, attr) in _TRITON_LAUNCHERS.items():
        original = getattr(module, attr)

        def spy(*args, _name=name, _original=original, **kwargs):
            called.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attr, spy)
    for name, public, _, args in _cpu_calls():
        public(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
        assert called and called[-1] == name, name


def _step(bufs):
    """One decode-like step's device work, launched only through the `_triton` launchers."""
    input_prep.prepare_inputs_triton(*bufs["prep_in"], *bufs["prep_out"], bufs["num_tokens"])
    block_table.gather_block_tables_triton(bufs["table"], bufs["prep_in"][0], bufs["tables"])
    block_table.compute_slot_mapping_triton(
        bufs["tables"],
        bufs["prep_in"][1],
        bufs["prep_out"][1],
        16,
        bufs["slots"],
        bufs["num_tokens"],
    )
    x, w = bufs["x"], bufs["w"]
    normed, residual = norm.fused_add_rms_norm_triton(x, x, w, 1e-6)
    q, k, v = bufs["q"], bufs["k"], bufs["v"]
    q, k = rope.apply_rope_triton(q, k, bufs["prep_out"][1], bufs["cos_sin"])
    kv_write.write_kv_triton(k, v, bufs["cache"], bufs["slots"])
    act = activation.silu_and_mul_triton(torch.cat([normed, residual], dim=-1))
    input_prep.post_update_triton(
        bufs["prep_in"][0],
        bufs["sampled"],
        bufs["prep_out"][2][:8],
        bufs["mask"],
        bufs["prep_in"][3],
    )
    return normed, q, k, act


def _step_buffers():
    idx, qsl, computed, token_ids = _batch([1] * 8, list(range(20, 28)), num_slots=16, max_len=64)
    num_tokens = 8
    prep_out = [
        torch.zeros(12, dtype=torch.int32, device=DEVICE),
        torch.zeros(12, dtype=torch.int64, device=DEVICE),
        torch.zeros(10, dtype=torch.int32, device=DEVICE),
    ]
    q, k, v = _qkv_views(12, 16, 8, 128, torch.bfloat16, seed=9)
    return {
        "prep_in": [idx, qsl, computed, token_ids],
        "prep_out": prep_out,
        "num_tokens": num_tokens,
        "table": torch.randint(1, 60, (16, 4), dtype=torch.int32, device=DEVICE),
        "tables": torch.zeros(10, 4, dtype=torch.int32, device=DEVICE),
        "slots": torch.zeros(12, dtype=torch.int64, device=DEVICE),
        "x": torch.randn(12, 1024, device=DEVICE).to(torch.bfloat16),
        "w": torch.randn(1024, device=DEVICE).to(torch.bfloat16),
        "q": q,
        "k": k,
        "v": v,
        "cos_sin": torch.randn(64, 128, device=DEVICE),
        "cache": torch.zeros(64, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE),
        "sampled": torch.randint(0, 1000, (8,), device=DEVICE),
        "mask": torch.ones(8, dtype=torch.bool, device=DEVICE),
    }


def test_launchers_never_sync_with_the_host():
    """Guards a `.item()`/`.tolist()`/`nonzero()` slipping into a launcher: the async step
    loop would stall on every step, and CUDA-graph capture would fail."""
    bufs = _step_buffers()
    _step(bufs)  # compile outside the check (compilation itself may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(bufs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_launchers_replay_in_a_cuda_graph():
    """Guards launchers that cannot be captured (a sync or a value-dependent allocation) or
    that bake device values in at capture time: after capture, new slot/position inputs
    written into the same buffers must give the reference's results on replay."""
    bufs = _step_buffers()
    _step(bufs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(bufs)
    idx, qsl, computed, token_ids = bufs["prep_in"]
    idx.copy_(torch.randperm(16, device=DEVICE)[:8].to(torch.int32))
    computed.copy_(torch.arange(30, 38, dtype=torch.int32, device=DEVICE))
    bufs["cache"].zero_()
    token_ids_before = token_ids.clone()
    graph.replay()
    torch.cuda.synchronize()
    want_prep = [torch.zeros_like(t) for t in bufs["prep_out"]]
    input_prep.prepare_inputs_ref(idx, qsl, computed, token_ids_before, *want_prep, 8)
    for got, want in zip(bufs["prep_out"], want_prep):
        assert torch.equal(got, want)
    want_tables = torch.zeros_like(bufs["tables"])
    block_table.gather_block_tables_ref(bufs["table"], idx, want_tables)
    assert torch.equal(bufs["tables"], want_tables)
    want_slots = torch.zeros_like(bufs["slots"])
    block_table.compute_slot_mapping_ref(want_tables, qsl, want_prep[1], 16, want_slots, 8)
    assert torch.equal(bufs["slots"], want_slots)
    want_q, want_k = rope.apply_rope_ref(bufs["q"], bufs["k"], want_prep[1], bufs["cos_sin"])
    assert torch.equal(outs[1], want_q) and torch.equal(outs[2], want_k)
    want_cache = torch.zeros_like(bufs["cache"])
    attention.write_kv_ref(outs[2], bufs["v"], want_cache, want_slots)
    assert torch.equal(bufs["cache"], want_cache)
    want_tokens = token_ids_before.clone()
    input_prep.post_update_ref(idx, bufs["sampled"], want_prep[2][:8], bufs["mask"], want_tokens)
    assert torch.equal(token_ids, want_tokens)


@pytest.mark.parametrize("rows", [1, 32, 64])
@pytest.mark.parametrize("n,k,silu", [(1024, 2048, False), (1024, 3072, False), (3072, 1024, True)])
def test_skinny_linear_at_decoder_shapes(rows, n, k, silu):
    """The Qwen3-0.6B o_proj, down_proj and gate_up_proj (SiLU-and-mul fused) as `linear`
    sends them, at decode batch sizes."""
    w_rows = 2 * n if silu else n
    x, w, b = make_skinny(rows, w_rows, k, torch.bfloat16, False, seed=rows)
    y = sl.linear(x, w, b, KernelWorkspace(), silu_mul_output=silu)
    if silu:  # the projections alone, then the activation kernel on them: bitwise equal
        gate_up = sl.skinny_linear_triton(
            x, w, b, KernelWorkspace(), config=sl.choose_config(n, k, True)
        )
        check_skinny(gate_up, x, w, b)
        assert torch.equal(y, silu_and_mul(gate_up))
    else:
        check_skinny(y, x, w, b)


def test_skinny_linear_and_split_attention_replay_in_a_cuda_graph():
    """Guards the last-arriver kernels under CUDA graphs: captured on the model's workspace,
    replays on new inputs equal eager calls bitwise, and the counters are zero after each
    replay (a counter left non-zero would merge early on the next replay)."""
    ws = KernelWorkspace()
    x, w, b = make_skinny(32, 1024, 3072, torch.bfloat16, True, seed=1)
    sl.linear(x, w, b, ws)  # sizes the workspace before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = sl.linear(x, w, b, ws)
    for seed in (2, 3):
        x.copy_(make_skinny(32, 1024, 3072, torch.bfloat16, True, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, sl.linear(x, w, b, ws))
        assert int(ws.counters("skinny_linear", 1, x.device).abs().sum()) == 0

    # Split decode attention on the same workspace: 32 rows, several splits each, with
    # either decode kernel (each has its own counters).
    batch = make_batch([(700, 1)] * 30 + [(3, 1), (0, 1)], 16, 8, 128, 16, torch.bfloat16)
    for kernel, counter in DECODE_COUNTERS:
        eager = batch.run_triton(num_splits=4, workspace=ws, decode_kernel=kernel)
        out = torch.empty_like(eager)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention_triton(
                batch.q, batch.cache, batch.tables, batch.qsl, batch.seq_lens, batch.scale, out,
                1, batch.max_seq_len, num_splits=4, workspace=ws, decode_kernel=kernel,
            )  # fmt: skip
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), kernel
            assert int(ws.counters(counter, 1, x.device).abs().sum()) == 0, kernel


def test_last_arriver_merges_never_read_a_stale_partial():
    """Guards the memory ordering of the in-kernel merges (a barrier, an acq_rel counter
    and L2 loads): 200 back-to-back launches on fresh inputs over one workspace. A merge
    that read a partial before its program had stored it would read the previous launch's
    value for that slot, an O(|y|) error the bf16 bound cannot absorb."""
    ws = KernelWorkspace()
    g = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16, generator=g) / 55
    xs = torch.randn(200, 32, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
    outs = [sl.linear(x, w, None, ws) for x in xs]  # queued back to back, no syncs between
    # test_skinny_linear's bound with the reference in fp32 on the GPU (TF32 is off for
    # matmuls by default): 200 float64 products on the host would take a minute.
    assert not torch.backends.cuda.matmul.allow_tf32
    wf = w.float()
    for x, y in zip(xs, outs):
        ref = x.float() @ wf.T
        # 2^-11 for the sums: the fp32 reference adds its own summation error to the kernel's.
        bound = 2.0**-8 * ref.abs() + 2.0**-11 * (x.float().abs() @ wf.abs().T) + 1e-6
        assert ((y.float() - ref).abs() <= bound).all()
    assert int(ws.counters("skinny_linear", 1, w.device).abs().sum()) == 0
    batches = [make_batch([(600, 1)] * 24 + [(0, 1)], 16, 8, 128, 16, seed=s) for s in range(8)]
    for kernel, counter in DECODE_COUNTERS:
        outs = [
            batch.run_triton(num_splits=4, workspace=ws, decode_kernel=kernel) for batch in batches
        ]
        for batch, out in zip(batches, outs):
            check_attention(batch, out)  # fp32 against the float64 spec, 1e-5
        assert int(ws.counters(counter, 1, w.device).abs().sum()) == 0, kernel


def test_workspace_finds_a_buffer_by_an_index_less_cuda_device():
    """Guards the workspace's device key: `cuda` means the current `cuda:N`, so a caller
    naming the device without an index gets the buffer (and its counters, zero between
    launches) that a tensor's own device was given, not a fresh zeroed copy."""
    ws = KernelWorkspace()
    indexed = torch.device("cuda", torch.cuda.current_device())
    counters = ws.counters("c", 8, indexed)
    counters[3] = 7  # a value a fresh buffer would not have
    again = ws.counters("c", 8, torch.device("cuda"))
    assert again.data_ptr() == counters.data_ptr() and int(again[3]) == 7
    assert (
        ws.scratch("s", 4, torch.device("cuda")).data_ptr()
        == ws.scratch("s", 4, indexed).data_ptr()
    )
