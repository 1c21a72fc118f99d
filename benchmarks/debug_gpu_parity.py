"""Debug aid (not a test): first greedy divergence between the engine and transformers on
CUDA for the tiny test models, with transformers' top-2 logit gap at that position."""

from __future__ import annotations

import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, "tests")


def build(name):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

    cfgs = {
        "qwen3": Qwen3Config(
            vocab_size=997,
            hidden_size=96,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=36,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            initializer_range=0.1,
            bos_token_id=1,
            eos_token_id=2,
            architectures=["Qwen3ForCausalLM"],
        ),
        "mistral": MistralConfig(
            vocab_size=1001,
            hidden_size=72,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            max_position_embeddings=512,
            sliding_window=None,
            initializer_range=0.1,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            bos_token_id=1,
            eos_token_id=2,
            architectures=["MistralForCausalLM"],
        ),
        "qwen2": Qwen2Config(
            vocab_size=1009,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            initializer_range=0.1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 256,
            },
            bos_token_id=1,
            eos_token_id=2,
            architectures=["Qwen2ForCausalLM"],
        ),
    }
    torch.manual_seed(1234)
    m = AutoModelForCausalLM.from_config(cfgs[name], dtype=torch.float32)
    d = tempfile.mkdtemp()
    m.save_pretrained(d)
    return d, m


def main():
    from pdserve import LLM, SamplingParams

    for name in sys.argv[1:]:
        d, hf = build(name)
        hf = hf.cuda().eval()
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 990) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100)]
        try:
            llm = LLM(
                model=d,
                device="cuda",
                dtype="float32",
                block_size=16,
                max_num_batched_tokens=64,
                enforce_eager=bool(os.environ.get("EAGER")),
                async_scheduling=not os.environ.get("SYNC"),
            )
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(temperature=0, max_tokens=24, min_tokens=24),
                use_tqdm=False,
            )
        except Exception as exc:  # noqa: BLE001 - debug output
            print(name, "FAILED", repr(exc)[:400], flush=True)
            raise
        for p, o in zip(prompts, outs):
            ids = p + o.outputs[0].token_ids
            with torch.inference_mode():
                logits = hf(torch.tensor([ids], device="cuda")).logits[0].float()
            for i, tok in enumerate(o.outputs[0].token_ids):
                row = logits[len(p) - 1 + i]
                top = torch.topk(row, 2)
                if top.indices[0].item() != tok:
                    print(
                        name,
                        len(p),
                        "diverges at",
                        i,
                        "ours",
                        tok,
                        "hf",
                        top.indices.tolist(),
                        "gap",
                        (top.values[0] - top.values[1]).item(),
                        "ours-logit",
                        row[tok].item(),
                        "top",
                        top.values[0].item(),
                        flush=True,
                    )
                    break
            else:
                print(name, len(p), "ok (teacher-forced)", flush=True)


if __name__ == "__main__":
    main()
