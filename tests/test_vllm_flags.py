"""vLLM's serving behaviour where pdserve shares its meaning: `vllm serve` flags that
parse into the same settings, server-wide sampling defaults from a generation config,
chat requests without max_tokens, text content parts, served model names and the
router's seeded seeds. The whole path runs in test_serve_vllm_compat.py."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from cli_in_process import cli_main

from pdserve.cluster.chat_messages import chat_messages
from pdserve.cluster.openai_api import (
    ApiError,
    requested_max_tokens,
    resolve_max_tokens,
)
from pdserve.cluster.prompts import prompt_token_ids
from pdserve.cluster.route_policy import RouterConfig
from pdserve.cluster.router import Router
from pdserve.cluster.sampling_api import check_logprobs, parse_sampling
from pdserve.cluster.serve_args import (
    ServeConfig,
    auto_tool_parser,
    grammar_in_reasoning,
    served_names,
)
from pdserve.cluster.serve_flags import add_serve_args, config_from_args
from pdserve.cluster.vllm_flags import FLAGS, INT
from pdserve.runner.generation_defaults import from_file, parse_override, sampling_defaults


def _args(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return config_from_args(p.parse_args(list(argv)))


def _gen_dir(tmp_path, **values):
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return tmp_path


# ---- flags -------------------------------------------------------------------------------


def test_a_vllm_command_line_parses(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = _args(
        "Qwen/Qwen3-0.6B", "--served-model-name", "qwen", "qwen3", "--seed", "7",
        "--no-enable-prefix-caching", "--enforce-eager", "-tp", "1", "--pipeline-parallel-size",
        "1", "--kv-cache-dtype", "auto", "--generation-config", "vllm",
        "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 99}',
        "--max-model-len", "2048", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "32",
        "--scheduling-policy", "priority", "--no-enable-chunked-prefill", "--no-async-scheduling",
        "-q", "fp8", "--trust-remote-code", "--revision", "v1.0", "--download-dir", "/data/hf",
        "--tokenizer", "org/tok", "--load-format", "dummy",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
        "--cuda-graph-sizes", "1", "8", "32", "--limit-mm-per-prompt", '{"image": 0, "video": 0}',
        "--structured-outputs-config", '{"enable_in_reasoning": true}', "--max-logprobs", "5",
        "--disable-fastapi-docs", "--disable-log-requests", "--tokenizer-mode", "auto",
        "--max-log-len", "100", "--response-role", "bot", "--return-tokens-as-token-ids",
        "--enable-force-include-usage", "--enable-prompt-tokens-details", "--root-path", "/api/",
    )  # fmt: skip
    assert cfg.model == "Qwen/Qwen3-0.6B"
    assert cfg.root_path == "/api"  # as the ASGI scope holds it
    assert (cfg.response_role, cfg.return_tokens_as_token_ids) == ("bot", True)
    assert cfg.enable_force_include_usage and cfg.enable_prompt_tokens_details
    assert (cfg.max_logprobs, cfg.disable_fastapi_docs, cfg.enable_log_requests) == (5, True, False)
    assert served_names(cfg) == ("qwen", "qwen3")
    assert (cfg.seed, cfg.enable_prefix_caching, cfg.enforce_eager) == (7, False, True)
    assert cfg.generation_config == "vllm"
    assert cfg.override_generation_config == {"temperature": 0.5, "max_new_tokens": 99}
    assert (cfg.max_model_len, cfg.gpu_memory_utilization, cfg.max_num_seqs) == (2048, 0.8, 32)
    assert cfg.scheduling_policy == "priority"
    assert (cfg.enable_chunked_prefill, cfg.async_scheduling) == (False, False)
    assert cfg.quantization == "fp8"  # checked against the checkpoint at start
    assert (cfg.trust_remote_code, cfg.revision, cfg.download_dir) == (True, "v1.0", "/data/hf")
    assert cfg.tokenizer == "org/tok" and cfg.load_format == "dummy"
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert cfg.cuda_graph_sizes == [1, 8, 32]
    assert cfg.limit_mm_per_prompt == {"image": 0, "video": 0}
    assert grammar_in_reasoning(cfg) and not grammar_in_reasoning(_args())


def test_defaults_and_names_as_vllm_picks_them():
    cfg = _args()
    assert (cfg.max_logprobs, cfg.disable_fastapi_docs, cfg.enable_log_requests) == (
        20,
        False,
        False,
    )
    assert (cfg.enable_prefix_caching, cfg.enforce_eager, cfg.seed) == (True, False, None)
    assert (cfg.enable_chunked_prefill, cfg.async_scheduling) == (True, None)  # None: GPU only
    assert cfg.scheduling_policy == "fcfs"
    # serve_args keeps its own copy of the engine's policy names (it imports no torch).
    from pdserve.cluster import serve_args
    from pdserve.runner import config

    assert serve_args.SCHEDULING_POLICIES == config.SCHEDULING_POLICIES
    assert serve_args.MAMBA_DTYPES == config.MAMBA_DTYPES
    assert tuple(config.KV_CACHE_DTYPES) == serve_args.KV_CACHE_DTYPES
    assert config.QUANTIZED_WEIGHTS == serve_args.QUANTIZED_WEIGHTS
    assert config.LOAD_FORMATS == serve_args.LOAD_FORMATS
    assert cfg.quantized_weights == "auto"
    assert _args("--quantized-weights", "packed").quantized_weights == "packed"
    with pytest.raises(ValueError, match="--quantized-weights must be one of auto, packed"):
        ServeConfig(quantized_weights="int4")  # a config file's
    assert cfg.kv_cache_dtype == "auto"
    assert _args("--kv-cache-dtype", "fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8"):
        ServeConfig(kv_cache_dtype="int8")  # a config file's
    assert (cfg.mamba_cache_dtype, cfg.mamba_ssm_cache_dtype) == ("auto", "float32")
    hybrid = _args("--mamba-cache-dtype", "float32", "--mamba-ssm-cache-dtype", "auto")
    assert (hybrid.mamba_cache_dtype, hybrid.mamba_ssm_cache_dtype) == ("float32", "auto")
    assert cfg.generation_config == "auto"
    assert served_names(cfg) == ("SmolLM2-135M-Instruct",)
    # The model as given, not its last path part: what a vLLM client already sends.
    assert served_names(_args("--model", "/models/qwen3")) == ("/models/qwen3",)
    assert served_names(ServeConfig(served_model_name="one")) == ("one",)  # a config file's
    assert _args("m", "--model", "m").model == "m"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a", "--model", "b"], "given twice"),
        (["-tp", "2"], "--tensor-parallel-size 2: a pdserve worker runs on one GPU"),
        (["--cuda-graph-sizes", "0", "8"], "cuda_graph_sizes must be positive"),
        (["--limit-mm-per-prompt", '{"image": 2}'], "serves text only"),
        (["--limit-mm-per-prompt", "image=0"], "not valid JSON"),
        (["--pipeline-parallel-size", "4"], "--decode-workers"),
        (["--response-role", ""], "--response-role must be a non-empty name"),
        (["--root-path", "api"], "--root-path must be an absolute URL path"),
        (["--root-path", "/a b"], "--root-path must be an absolute URL path"),
        (["--root-path", "/a?b=1"], "--root-path must be an absolute URL path"),
        (["--max-logprobs", "21"], r"--max-logprobs must be in \[0, 20\]"),
        (["--max-logprobs", "-1"], "-1, the whole vocabulary, is not available"),
        (["--override-generation-config", "{temperature: 1}"], "not valid JSON"),
        (["--override-generation-config", "[1]"], "must be a JSON object"),
        (["--speculative-config", "ngram"], "--speculative-config is not valid JSON"),
        (["--structured-outputs-config", '{"backend": "xgrammar"}'], "'backend'.*not supported"),
        (["--structured-outputs-config", '{"enable_in_reasoning": 1}'], "is a boolean"),
        (
            ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
            "method must be one of ngram",
        ),
    ],
)
def test_bad_flags_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _args(*argv)


def test_sizes_take_vllms_suffixes(monkeypatch):
    """Lower case is decimal and may take a fraction; upper case is binary and may not."""
    from pdserve.sizes import parse_size

    assert [parse_size(t) for t in ("4096", "32k", "32K", "25.6k", "2.3k", "1.5m", " 4G ")] == [
        4096, 32000, 32768, 25600, 2300, 1500000, 4 << 30,
    ]  # fmt: skip
    for bad, message in (("1.5K", "whole number; 1.5k is the decimal"),
                         ("1.0005k", "not a whole number"), ("4 GB", "not an integer or a size"),
                         ("1e3", "not an integer or a size"), (True, "an integer or a size")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_size(bad)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = _args("--max-model-len", "2k", "--max-num-batched-tokens", "8K",
                "--kv-cache-memory-bytes", "96M", "--num-gpu-blocks-override", "300")  # fmt: skip
    assert (cfg.max_model_len, cfg.max_num_batched_tokens) == (2000, 8192)
    assert (cfg.kv_cache_memory_bytes, cfg.num_gpu_blocks_override) == (96 << 20, 300)
    p = argparse.ArgumentParser()
    add_serve_args(p)
    with pytest.raises(SystemExit):  # argparse's usage error, naming the flag
        p.parse_args(["--kv-cache-memory-bytes", "1.5G"])


def test_a_config_file_takes_sizes_and_refuses_wrong_types(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    path = tmp_path / "serve.yaml"
    path.write_text("max-model-len: 32K\nkv_cache_memory_bytes: 1G\nlease_s: 30\nmodel: null\n")
    cfg = _args("--config", str(path))
    assert (cfg.max_model_len, cfg.kv_cache_memory_bytes, cfg.lease_s) == (32768, 1 << 30, 30)
    for text in ('override_generation_config: \'{"temperature": 0.5}\'',  # the flag's JSON
                 "override_generation_config: {temperature: 0.5}"):  # fmt: skip
        path.write_text(text + "\n")
        assert _args("--config", str(path)).override_generation_config == {"temperature": 0.5}
    path.write_text("cuda_graph_sizes: [1, 4, 16]\n")
    assert _args("--config", str(path)).cuda_graph_sizes == [1, 4, 16]
    # the Helm chart's serve values land here: a mapping, as the flag's JSON would give
    path.write_text("speculative_config: {method: ngram, num_speculative_tokens: 2}\n")
    spec = _args("--config", str(path)).speculative_config
    assert spec == {"method": "ngram", "num_speculative_tokens": 2}
    for text, message in (
        ('port: "8080"', "port must be an integer, got '8080'"),
        ("max_num_seqs: 1.5", "max_num_seqs must be an integer"),
        ("autoscale: 1", "autoscale must be true or false, got 1"),
        ("lease_s: true", "lease_s must be a number, got True"),
        ("kv_cache_memory_bytes: [1]", "must be an integer or a size like 32k or null"),
        ("max_model_len: lots", "--max-model-len: 'lots' is not an integer or a size"),
        ("api_key: 123", "api_key must be a string or null"),
        ("autoscale_policy: [1]", "autoscale_policy must be a mapping or null"),
        ("host: null", "host must be a string, got None"),
        ("cuda_graph_sizes: 8", "cuda_graph_sizes must be a list of integers or null"),
        ("cuda_graph_sizes: [8, x]", "cuda_graph_sizes must be positive integers"),
    ):
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=re.escape(message)):
            _args("--config", str(path))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_cache_memory_bytes=0), "--kv-cache-memory-bytes must be >= 1, got 0"),
        (dict(max_model_len=-2), "--max-model-len must be >= 1, got -2"),
        (dict(max_num_batched_tokens=0), "--max-num-batched-tokens must be >= 1"),
        (dict(num_gpu_blocks_override=1), "block 0 is the reserved null block"),
    ],
)
def test_bad_sizes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**kwargs)


def test_empty_served_names_are_refused():
    with pytest.raises(ValueError, match="non-empty names"):
        ServeConfig(served_model_name=["ok", ""])


def test_auto_tool_choice_takes_vllms_two_flags(tmp_path, monkeypatch):
    """Guards the flags of tool_choice auto: with both, the router reads calls with the
    parser; a parser alone parses (vLLM allows it) but does not answer auto; the enable
    flag alone, or a parser pdserve lacks, stops `pdserve serve` at start naming the rule."""
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = _args("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert (cfg.enable_auto_tool_choice, cfg.tool_call_parser) == (True, "hermes")
    assert auto_tool_parser(cfg) == "hermes"
    assert auto_tool_parser(_args("--tool-call-parser", "llama3_json")) is None
    assert auto_tool_parser(_args()) is None
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        _args("--enable-auto-tool-choice")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    with pytest.raises(SystemExit):  # argparse's choices
        p.parse_args(["--tool-call-parser", "jamba"])
    path = tmp_path / "serve.yaml"
    path.write_text("enable-auto-tool-choice: true\ntool-call-parser: llama3_json\n")
    assert auto_tool_parser(_args("--config", str(path))) == "llama3_json"
    path.write_text("enable_auto_tool_choice: true\ntool_call_parser: jamba\n")
    with pytest.raises(
        ValueError,
        match=(
            "must be one of deepseek_v3, deepseek_v31, glm45, granite, hermes, llama3_json, "
            "mistral, openai, pythonic, qwen3_coder, seed_oss, got 'jamba'"
        ),
    ):
        _args("--config", str(path))
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--enable-auto-tool-choice"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert (
        "--enable-auto-tool-choice needs --tool-call-parser (deepseek_v3 or deepseek_v31 or glm45 or "
        "granite or hermes or llama3_json or mistral or openai or pythonic or qwen3_coder or seed_oss)"
        in (res.stderr)
    )


def test_reasoning_parser_takes_vllms_names(tmp_path, monkeypatch):
    """Guards `--reasoning-parser`: off by default, qwen3 and deepseek_r1 taken from the flag
    or the config file; a name pdserve lacks stops `pdserve serve` at start naming the
    choices, from the flag (argparse's choices) or the file (the config's own check)."""
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert _args().reasoning_parser is None
    assert _args("--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    path = tmp_path / "serve.yaml"
    path.write_text("reasoning-parser: deepseek_r1\n")
    assert _args("--config", str(path)).reasoning_parser == "deepseek_r1"
    assert _args("--config", str(path), "--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    path.write_text("reasoning_parser: bogus\n")
    with pytest.raises(
        ValueError, match="must be one of qwen3, deepseek_r1, openai_gptoss, seed_oss, got 'bogus'"
    ):
        _args("--config", str(path))
    for argv, named in (
        (["--reasoning-parser", "bogus"],
         r"argument --reasoning-parser: invalid choice: 'bogus' \(choose from '?qwen3'?, "
         r"'?deepseek_r1'?, '?openai_gptoss'?, '?seed_oss'?\)"),
        (["--config", str(path)],
         r"--reasoning-parser must be one of qwen3, deepseek_r1, openai_gptoss, seed_oss, got 'bogus'"),
    ):  # fmt: skip
        code, err = cli_main("serve", *argv)
        assert code == 2, err
        assert re.search(named, err), err


# ---- generation config -------------------------------------------------------------------


def test_a_generation_config_gives_the_defaults_vllm_takes(tmp_path):
    folder = _gen_dir(
        tmp_path, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=64, do_sample=True,
        min_p=None, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert from_file(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                 "max_new_tokens": 64}  # fmt: skip
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert sampling_defaults("auto", folder, {}) == want
    assert sampling_defaults("vllm", folder, {}) == {}
    assert sampling_defaults(str(folder), tmp_path / "elsewhere", {}) == want
    over = sampling_defaults("auto", folder, {"temperature": 0.0, "max_new_tokens": 8})
    assert over == dict(want, temperature=0.0, max_tokens=8)
    assert sampling_defaults("vllm", folder, {"top_k": 5}) == {"top_k": 5}


def test_every_value_the_file_sets_is_a_default(tmp_path):
    # transformers 5 leaves GenerationConfig's fields unset, so vLLM keeps top_k 50 too.
    assert from_file(_gen_dir(tmp_path, top_k=50, temperature=1.0)) == {
        "top_k": 50, "temperature": 1.0,
    }  # fmt: skip
    assert from_file(tmp_path / "no-such-dir") == {}
    (tmp_path / "generation_config.json").write_text("{temperature")
    with pytest.raises(ValueError, match="cannot be read"):
        from_file(tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_p": "high"}, "top_p must be a number"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": 3.5}, "max_new_tokens must be an integer >= 1"),
        ({"temperature": True}, "temperature must be a number"),
        ({"stop": ["x"]}, "not sampling defaults"),
        ({"max_tokens": 9}, "not sampling defaults"),
        ({"presence_penalty": 0.5}, "not sampling defaults"),
    ],
)
def test_bad_defaults_are_refused(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        sampling_defaults("vllm", tmp_path, override)


def test_a_missing_generation_config_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not auto, vllm or a folder"):
        sampling_defaults(str(tmp_path / "nope"), tmp_path, {})
    assert parse_override(None) == {}


# ---- request parsing ---------------------------------------------------------------------


def test_output_length_follows_vllm():
    assert requested_max_tokens({}, "chat") is None
    assert requested_max_tokens({"max_tokens": 7}, "chat") == 7
    assert requested_max_tokens({"max_completion_tokens": 5, "max_tokens": 7}, "chat") == 5
    assert requested_max_tokens({}, "completion") == 16
    assert requested_max_tokens({"max_tokens": None}, "completion") is None
    assert resolve_max_tokens(None, 100, 256) == 156  # the rest of the context
    assert resolve_max_tokens(None, 100, 256, cap=40) == 40
    assert resolve_max_tokens(200, 10, 256, cap=40) == 40  # the cap holds for explicit ones
    assert resolve_max_tokens(156, 100, 256) == 156
    for requested, prompt in ((157, 100), (None, 256), (1, 300)):
        with pytest.raises(ApiError, match="maximum context length is 256") as e:
            resolve_max_tokens(requested, prompt, 256)
        assert e.value.code == "context_length_exceeded"
    with pytest.raises(ApiError, match="at least 1"):
        requested_max_tokens({"max_tokens": 0}, "chat")
    # 0 is the echoed prompt alone: a completion's, with echo, only
    assert requested_max_tokens({"max_tokens": 0, "echo": True}, "completion") == 0
    for body, kind in (({"max_tokens": 0}, "completion"),
                       ({"max_tokens": 0, "echo": False}, "completion"),
                       ({"max_tokens": -1, "echo": True}, "completion"),
                       ({"max_tokens": 0, "echo": True}, "chat")):  # fmt: skip
        with pytest.raises(ApiError, match="at least 1"):
            requested_max_tokens(body, kind)
    # a prompt that fills the context names the field it came in
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(None, 256, 256, prompt_field="prompt")
    assert e.value.param == "prompt"
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(None, 256, 256)
    assert e.value.param == "messages"
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(2, 255, 256, prompt_field="prompt")
    assert e.value.param == "max_tokens"


def test_left_out_fields_take_the_server_defaults():
    defaults = {"temperature": 0.0, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1}
    params, _ = parse_sampling({}, "chat", 1, 8, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 20, 0.9)
    assert (params.repetition_penalty, params.min_p, params.max_tokens) == (1.1, 0.0, 8)
    params, _ = parse_sampling({"temperature": 0.7, "top_k": None}, "chat", 1, 8, defaults)
    assert (params.temperature, params.top_k) == (0.7, 20)  # null is left out, as in vLLM
    params, _ = parse_sampling({}, "completion", None, 16)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 1.0)
    assert (params.skip_special_tokens, params.include_stop_str_in_output) == (True, False)
    body = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    params, _ = parse_sampling(body, "chat", None, 4)
    assert (params.skip_special_tokens, params.include_stop_str_in_output) == (False, True)
    with pytest.raises(ApiError, match="'skip_special_tokens' must be a boolean"):
        parse_sampling({"skip_special_tokens": "no"}, "chat", None, 4)


def test_chat_content_may_be_text_parts():
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                       "text": "b"}]},
        ]
    }  # fmt: skip
    out = chat_messages(body)
    assert [m["content"] for m in out] == ["Be brief.", "a\nb"]
    assert body["messages"][1]["content"][0] == {"type": "text", "text": "a"}  # not changed
    bad = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "'image_url' are not supported"),
        ([{"role": "user", "content": [{"type": "text"}]}], "a content part must be"),
        ([{"role": "user", "content": ["hi"]}], "a content part must be"),
        ([{"role": "user", "content": None}], "string 'role' and 'content'"),
        ([], "non-empty array"),
    ]  # fmt: skip
    for messages, message in bad:
        with pytest.raises(ApiError, match=message):
            chat_messages({"messages": messages})


@pytest.fixture(scope="module")
def bos_tokenizer(smollm_dir):
    """The bundled tokenizer made to add a BOS (as Llama's and Mistral's do; SmolLM2's
    adds nothing), so the special-token rules show."""
    from tokenizers.processors import TemplateProcessing

    from pdserve.runner.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm_dir)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    return tok


def test_special_tokens_follow_vllm(bos_tokenizer):
    tok = bos_tokenizer
    plain = tok("Hello world", add_special_tokens=False).input_ids
    # Completions: a string gets the BOS (vLLM's and the offline LLM's default).
    assert prompt_token_ids({"prompt": "Hello world"}, "completion", tok) == [1, *plain]
    body = {"prompt": "Hello world", "add_special_tokens": False}
    assert prompt_token_ids(body, "completion", tok) == plain
    assert prompt_token_ids({"prompt": [5, 6]}, "completion", tok) == [5, 6]  # ids as given
    # Chat: the template places the special tokens; nothing is added unless asked.
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    chat = prompt_token_ids({"messages": msgs}, "chat", tok)
    assert chat == tok(text, add_special_tokens=False).input_ids
    assert prompt_token_ids({"messages": msgs, "add_special_tokens": True}, "chat", tok) == [
        1, *chat,
    ]  # fmt: skip
    bare = prompt_token_ids({"messages": msgs, "add_generation_prompt": False}, "chat", tok)
    assert len(bare) < len(chat) and chat[: len(bare)] == bare
    for body, message in (
        ({"prompt": "", "add_special_tokens": False}, "empty"),
        ({"prompt": [1, "2"]}, "string or an array of token ids"),
        ({"prompt": "x", "add_special_tokens": "yes"}, "must be a boolean"),
    ):
        with pytest.raises(ApiError, match=message):
            prompt_token_ids(body, "completion", tok)


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("suffix", "end"),
        ("best_of", 3),
        ("prompt_embeds", "AAAA"),
        ("chat_template", "{{ messages }}"),
        ("guided_whitespace_pattern", " ?"),
        ("logits_processors", ["my_module.MyProcessor"]),
        ("vllm_xargs", {"target_token": 5}),
        ("repetition_detection", {"max_pattern_size": 4}),
    ],
)
def test_fields_that_would_be_silently_ignored_are_refused(field, value):
    from pdserve.cluster.unsupported import refuse_unsupported

    with pytest.raises(ApiError, match=f"'{field}'") as e:
        refuse_unsupported({field: value})
    assert e.value.status == 400 and e.value.code == "unsupported"
    if field == "functions":  # one reason, then what to do
        assert e.value.message == ("'functions': the deprecated function calling is not "
                                   "carried out here; send tools instead; leave it out")  # fmt: skip
    neutral = {"logits_processors": [], "vllm_xargs": {}, "repetition_detection": None}
    if field in neutral:  # what a client sending every default sends: accepted
        refuse_unsupported({field: neutral[field]})


def test_logit_bias_and_allowed_token_ids_parse_as_openai_and_vllm_send_them():
    """Guards the two fields' request shapes: OpenAI's `logit_bias` object with token ids
    as string keys, vLLM's `allowed_token_ids` array; each malformed form is a 400 naming
    the field, and ids past the model's vocabulary are refused before any worker sees
    them (`check_token_ids`)."""
    from pdserve.cluster.sampling_api import check_token_ids

    body = {"logit_bias": {"5": 2.5, "17": -100}, "allowed_token_ids": [5, 9]}
    params, _ = parse_sampling(body, "chat", None, 4)
    assert params.logit_bias == {5: 2.5, 17: -100.0} and params.allowed_token_ids == [5, 9]
    check_token_ids(params, 18)
    for bad, param in (
        ({"logit_bias": {"5": 2.5, "18": 1}}, "logit_bias"),
        ({"allowed_token_ids": [5, 18]}, "allowed_token_ids"),
    ):
        with pytest.raises(ApiError, match=r"in \[0, 18\)") as e:
            check_token_ids(parse_sampling(bad, "completion", None, 4)[0], 18)
        assert e.value.param == param and e.value.status == 400
    with pytest.raises(ApiError) as e:  # a SamplingParams rule names its field too
        parse_sampling({"logit_bias": {"1": 101}}, "chat", None, 4)
    assert e.value.param == "logit_bias"
    for bad, message in (
        ({"logit_bias": {"x1": 1}}, "keys must be token ids"),
        ({"logit_bias": {"-1": 1}}, "keys must be token ids"),
        ({"logit_bias": {"1": 101}}, r"numbers in \[-100, 100\]"),
        ({"logit_bias": {"1": "2"}}, r"numbers in \[-100, 100\]"),
        ({"logit_bias": [1, 2]}, "must be an object"),
        ({"allowed_token_ids": []}, "non-empty list"),
        ({"allowed_token_ids": [1, "2"]}, "non-empty list"),
        ({"allowed_token_ids": 3}, "must be an array"),
    ):
        with pytest.raises(ApiError, match=message):
            parse_sampling(bad, "chat", None, 4)


def test_truncate_prompt_tokens_takes_vllms_values():
    """Guards `truncate_prompt_tokens`: absent is no truncation, -1 is the whole context,
    k keeps k tokens, and 0, past the context, or not an integer is a 400 naming it."""
    from pdserve.cluster.openai_api import prompt_truncation

    assert prompt_truncation({}, 64) is None
    assert prompt_truncation({"truncate_prompt_tokens": None}, 64) is None
    assert prompt_truncation({"truncate_prompt_tokens": -1}, 64) == 64
    assert prompt_truncation({"truncate_prompt_tokens": 5}, 64) == 5
    for bad in (0, -2, 65, "5", 2.0, True):
        with pytest.raises(ApiError) as e:
            prompt_truncation({"truncate_prompt_tokens": bad}, 64)
        assert e.value.param == "truncate_prompt_tokens"


def test_priority_needs_a_server_that_schedules_by_it():
    """Guards vLLM's rule at the router: `priority` travels in the params, and a value
    other than 0 is a 400 naming --scheduling-policy unless the server schedules by it;
    a non-integer is a 400 whatever the policy."""
    from pdserve.cluster.sampling_api import check_priority

    params, _ = parse_sampling({"priority": -2}, "completion", None, 4)
    assert params.priority == -2
    check_priority(params, "priority")
    with pytest.raises(ApiError, match="--scheduling-policy priority") as e:
        check_priority(params, "fcfs")
    assert e.value.param == "priority" and e.value.status == 400
    check_priority(parse_sampling({"priority": 0}, "chat", None, 4)[0], "fcfs")
    with pytest.raises(ApiError, match="'priority' must be an integer"):
        parse_sampling({"priority": 1.5}, "chat", None, 4)


def test_cache_salt_is_read_and_a_bad_one_is_a_400():
    """Guards vLLM's `cache_salt`: it reaches SamplingParams from both APIs (it was
    dropped, so tenants shared the prefix cache without a word); an empty string (vLLM
    refuses it too), a non-string and a lone surrogate are 400s naming the field."""
    for kind in ("chat", "completion"):
        assert parse_sampling({"cache_salt": "t-1"}, kind, None, 4)[0].cache_salt == "t-1"
        assert parse_sampling({"cache_salt": None}, kind, None, 4)[0].cache_salt is None
        assert parse_sampling({}, kind, None, 4)[0].cache_salt is None
    for bad in ("", 5, True, ["t"], "\ud800"):
        with pytest.raises(ApiError, match="cache_salt") as e:
            parse_sampling({"cache_salt": bad}, "chat", None, 4)
        assert e.value.param == "cache_salt" and e.value.status == 400, bad


def test_neutral_values_of_those_fields_pass():
    from pdserve.cluster.unsupported import refuse_unsupported

    neutral = {
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
        "logit_bias": {}, "use_beam_search": False, "suffix": "", "echo": False,
        "best_of": 2, "n": 2, "guided_json": None, "user": "u", "service_tier": "auto",
        "priority": 0, "return_tokens_as_token_ids": False, "chat_template": None,
    }  # fmt: skip
    refuse_unsupported(neutral)
    refuse_unsupported({"echo": True})  # carried out: completions' prompt, chat's last turn


# ---- seeds -------------------------------------------------------------------------------


def _seeds(router: Router, n: int) -> list[int]:
    return [(router._seeds or pytest.fail("no generator")).getrandbits(63) for _ in range(n)]


def test_a_seeded_router_repeats_its_seeds():
    a = Router(RouterConfig(mode="colocated", seed=7), [], [])
    b = Router(RouterConfig(mode="colocated", seed=7), [], [])
    c = Router(RouterConfig(mode="colocated", seed=8), [], [])
    first = _seeds(a, 3)
    assert first == _seeds(b, 3) != _seeds(c, 3)
    assert Router(RouterConfig(mode="colocated"), [], [])._seeds is None


# ---- health ------------------------------------------------------------------------------


def test_health_is_503_without_a_ready_decode_worker():
    """vLLM's /health fails when its engine is gone; here, when no decode worker is ready
    (all restarting or drained). /version still answers (the chart's liveness probe)."""
    import asyncio

    import httpx

    from pdserve.cluster.http_app import AppState, build_app
    from pdserve.cluster.metrics import Metrics

    router = Router(RouterConfig(mode="colocated"), [], [])
    app = build_app(AppState(router, None, "m", 64, Metrics("m")))

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get(path, timeout=10)

    r = asyncio.run(get("/health"))
    assert r.status_code == 503 and r.json()["error"]["message"] == "no decode worker is ready"
    assert asyncio.run(get("/version")).status_code == 200


def test_offline_llm_takes_the_generation_config(tmp_path, smollm_dir):
    """vLLM's LLM: `generate` without sampling params uses the generation config."""
    from pdserve.runner.llm import LLM
    from pdserve.runner.sampling_params import SamplingParams

    folder = _gen_dir(tmp_path, temperature=0.0, max_new_tokens=5)
    llm = LLM(
        model=smollm_dir, dtype="float32", device="cpu", max_model_len=256,
        kv_cache_memory_bytes=16 << 20, generation_config=str(folder),
    )  # fmt: skip
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 5)
    implicit = llm.generate("The capital of France is", use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )[0].outputs[0]
    assert implicit.token_ids == explicit.token_ids and len(implicit.token_ids) == 5
    with pytest.raises(ValueError, match="not auto, vllm or a folder"):
        LLM(model=smollm_dir, device="cpu", generation_config=str(tmp_path / "none"))


