"""`--kv-cache-dtype fp8` (kernels/fp8_kv.py): the paged KV cache holds K / k_scale and
V / v_scale as float8 bytes, half a 16-bit cache's.

- The Triton writers' float8 encoding is torch's cast, bit for bit, in both formats (ties
  to even, subnormals, saturation, negative zero): Triton's interpreter's own float8
  casts are not, so the kernels encode in integer arithmetic.
- The KV write, the fused q/k/v preparation and the MLA latent write store the bytes the
  references store; the attention kernels read an FP8 cache as the reference reads it.
- The engine in float32 with an FP8 cache equals transformers whose attention sees K and
  V rounded through the same float8 and scales (a registered attention function; for
  MLA the latent and rotated k_pe), with the checkpoint's scales where it has them.
- PD moves FP8 pages over a real socket; an FP8 cache holds 4x a float32 cache's blocks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE
from test_paged_attention_triton import DECODE_KERNELS, MIXED, check, make_batch, run_kernel
from test_pd_engine import GREEDY, _colocated, _kw, _pd, _prompts, _run, wait_for_tickets
from test_qkv_prep import _inputs

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import write_kv_ref
from pdserve.kernels.fp8_kv import FORMATS, fp8_code, quantize_ref
from pdserve.kernels.kv_write import write_kv_triton
from pdserve.kernels.mla_attention import paged_mla_attention_ref, write_latent_ref
from pdserve.kernels.mla_attention_triton import paged_mla_attention_triton, write_latent_triton
from pdserve.kernels.qkv_prep import prepare_qkv_ref, prepare_qkv_triton
from pdserve.runner.models.kv_scales import KvScales

FP8 = list(FORMATS)


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, MANTISSA: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, fp8_code(tl.load(x_ptr + offs, mask=mask), MANTISSA), mask=mask)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_the_kernels_float8_encoding_is_torchs_cast(dtype):
    """Every finite code, every midpoint between neighbours (exact ties: to even) and one
    float32 step either side of it, 20k values over 2^-24..2^18 (subnormals, saturation),
    zeros of both signs: the encoded bytes are torch's `clamp(..).to(dtype)` bytes."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = codes[codes.isfinite()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.empty(20000).uniform_(-24, 18, generator=g))
    spread = spread * torch.randn(20000, generator=g).sign()
    inf = torch.tensor(float("inf"))
    x = torch.cat([values, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                   spread, torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-45])])  # fmt: skip
    x = x.to(DEVICE)
    got = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](
        x, got, x.numel(), MANTISSA=FORMATS[dtype].mantissa_bits, BLOCK=1024
    )
    want = quantize_ref(x, 1.0, dtype).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:5]]


def _kv_rows(t, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = (4 * torch.randn(t, hkv, d, generator=g)).to(dtype)  # some past 448 / scale
    v = (0.01 * torch.randn(t, hkv, d, generator=g)).to(dtype)  # subnormal territory
    k[0, 0, :4] = torch.tensor([0.0, -0.0, 1e4, -1e4])
    return k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.0037)])
