"""Offline throughput of the engine on random-weight bf16 MoE / MLA / hybrid models (GPU),
with vLLM.

    python benchmarks/model_throughput.py --shape qwen3_30b_a3b [--layers 12]
        [--workloads decode_heavy,small_batch] [--peer vllm] [--out benchmarks/results]

Shapes (per-layer sizes of the released models; `--layers` keeps the benchmark inside the
device's disk and a call's time, and throughput per layer is what compares):
  qwen3_30b_a3b     Qwen3-30B-A3B: 128 experts of 768, 8 picks, GQA 32/4 x 128
  deepseek_v2_lite  DeepSeek-V2-Lite: MLA (r 512, rope 64, 16 heads), 64 experts of 1408,
                    6 picks, 2 shared, layer 0 dense
  glm45_air         GLM-4.5-Air's layer: 128 experts of 1408, 8 picks, 1 shared, GQA 96/8 x
                    128 with RoPE over half a head
  mixtral_8x7b      Mixtral-8x7B: 8 experts of 14336, 2 picks, GQA 32/8 x 128
  gemma3_12b        Gemma-3-12B's text layers: GQA 16/8 x 256, GeGLU 15360, five local layers
                    (1,024-key window) to one global, 262k vocabulary
  granite4_h_tiny   Granite-4.0-H-Tiny: Mamba2 layers (48 heads of 64, state 128) and one
                    NoPE attention layer (GQA 12/4 x 128) in ten, 64 experts of 512, 6 picks,
                    a shared MLP of 1024
  qwen3_next_80b    Qwen3-Next-80B-A3B: three Gated DeltaNet layers (16 key / 32 value heads
                    of 128) to one gated attention layer (GQA 16/2 x 256, RoPE on a
                    quarter), 512 experts of 512, 10 picks, a gated shared expert of 512
  llama4_scout      Llama-4-Scout-17B-16E's language model: GQA 40/8 x 128, interleaved RoPE
                    with q/k norms and 8,192-position chunks on three layers in four, 16
                    experts of 8192 (one a token, on its input) beside a shared one
  llama3_8b         Llama-3-8B: GQA 32/8 x 128, SwiGLU 14336, 128k vocabulary (with
                    `--quantize gptq4`: its projections as a 4-bit GPTQ checkpoint,
                    benchmarks/gptq_checkpoint.py, run packed; `--quantize fp8`: served
                    with --quantization fp8)
The workloads, prompts (seeded random ids) and forced output lengths are throughput.py's.
Each row records the runner and execution path (`experts`, graph scope) that ran it.
`--peer vllm` runs vLLM 0.25 on the same directory in a child process afterwards.
Not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from run_meta import device_kind, git_commit
from throughput import WORKLOADS, Workload, make_prompts, run_engine, run_vllm_peer

SHAPES = {
    "qwen3_30b_a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151_936, hidden_size=2048, intermediate_size=6144,
            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            max_position_embeddings=40_960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=151_643, eos_token_id=151_645,
            architectures=["Qwen3MoeForCausalLM"],
        ),
        12,
    ),
    "deepseek_v2_lite": (
        "DeepseekV2Config",
        dict(
            vocab_size=102_400, hidden_size=2048, intermediate_size=10_944,
            moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
            n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
            routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_attention_heads=16,
            num_key_value_heads=16, max_position_embeddings=163_840, rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0,
                "original_max_position_embeddings": 4096, "mscale": 0.707,
                "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
            },
            tie_word_embeddings=False, bos_token_id=100_000, eos_token_id=100_001,
            architectures=["DeepseekV2ForCausalLM"],
        ),
        8,
    ),
    "glm45_air": (
        "Glm4MoeConfig",
        dict(
            vocab_size=151_552, hidden_size=4096, intermediate_size=10_944,
            moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=1.0, num_attention_heads=96,
            num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5,
            attention_bias=True, use_qk_norm=False, max_position_embeddings=131_072,
            rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=151_329, eos_token_id=151_329, architectures=["Glm4MoeForCausalLM"],
        ),
        4,
    ),
    "mixtral_8x7b": (
        "MixtralConfig",
        dict(
            vocab_size=32_000, hidden_size=4096, intermediate_size=14_336, num_local_experts=8,
            num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
            max_position_embeddings=32_768, rope_theta=1_000_000.0, sliding_window=None,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            architectures=["MixtralForCausalLM"],
        ),
        4,
    ),
    "gemma3_12b": (
        "Gemma3TextConfig",
        dict(
            vocab_size=262_208, hidden_size=3840, intermediate_size=15_360,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=1024, max_position_embeddings=131_072,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0,
                                   "factor": 8.0},
            },
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
            architectures=["Gemma3ForCausalLM"],
        ),
        6,
    ),
    "granite4_h_tiny": (
        "GraniteMoeHybridConfig",
        dict(
            vocab_size=100_352, hidden_size=1536, intermediate_size=512,
            shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6,
            num_attention_heads=12, num_key_value_heads=4, position_embedding_type="nope",
            mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
            embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22,
            attention_multiplier=0.0078125, max_position_embeddings=131_072,
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=100_257,
            eos_token_id=100_257, architectures=["GraniteMoeHybridForCausalLM"],
            # one attention layer in ten, as the released 4 in 40
            layer_types=lambda n: ["attention" if i % 10 == 5 else "mamba" for i in range(n)],
        ),
        10,
    ),
    "qwen3_next_80b": (
        "Qwen3NextConfig",
        dict(
            vocab_size=151_936, hidden_size=2048, intermediate_size=5120,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
            decoder_sparse_step=1, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512,
            norm_topk_prob=True, rope_theta=10_000_000.0, max_position_embeddings=262_144,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151_643,
            eos_token_id=151_645, architectures=["Qwen3NextForCausalLM"],
            layer_types=lambda n: ["full_attention" if i % 4 == 3 else "linear_attention"
                                   for i in range(n)],
        ),
        8,
    ),
    "llama3_8b": (
        "LlamaConfig",
        dict(
            vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            max_position_embeddings=131_072, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=128_000, eos_token_id=128_001, architectures=["LlamaForCausalLM"],
        ),
        8,
    ),
    "llama4_scout": (
        "Llama4TextConfig",
        dict(
            vocab_size=202_048, hidden_size=5120, intermediate_size=8192,
            intermediate_size_mlp=16_384, num_local_experts=16, num_experts_per_tok=1,
            interleave_moe_layer_step=1, num_attention_heads=40, num_key_value_heads=8,
            head_dim=128, attention_chunk_size=8192, use_qk_norm=True,
            attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 16.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192},
            # the released 10M positions would give 5 GB cos/sin tables a layer type
            max_position_embeddings=131_072, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=200_000, eos_token_id=200_008, architectures=["Llama4ForCausalLM"],
        ),
        4,
    ),
}  # fmt: skip


def build_model_dir(shape: str, layers: int, path: Path) -> int:
    """Random bf16 weights (seeded) saved to `path`; returns the vocabulary size."""
    import transformers

    cls_name, fields, _ = SHAPES[shape]
    fields = {k: v(layers) if callable(v) else v for k, v in fields.items()}  # per layer count
    cfg = getattr(transformers, cls_name)(num_hidden_layers=layers, **fields)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return cfg.vocab_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's reduced count")
    ap.add_argument("--workloads", default="decode_heavy,small_batch")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--peer", choices=["vllm"], default=None)
    ap.add_argument(
        "--quantize",
        choices=["gptq4", "fp8"],
        default=None,
        help="gptq4: rewrite the random checkpoint as 4-bit GPTQ (gptq_checkpoint.py); fp8: "
        "serve it with --quantization fp8 (its projections quantized at load)",
    )
    ap.add_argument(
        "--quantized-weights", default="auto", choices=["auto", "packed", "dequantized"]
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    from pdserve.runner.engine import Engine

    layers = args.layers or SHAPES[args.shape][2]
    model_dir = Path(tempfile.mkdtemp(prefix=f"{args.shape}-random-"))
    vocab = build_model_dir(args.shape, layers, model_dir)
    if args.quantize == "gptq4":
        from gptq_checkpoint import to_gptq

        to_gptq(model_dir)
    start = time.perf_counter()
    engine = Engine.from_args(
        model=str(model_dir), dtype="bfloat16", max_model_len=4096,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, gpu_memory_utilization=0.8,
        quantized_weights=args.quantized_weights,
        quantization="fp8" if args.quantize == "fp8" else None,
    )  # fmt: skip
    startup = time.perf_counter() - start
    rows = []
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        warm = Workload(w.name, w.num_requests, w.prompt_len, 4, w.metric)
        run_engine(engine, warm, make_prompts(w, vocab, seed=99))  # compile outside the run
        row = {"shape": args.shape, "layers": layers, "workload": name, "quantize": args.quantize,
               **run_engine(engine, w, make_prompts(w, vocab))}  # fmt: skip
        row.update(
            runner=engine.runner_name, execution_path=engine.execution_path,
            startup_s=startup, device=device_kind(), commit=git_commit(),
            command=" ".join(["benchmarks/model_throughput.py", *sys.argv[1:]]),
        )  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.peer == "vllm":
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        peer = run_vllm_peer(model_dir, args, vocab)
        for row in rows:
            row.update(peer.get(row["workload"], {"vllm_output_tok_s": None}))
    eager = "_eager" if args.enforce_eager else ""
    quant = f"_{args.quantize}_{args.quantized_weights}" if args.quantize else ""
    stem = f"model_throughput_{args.shape}{quant}{eager}_{device_kind()}_{git_commit()}"
    out = Path(args.out) / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
