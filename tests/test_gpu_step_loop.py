"""GPU-path invariants of the step loop (collected only where a CUDA device exists; see
conftest.collect_ignore): no host sync inside steps, CUDA graphs replay over the same
persistent buffers, padded graph rows write nothing to the KV cache."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.kernels.decode_prep import step_buffer_size
from pdserve.kernels.input_prep import post_update_triton
from pdserve.runner.engine import Engine
from pdserve.runner.mrv2.step_mailbox import StepMailbox
from pdserve.runner.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def qwen3_with_words(qwen3_shaped_dir, tmp_path_factory) -> str:
    """The Qwen3-shaped model with a word-level tokenizer ("w0".."w999" are ids 0..999),
    so that requests can name bad_words on the GPU machine, which has no real one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("qwen3-words")
    for f in Path(qwen3_shaped_dir).iterdir():
        (path / f.name).symlink_to(f)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(path)
    return str(path)


def _engine(model_dir: str, decode_attention: str = "auto", **kwargs) -> Engine:
    return Engine.from_args(
        model=model_dir,
        device="cuda",
        dtype=kwargs.pop("dtype", "bfloat16"),
        max_model_len=256,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        decode_attention=decode_attention,
        **kwargs,
    )


@pytest.mark.parametrize(
    "decode_attention,scope",
    [
        ("per_head", "layers"),
        ("packed", "layers"),
        ("flat", "layers"),
        ("per_head", "step"),
        ("per_head_prep", "step"),
    ],  # fmt: skip
)
def test_step_loop_never_syncs_and_graphs_keep_their_buffers(
    qwen3_with_words, decode_attention, scope
):
    eng = _engine(qwen3_with_words, decode_attention, cuda_graph_scope=scope)
    assert eng.config.runner.async_scheduling and eng.runner.graphs is not None
    buf = eng.runner.buffers
    ptrs = {
        name: getattr(buf, name).data_ptr()
        for name in (
            "step_inputs",
            "input_ids",
            "positions",
            "slot_mapping",
            "seq_lens",
            "block_tables",
        )
    }
    rng = random.Random(0)
    params = [
        SamplingParams(temperature=t, top_p=p, max_tokens=24, ignore_eos=True, seed=i)
        for i, (t, p) in enumerate([(0.0, 1.0), (0.8, 0.9), (1.0, 1.0)] * 4)
    ]
    # logit_bias, allowed_token_ids and bad_words rows: their tables are built and
    # applied each step without a sync too, and hold on the GPU. The bad-words row is
    # biased to 5, then 6, and bans 5 always and 6 after a 6 (read from the device's
    # token history, where the last token may be in flight): 6 every other token.
    allowed = [11, 12, 500, 149_999]
    params += [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                       logit_bias={5: 100.0, 6: 50.0}, bad_words=["w5", "w6 w6"]),
        SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True, seed=99,
                       logit_bias={5: 100.0, 77: -100.0}),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed),
        # Structured output: the row's automaton state is read, masked and advanced on the
        # device each step; only "w1" and "w2" (ids 1, 2) spell the pattern. min_tokens
        # bans EOS for 20 tokens (and checks on the device that the row keeps a token).
        SamplingParams(temperature=1.0, max_tokens=24, min_tokens=20, seed=5,
                       structured_outputs={"regex": "(w1|w2){0,100}"}),
    ]  # fmt: skip
    # Its table is built first, so the row runs from the first step (a new grammar's
    # table is otherwise built on a thread while the other rows step).
    eng.grammars.get(params[-1].structured_outputs)
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", [rng.randrange(3, 150_000) for _ in range(rng.randint(5, 90))], p)
    out: dict[str, list[int]] = {}

    def step() -> None:
        for delta in eng.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)

    for _ in range(3):  # prefill steps and the first decode (compiles what is left)
        step()
    kv_before = eng.runner.kv_cache.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = 0
        while eng.scheduler.has_unfinished():
            step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps > 10
    while eng.has_unfinished():
        step()
    words, biased, restricted = (out[f"r{len(params) - k}"] for k in (4, 3, 2))
    structured = out[f"r{len(params) - 1}"]
    eos = set(eng.eos_token_ids)
    assert 20 < len(structured) <= 24 and set(structured[:20]) <= {1, 2}, structured
    assert set(structured) <= {1, 2, *eos} and (len(structured) == 24 or structured[-1] in eos)
    assert biased == [5] * 24 and len(restricted) == 24 and set(restricted) <= set(allowed)
    assert words[0::2] == [6] * 12 and not {5, 6} & set(words[1::2]), words
    assert {n: getattr(buf, n).data_ptr() for n in ptrs} == ptrs, "persistent buffers moved"
    # Pad rows (slot -1) wrote nothing: block 0 (the null block) is untouched by decoding.
    assert torch.equal(eng.runner.kv_cache[:, 0], kv_before[:, 0])