def test_the_kv_write_stores_the_references_bytes(cache_dtype, scales):
    """Guards the scale (divided, K's for K and V's for V), saturation, pads (slot -1 writes
    nothing) and the uint8 view's addressing."""
    k, v = _kv_rows(9, 3, 20, torch.float32, seed=1)
    slots = torch.tensor([5, -1, 0, 17, 33, -1, 2, 40, 8], device=DEVICE)
    got = torch.zeros(4, 2, 16, 3, 20, dtype=cache_dtype, device=DEVICE)
    want = got.clone()
    write_kv_triton(k, v, got, slots, scales)
    write_kv_ref(k, v, want, slots, scales)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # The reference divides by the scale: read back and scaled, every value the format
    # holds as a normal number is within half a step (2^-(mantissa + 1)) of its input.
    fmt, live = FORMATS[cache_dtype], slots >= 0
    at = slots[live]
    for i, (x, scale) in enumerate(((k, scales[0]), (v, scales[1]))):
        x = x[live].float()
        back = want[at // 16, i, at % 16].float() * scale
        smallest = 2.0**-6 if fmt.mantissa_bits == 3 else 2.0**-14
        normal = (x.abs() / scale <= fmt.max_finite) & (x.abs() / scale >= smallest)
        step = 2.0 ** -(fmt.mantissa_bits + 1)
        assert normal.sum() > 20
        assert ((back - x).abs() <= step * x.abs())[normal].all()


def _adjacent_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal float8 bytes, except at most 1% one code apart with the same sign: the 16-bit
    or float32 value before the rounding may differ by an ulp between kernel and
    reference (test_qkv_prep's tolerance), which moves a value sitting on an FP8 midpoint
    one code over."""
    a, b = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    differ = a != b
    assert differ.float().mean() <= 0.01, f"{differ.float().mean():.2%} of bytes differ"
    assert ((a - b).abs()[differ] == 1).all(), "a byte more than one code away"


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_fused_qkv_preparation_writes_fp8(cache_dtype, dtype):
    """The fused kernel quantizes the normed, rotated K (not the raw projection) and V."""
    inp = _inputs(17, 4, 2, 128, dtype, seed=3)  # a block of 16 and one token after it
    inp["kv_cache"] = inp["kv_cache"].to(cache_dtype)
    scales = (0.5, 0.03)
    want_cache, got_cache = inp["kv_cache"].clone(), inp["kv_cache"].clone()
    want_q = prepare_qkv_ref(**dict(inp, kv_cache=want_cache), scales=scales)
    got_q = prepare_qkv_triton(**dict(inp, kv_cache=got_cache), scales=scales)
    torch.testing.assert_close(got_q, want_q, rtol=4e-3, atol=4e-3)
    _adjacent_codes(got_cache, want_cache)
    assert not torch.equal(want_cache.view(torch.uint8), inp["kv_cache"].view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", [*DECODE_KERNELS, "flat"])
def test_attention_reads_an_fp8_cache_as_the_reference_does(cache_dtype, q_dtype, kernel,
                                                            monkeypatch):  # fmt: skip
    """Prefill chunks on a cached prefix, decode rows (split), a pad row and the NaN-poisoned
    slots outside every context (float8 NaN bytes): each decode kernel and the prefill
    kernel convert the float8 tiles to q's dtype, within the q dtype's tolerance of the
    float64 reference on the same float8 values."""
    batch = make_batch(MIXED, 4, 2, 36, 16, dtype=q_dtype, seed=5)
    batch.cache = batch.cache.to(cache_dtype)
    check(batch, run_kernel(batch, kernel, monkeypatch))


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_mla_writes_and_reads_an_fp8_latent_cache(cache_dtype):
    from test_mla import _mla_batch

    rows = [(9, 3), (5, 1), (13, 13), (0, 1)]
    q, cache, tables, qsl, seq_lens = _mla_batch(4, 24, 8, 4, rows, torch.float32, seed=4)
    cache = cache.to(cache_dtype)
    want = torch.zeros(q.shape[0], 4, 24, device=DEVICE)
    paged_mla_attention_ref(q, cache, tables, qsl, seq_lens, 0.3, 24, want)
    got = torch.full_like(want, float("nan"))
    paged_mla_attention_triton(q, cache, tables, qsl, seq_lens, 0.3, 24, got, 13)
    real = torch.ones(q.shape[0], dtype=torch.bool)
    real[-1] = False  # the pad row: zeros here, untouched by the reference
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    latent = (3 * torch.randn(5, 32)).to(DEVICE)
    slots = torch.tensor([3, -1, 0, 5, -1], device=DEVICE)
    written, want_written = torch.zeros_like(cache), torch.zeros_like(cache)
    write_latent_triton(latent, written, slots, 0.25)
    write_latent_ref(latent, want_written, slots, 0.25)
    assert torch.equal(written.view(torch.uint8), want_written.view(torch.uint8))


# ---- the engine against transformers with float8-rounded K and V -------------------------


def _rounded(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return quantize_ref(x, scale, dtype).float().to(x.dtype) * scale


def _hf_with_fp8_kv(model_dir: str, cache_dtype, scales: dict[int, tuple[float, float]]):
    """transformers' model (float32) whose attention sees every K and V (RoPE'd, normed, as
    cached) rounded through `cache_dtype` with the layer's (k_scale, v_scale)."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, **kw):
        ks, vs = scales.get(module.layer_idx, (1.0, 1.0))
        key, value = _rounded(key, ks, cache_dtype), _rounded(value, vs, cache_dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    if getattr(AutoConfig.from_pretrained(model_dir), "kv_lora_rank", None):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for layer in model.model.layers:  # MLA: the latent c and rotated k_pe, as cached
            attn, (ks, _) = layer.self_attn, scales.get(layer.self_attn.layer_idx, (1.0, 1.0))
            expand = attn.expand_kv
            attn.expand_kv = lambda c, pe, f=expand, s=ks: f(
                _rounded(c, s, cache_dtype), _rounded(pe, s, cache_dtype)
            )
    else:
        AttentionInterface.register("pdserve_fp8_kv", attend)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="pdserve_fp8_kv"
        )
    return model.to(DEVICE).eval()


def _engine_logprobs(model_dir: str, cache_dtype: str, prompts, n: int):
    llm = LLM(model=model_dir, device=DEVICE, dtype="float32", block_size=16,
              max_num_batched_tokens=32, kv_cache_dtype=cache_dtype)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def _assert_engine_equals_hf(model_dir, cache_name, scales, prompts, n=8):
    """Our sampled tokens are transformers' argmax at every step, and their logprobs
    agree: the median step to 2e-5 (float32 summation order, conftest.assert_logprobs_
    match_hf), every step to 1e-3. A K, V or latent value that summation order moves
    across a float8 midpoint rounds one code the other way (up to 2^-3 of it in e4m3),
    which moved a few logprobs by up to 2.6e-4 on an H100 (MLA, k_scale 0.02). The float8
    rounding itself moves them by 0.15-0.8 against a float32 cache (test below)."""
    cache_dtype = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache_name]
    llm, outs = _engine_logprobs(model_dir, cache_name, prompts, n)
    assert llm.engine.execution_path["kv_cache"] == str(cache_dtype).removeprefix("torch.")
    model = _hf_with_fp8_kv(model_dir, cache_dtype, scales)
    got_all, want_all = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out.token_ids], device=DEVICE)).logits[0]
        steps = logits.float().cpu().log_softmax(-1)[len(prompt) - 1 : -1]
        assert steps.argmax(-1).tolist() == out.token_ids
        want = steps.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        got = torch.tensor([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
        got_all.append(got)
        want_all.append(want)
    err = (torch.cat(got_all) - torch.cat(want_all)).abs()
    assert err.max() <= 1e-3 and err.median() <= 2e-5, err
    return torch.cat(got_all)


PROMPTS = [[5, 17, 101, 9, 250, 33, 7], list(range(40, 110))]  # one over 2 chunks and blocks


@pytest.mark.parametrize("cache_name", ["fp8", "fp8_e5m2"])
def test_the_engine_equals_transformers_with_fp8_rounded_kv(tiny_qwen3_dir, cache_name):
    """Qwen3 (k-norm, then RoPE, then the cache), a prompt over several 32-token chunks
    that reads its FP8 prefix back. The rounding is real: the logprobs move by more than
    the tolerance against the float32 cache."""
    got = _assert_engine_equals_hf(tiny_qwen3_dir, cache_name, {}, PROMPTS)
    _, fp8 = _engine_logprobs(tiny_qwen3_dir, cache_name, PROMPTS, 8)
    _, plain = _engine_logprobs(tiny_qwen3_dir, "auto", PROMPTS, 8)
    if [o.token_ids for o in plain] == [o.token_ids for o in fp8]:
        lps = [lp[t].logprob for o in plain for t, lp in zip(o.token_ids, o.logprobs)]
        assert (torch.tensor(lps) - got).abs().max() > 1e-2


def _with_tensors(src: str, out: Path, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint at `src` with `extra` tensors in its safetensors file."""
    from safetensors.torch import load_file, save_file

    for f in Path(src).iterdir():
        shutil.copy(f, out / f.name)
    file = next(out.glob("*.safetensors"))
    save_file(load_file(str(file)) | extra, str(file), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def scaled_llama_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """tiny_llama's checkpoint plus FP8 KV scales under all three names vLLM reads."""
    return _with_tensors(tiny_llama_dir, tmp_path_factory.mktemp("scaled-llama"), {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.05),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.004),
        "model.layers.1.self_attn.kv_scale": torch.tensor([0.3]),
        "model.layers.2.self_attn.k_proj.output_scale": torch.tensor(2.0),
        "model.layers.2.self_attn.v_proj.output_scale": torch.tensor(0.5),
    })  # fmt: skip


SCALES = {0: (0.05, 0.004), 1: (0.3, 0.3), 2: (2.0, 0.5)}


def test_the_checkpoints_kv_scales_are_read_and_applied(scaled_llama_dir):
    """Each layer's scales from its own checkpoint name; transformers' reference rounds
    with the same ones. V at scale 0.004 and K at 0.05 use the upper float8 range;
    layer 2's 2.0 its lower."""
    _assert_engine_equals_hf(scaled_llama_dir, "fp8", SCALES, PROMPTS)
    llm = LLM(model=scaled_llama_dir, device=DEVICE, dtype="float32", kv_cache_dtype="fp8")
    attn = [layer.self_attn for layer in llm.engine.runner.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [pytest.approx(SCALES[i]) for i in range(3)]


@pytest.mark.parametrize("k_scale", [None, 0.02])
def test_mla_with_an_fp8_latent_cache_equals_transformers(tiny_deepseek_v2_dir, k_scale,
                                                          tmp_path):  # fmt: skip
    """DeepSeek-V2's latent rows (normed c, rotated k_pe) round through float8 as cached;
    with a checkpoint k_scale on layer 0, which scales the latent as key and as value."""
    model, scales = tiny_deepseek_v2_dir, {}
    if k_scale is not None:
        name = "model.layers.0.self_attn.k_scale"
        model = _with_tensors(model, tmp_path, {name: torch.tensor(k_scale)})
        scales = {0: (k_scale, 1.0)}
    _assert_engine_equals_hf(model, "fp8", scales, PROMPTS)


def test_bad_kv_scales_are_refused_by_name():
    scales = KvScales()
    with pytest.raises(ValueError, match="per-head scales are not supported"):
        list(scales.take([("model.layers.0.self_attn.k_scale", torch.ones(4))]))
    with pytest.raises(ValueError, match="must be positive"):
        list(scales.take([("model.layers.0.self_attn.v_scale", torch.tensor(0.0))]))
    kept = list(scales.take([("a.weight", torch.ones(2)), ("model.x.k_scale", torch.tensor(1.0))]))
    assert [n for n, _ in kept] == ["a.weight"]
    with pytest.raises(ValueError, match="no attention module there"):
        scales.apply(torch.nn.Linear(2, 2))


def test_kv_scales_follow_the_familys_renames(tiny_nemotron_h_dir, tmp_path):
    """NemotronH's released names (`backbone.layers.N.mixer`) reach our attention block."""
    attention = 2  # tiny_nemotron_h's attention block (conftest: layers_block_type)
    model = _with_tensors(tiny_nemotron_h_dir, tmp_path, {
        f"backbone.layers.{attention}.mixer.k_scale": torch.tensor(0.25),
        f"backbone.layers.{attention}.mixer.v_scale": torch.tensor(0.5),
    })  # fmt: skip
    llm = LLM(model=model, device=DEVICE, dtype="float32", kv_cache_dtype="fp8")
    mixer = llm.engine.runner.model.layers[attention].mixer
    assert (mixer.k_scale, mixer.v_scale) == (0.25, 0.5)


def test_an_fp8_cache_holds_four_times_a_float32_caches_blocks(tiny_qwen3_dir):
    kw = dict(model=tiny_qwen3_dir, device=DEVICE, dtype="float32", kv_cache_memory_bytes=1 << 20)
    auto, fp8 = LLM(**kw), LLM(**kw, kv_cache_dtype="fp8")
    assert auto.engine.runner.kv_cache.dtype == torch.float32
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    n_auto, n_fp8 = auto.engine.runner.num_blocks, fp8.engine.runner.num_blocks
    assert 4 * n_auto <= n_fp8 < 4 * (n_auto + 1)  # the same budget, floored per block
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        LLM(**kw, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="needs the mrv2 runner"):
        LLM(**kw, kv_cache_dtype="fp8", runner="reference")


def test_pd_moves_fp8_pages_over_a_socket(tiny_qwen3_dir):
    """Prefill and decode workers both with FP8 caches, pages over a real ZMQ socket: the
    tokens are one FP8 engine's, and the layout names the float8 dtype (a peer with
    another cache dtype differs in it: kvtransfer/layout.py)."""
    from pdserve.decode.worker import DecodeWorker
    from pdserve.kvtransfer.transport_tcp import TcpTransport
    from pdserve.prefill.worker import PrefillWorker
    from pdserve.runner.engine import Engine

    prompts = _prompts(4, 997, seed=9, lo=5, hi=60)
    extra = dict(kv_cache_dtype="fp8")
    want = _colocated(tiny_qwen3_dir, prompts, GREEDY, **extra)
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir, **extra)), "P0")
    try:
        layout = prefill.source.layout
        assert layout.groups[0].dtype == "float8_e4m3fn"
        decode = DecodeWorker(
            _kw(tiny_qwen3_dir, **extra), "D0", {"tcp": TcpTransport("D0", layout)}
        )
        got = _pd(prefill, decode, prompts)
        assert got == want
        assert decode.loader.stats.loads == len(prompts)
        assert decode.loader.stats.recomputes == 0
        decode.close()
    finally:
        prefill.close()


