"""vLLM's `--trust-remote-code` (`LLM(trust_remote_code=True)`): a checkpoint whose config
class is its own Python (`auto_map`) is refused without it, naming the flag, and runs with
it. The checkpoint here is the tiny Llama with its config declared as a class of its own
(`configuration_custom.py`, model type `custom_llama`): with the flag it must generate what
the plain checkpoint generates (mrv2 runs this package's Llama either way)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import DEVICE

from pdserve import LLM, SamplingParams

CUSTOM_CONFIG = """from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    model_type = "custom_llama"
"""


@pytest.fixture(scope="module")
def custom_code_dir(tiny_llama_dir, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("custom-code") / "model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "custom_llama"
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_config_class_of_its_own_needs_the_flag(custom_code_dir):
    with pytest.raises(ValueError, match="--trust-remote-code"):
        LLM(model=custom_code_dir, device=DEVICE, dtype="float32")


def test_with_the_flag_it_runs_as_the_plain_checkpoint(custom_code_dir, tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    prompt = {"prompt_token_ids": [5, 17, 101, 9, 250, 33, 7]}
    custom = LLM(model=custom_code_dir, device=DEVICE, dtype="float32", trust_remote_code=True)
    assert custom.engine.config.model.hf_config.model_type == "custom_llama"
    assert custom.runner_name == "mrv2"
    plain = LLM(model=tiny_llama_dir, device=DEVICE, dtype="float32")
    got = custom.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