def test_chat_echo_and_the_reply_role_follow_vllm():
    """Guards chat `echo`'s rules without a server: the last message is echoed (text parts
    joined) only when its role is the reply's, which is the assistant's unless
    `add_generation_prompt` is false; nothing when echo is off, an empty content gives
    nothing, and a non-boolean echo is a 400."""
    from pdserve.cluster.chat_messages import chat_echo, chat_role

    parts = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    began = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": parts}]
    assert chat_role({"messages": began}) == "assistant"
    assert chat_echo({"messages": began, "echo": True}, "assistant") == "A\nB"
    assert chat_echo({"messages": began}, "assistant") is None
    empty = [began[0], {"role": "assistant", "content": ""}]
    assert chat_echo({"messages": empty, "echo": True}, "assistant") is None
    asked = {"messages": began[:1], "echo": True}
    assert chat_echo(asked, chat_role(asked)) is None
    continued = {**asked, "add_generation_prompt": False}
    assert chat_role(continued) == "user" and chat_echo(continued, "user") == "Q"
    with pytest.raises(ApiError, match="'echo' must be a boolean") as e:
        chat_echo({"messages": began, "echo": "yes"}, "assistant")
    assert e.value.param == "echo"


def test_structured_output_fields_parse_as_openai_and_vllm_send_them():
    """Guards the request shapes of structured output: OpenAI's response_format (text,
    json_object, json_schema), vLLM's structured_outputs and guided_* fields; each becomes
    one StructuredOutputs, and a bad pattern, an unsupported schema keyword, a bad grammar
    or two constraints at once are a 400 naming the field before any worker sees them."""
    from pdserve.runner.structured.spec import StructuredOutputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema}}},
            StructuredOutputs(json=schema),
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutputs(regex="[ab]+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutputs(choice=("x", "y"))),
        ({"guided_json": schema}, StructuredOutputs(json=schema)),
        ({"guided_json": json.dumps(schema)}, StructuredOutputs(json=schema)),
        ({"guided_regex": r"\d+"}, StructuredOutputs(regex=r"\d+")),
        ({"guided_choice": ["x"]}, StructuredOutputs(choice=("x",))),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}},
         StructuredOutputs(grammar="root ::= 'a'")),
        ({"guided_grammar": "root ::= [ab]+"}, StructuredOutputs(grammar="root ::= [ab]+")),
    ]  # fmt: skip
    for body, want in cases:
        for kind in ("chat", "completion"):
            params, _ = parse_sampling(body, kind, None, 4)
            assert params.structured_outputs == want, body
    for body, param, fragment in (
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
         "'schema'"),
        ({"guided_regex": "(a"}, "guided_regex", "("),
        ({"guided_json": {"type": "number", "multipleOf": 2}}, "guided_json", "multipleOf"),
        ({"structured_outputs": {"grammar": "root ::= 'a"}}, "structured_outputs",
         "unterminated string literal at line 1, column 10"),
        ({"guided_grammar": "start: a"}, "guided_grammar", "refers to 'a', which is not"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "exactly one"),
        ({"guided_choice": [], }, "guided_choice", "choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "at most one"),
    ):  # fmt: skip
        with pytest.raises(ApiError, match=re.escape(fragment)) as e:
            parse_sampling(body, "chat", None, 4)
        assert e.value.param == param and e.value.status == 400, (body, e.value.param)