def test_the_kv_tier_and_layer_wise_pulls_carry_fp8_blocks(tiny_qwen3_dir):
    """The tier's host copies and tcp's layer-wise frames move the float8 bytes as they
    are: B reads A's prompts from the tier, C pulls them in per-layer frames, both decode
    as one FP8 engine."""
    from test_pd_engine import _local_pair

    from pdserve.decode.worker import DecodeWorker
    from pdserve.kvtransfer.tier import HostKVTier
    from pdserve.kvtransfer.transport_tcp import TcpTransport
    from pdserve.prefill.worker import PrefillWorker
    from pdserve.runner.engine import Engine

    fp8 = dict(kv_cache_dtype="fp8")
    prompts = _prompts(3, 990, seed=11, lo=40, hi=80)
    want = _colocated(tiny_qwen3_dir, prompts, GREEDY, **fp8)
    tier = HostKVTier(byte_budget=64 << 20)
    prefill, decode = _local_pair(tiny_qwen3_dir, tier=tier, **fp8)
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    for r in wait_for_tickets(prefill, len(prompts), 60):
        prefill.abort(r.request_id)  # only the tier has the KV now
    for i, p in enumerate(prompts):
        decode.submit(str(i), p, GREEDY, ticket=None)
    assert _run(decode.step, decode.has_work) == want
    assert decode.loader.stats.tier_blocks == sum(len(p) // 16 for p in prompts)

    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_qwen3_dir, **fp8)), "P1")
    try:
        tcp = TcpTransport("D1", prefill.source.layout, layer_wise=True)
        decode = DecodeWorker(_kw(tiny_qwen3_dir, **fp8), "D1", {"tcp": tcp})
        assert _pd(prefill, decode, prompts) == want
        assert decode.loader.stats.bytes_pulled > 0
        decode.close()
    finally:
        prefill.close()
