"""Where a tiny Bamba's GPU logits part from transformers' (a one-off probe; prints JSON):
the config as this transformers reads it, its rotary width and ours, and the max |logit|
difference of transformers on CPU vs CUDA and of our engine (CUDA, float32) vs
transformers on CPU, for one 37-token prompt, also with full-head RoPE forced."""

from __future__ import annotations

import json
import sys
import tempfile

import torch


def main() -> None:
    import transformers
    from transformers import AutoModelForCausalLM, BambaConfig

    from pdserve import LLM, SamplingParams
    from pdserve.runner.models.llama import rotary_dim_of

    cfg = BambaConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["BambaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(37)]
    ids = torch.tensor([prompt])
    out = {"transformers": transformers.__version__,
           "rope_parameters": str(getattr(cfg, "rope_parameters", None)),
           "partial_rotary_factor": getattr(cfg, "partial_rotary_factor", None),
           "ours_rotary_dim": rotary_dim_of(cfg)}  # fmt: skip
    rot = getattr(model.model, "rotary_emb", None)
    out["hf_rotary_dim"] = None if rot is None else int(rot.inv_freq.numel() * 2)
    devices = sys.argv[1:] or ["cpu", "cuda"]
    with torch.inference_mode():
        cpu = model(ids).logits[0].float()
        if "cuda" in devices:
            gpu = model.cuda()(ids.cuda()).logits[0].float().cpu()
            out["hf_cpu_vs_cuda"] = float((cpu - gpu).abs().max())
    for device in devices:
        llm = LLM(model=path, device=device, dtype="float32", max_num_batched_tokens=16)
        p = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        got = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0]
        lp = [next(iter(d.values())).logprob for d in got.prompt_logprobs[1:]]
        want = cpu.log_softmax(-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        diff = (torch.tensor(lp) - want).abs()
        out[f"ours_{device}_prompt_logprob_max_diff"] = float(diff.max())
        out[f"ours_{device}_first_bad_position"] = (
            int((diff > 1e-3).nonzero()[0]) + 1 if (diff > 1e-3).any() else None
        )
        del llm
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