def test_harmony_tool_parser_needs_the_harmony_reasoning_parser():
    """`--tool-call-parser openai` reads the calls `--reasoning-parser openai_gptoss` hands
    on; alone it would find none, so the start is refused naming both."""
    with pytest.raises(ValueError, match="give both"):
        _args("--tool-call-parser", "openai")
    cfg = _args("--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss")
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("openai", "openai_gptoss")


@pytest.mark.parametrize("flag", [f for v in FLAGS for f in v.names], ids=lambda f: f.lstrip("-"))
def test_vllm_flags_without_a_pdserve_knob(flag, capsys):
    """A vLLM launch line's flag that pdserve has no knob for: a value whose meaning holds
    here is taken and changes no setting (the line runs unchanged); any other value, or a
    flag whose meaning does not hold, stops the start with why and what pdserve has
    instead (argparse alone says "unrecognized arguments"). None shows in --help."""
    v = next(v for v in FLAGS if flag in v.names)
    if v.holds is True:
        kept = [(flag,)]
    elif v.holds == INT:
        kept = [(flag, "0"), (flag, "4096")]
    else:  # the values that hold; none for a refused flag (False or None)
        kept = [(flag, h) for h in v.holds or ()]
    for argv in kept:
        assert _args(*argv) == _args(), argv
    refused = ([(flag,)] if v.holds is False else [] if v.holds is True else
               [(flag, "x2")] + ([(flag,)] if v.holds is None else []))  # fmt: skip
    for argv in refused:
        with pytest.raises(SystemExit) as e:
            _args(*argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {flag}" in err and v.why in err, err
        if v.holds in (None, False):
            assert f"{flag} is a vLLM flag pdserve does not take" in err
    assert kept or refused
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert flag not in p.format_help().split()


def test_vllm_flags_that_hold_say_which_values_do(capsys):
    """The refusal of a value names the ones taken (`-dp 2`: only 1)."""
    p = argparse.ArgumentParser()
    add_serve_args(p)
    for argv, says in [
        (["-dp", "2"], "-dp 2: pdserve takes 1 only: pdserve's data parallelism is its pools"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: pdserve takes auto or hf"),
        (["--max-log-len", "all"], "--max-log-len must be an integer >= 0 (got 'all')"),
        (["--enable-sleep-mode"], "--enable-sleep-mode is a vLLM flag pdserve does not take"),
    ]:
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert says in capsys.readouterr().err
    helps = p.format_help()
    assert "--max-logprobs" in helps and "--disable-log-requests" in helps


def test_a_request_asks_for_at_most_max_logprobs():
    """vLLM's --max-logprobs bounds completions' logprobs, chat's top_logprobs and
    prompt_logprobs, each a 400 naming its field; the bound itself passes."""
    for kind, body, param in [
        ("completion", {"logprobs": 4}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
        ("completion", {"prompt_logprobs": 4}, "prompt_logprobs"),
        ("chat", {"prompt_logprobs": 4}, "prompt_logprobs"),
    ]:
        params, _ = parse_sampling(body, kind, 0, 8)
        check_logprobs(params, kind, 4)
        with pytest.raises(
            ApiError, match=r"is over this server's limit of 3 \(--max-logprobs\)"
        ) as e:
            check_logprobs(params, kind, 3)
        assert e.value.param == param