def _greedy_run(model_dir: str, scope: str) -> tuple[Engine, dict[str, list[int]]]:
    """20 greedy requests of mixed lengths (the batch shrinks through padded graph sizes);
    r3 wants logprobs and stops first, so the steps it is in take the eager tail. Checks on
    the way that the decode loop never syncs and that pad rows (idx_mapping 0, seq_len 0)
    write neither the KV cache's null block nor position 0 of any slot's token history."""
    eng = _engine(model_dir, dtype="float32", cuda_graph_scope=scope)
    rng = random.Random(5)
    for i in range(20):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=10 if i == 3 else rng.randint(16, 40),
            ignore_eos=True,
            logprobs=2 if i == 3 else None,
        )
        prompt = [rng.randrange(3, 150_000) for _ in range(rng.randint(5, 90))]
        eng.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {}

    def step() -> None:
        for delta in eng.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)

    for _ in range(40):  # until every prompt is in its slot and has its first token
        step()
        if len(out) == 20:
            break
    assert len(out) == 20, "the prompts did not all prefill in 40 steps"
    step_ptr = eng.runner.buffers.step_inputs.data_ptr()
    kv_before = eng.runner.kv_cache[:, 0].clone()
    first_tokens = eng.runner.state.token_ids[:, 0].clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while eng.scheduler.has_unfinished():
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while eng.has_unfinished():
        step()
    assert eng.runner.buffers.step_inputs.data_ptr() == step_ptr, "the step buffer moved"
    assert torch.equal(eng.runner.kv_cache[:, 0], kv_before), "a pad row wrote KV"
    assert torch.equal(eng.runner.state.token_ids[:, 0], first_tokens), "a pad row wrote a token"
    return eng, out


def test_step_graphs_give_the_layer_graphs_tokens_without_syncing(qwen3_shaped_dir):
    """Guards step-scope graphs: the input prep and greedy tail (norm, LM head, argmax,
    post-update) they replay give the tokens of layer graphs with the eager prep and tail
    (float32, so near-ties cannot flip), the loop never syncs, the step buffer (with the
    tail's mask) keeps its address, steps wanting logprobs fall back to the eager tail, and
    pad rows write neither KV nor token history (`_greedy_run`)."""
    eng, tail = _greedy_run(qwen3_shaped_dir, "step")
    graphs = eng.runner.graphs
    assert graphs.prep is not None and graphs.has_greedy_tail
    assert len(graphs.tail_graphs) == len(graphs.graphs)
    assert graphs.tail_replays > 10, "the greedy steps did not replay the tail graphs"
    assert graphs.replays > 0, "the logprobs request's steps must take the eager tail"
    # What /metrics reports for this engine (engine_info, engine_steps).
    assert eng.execution_path["graph_scope"] == "step"
    by_path = eng.steps_by_path()
    assert by_path["cuda_graph_whole_step"] == graphs.tail_replays
    assert by_path["cuda_graph"] == graphs.replays and by_path["eager"] > 0
    del eng
    _, eager = _greedy_run(qwen3_shaped_dir, "layers")
    assert tail.keys() == eager.keys() and all(len(v) >= 8 for v in tail.values())
    for req_id, tokens in eager.items():
        assert tail[req_id] == tokens, f"{req_id}: the greedy tail changed the tokens"


def test_step_mailbox_keeps_unread_samples_and_counts_steps():
    """Guards runner/mrv2/step_mailbox.py: each step's packed buffer lands in slot
    `steps % 2` naming its slot, a post-update's samples land in that slot's row of pinned
    memory, and a step whose samples were not read before its slot is reused (step 0,
    when step 2 is written) keeps them; the device count moves once a step, like the host's."""
    rows, dev = 4, torch.device("cuda")
    mb = StepMailbox(step_buffer_size(rows), rows, dev)
    idx = torch.arange(rows, dtype=torch.int32, device=dev)
    seq_lens = torch.zeros(rows, dtype=torch.int32, device=dev)
    keep = torch.zeros(rows, dtype=torch.int32, device=dev)
    token_ids = torch.zeros(rows, 8, dtype=torch.int32, device=dev)
    pending = []
    for step in range(3):
        slot = mb.write(np.full(step_buffer_size(rows) - 1, step, dtype=np.int32))
        assert slot == step % 2 and int(mb.inputs[slot, 0]) == step
        assert int(mb.inputs[slot, -1]) == slot, "the buffer names its slot"
        sampled = torch.arange(rows, device=dev) + 100 * step
        dev_slot = torch.tensor([slot], dtype=torch.int32, device=dev)
        post_update_triton(idx, sampled, seq_lens, keep, token_ids, mb.mail_out(dev_slot, True))
        pending.append(mb.launched(rows))
    got = [p.fetch().tolist() for p in pending]
    assert got == [[100 * s + i for i in range(rows)] for s in range(3)]
    assert int(mb.seq) == mb.steps == 3
