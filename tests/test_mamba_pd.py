"""PD for hybrid Mamba models: the prompt's final Mamba state travels with its KV blocks.

A prefill-role engine keeps a held prompt's state unit with its blocks
(runner/state_pool.py), its ticket names the unit as a second group (kvtransfer `mamba_state`),
and the decode side pulls it into the unit its request will run with. Real engines, real
transports (`local`, and `tcp` over a loopback ZMQ socket), greedy tokens equal to one
engine doing both; the state is shown to matter (zeroed on the prefill side, the tokens
change), and a load that fails recomputes the whole prompt from a zero state.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_pd_engine import GREEDY, _colocated, _kw, _pd, _prompts, _run, wait_for_tickets

from pdserve.decode.worker import DecodeWorker
from pdserve.kvtransfer.tier import HostKVTier
from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillWorker
from pdserve.runner.engine import Engine

VOCAB = 1009


def _local_pair(model: str, **extra) -> tuple[PrefillWorker, DecodeWorker]:
    registry = LocalRegistry()
    prefill = PrefillWorker(Engine.from_args(**_kw(model, **extra)), "P0", registry=registry)
    transports = {"local": LocalTransport(registry, prefill.source.layout_hash)}
    return prefill, DecodeWorker(_kw(model, **extra), "D0", transports)


def _units_free(engine: Engine) -> int:
    return engine.kv.state_pool.num_free


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pd_local_equals_colocated_bamba(tiny_bamba_dir, async_scheduling):
    """Prompts over several scan chunks (16 tokens) and KV blocks, prefilled in 24-token
    chunks on P: D continues from the pulled state and blocks exactly as one engine does,
    and every unit and block comes back on both sides."""
    prompts = _prompts(5, VOCAB, seed=3, lo=5, hi=70)
    extra = dict(async_scheduling=async_scheduling, max_num_batched_tokens=24, block_size=16)
    want = _colocated(tiny_bamba_dir, prompts, **extra)
    prefill, decode = _local_pair(tiny_bamba_dir, **extra)
    layout = prefill.source.layout
    assert [g.kind for g in layout.groups] == ["paged_gqa", "mamba_state"]
    assert layout.groups[0].num_layers == 2  # the attention layers only
    assert layout.groups[1].num_layers == 2  # the Mamba layers
    units = prefill.engine.kv.state_pool.num_units
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    results = wait_for_tickets(prefill, len(prompts), timeout_s=120)
    held = {r.ticket.group_unit_ids[1][0] for r in results}
    assert len(held) == len(prompts), "each held prompt keeps its own state unit"
    assert _units_free(prefill.engine) == units - len(prompts)
    for r in results:
        decode.submit(r.request_id, prompts[int(r.request_id)], GREEDY, r.ticket)
    got = _run(decode.step, decode.has_work)
    assert got == want
    assert decode.loader.stats.loads == len(prompts)
    assert decode.loader.stats.recomputes == 0
    prefill.step()  # frees what the decode side released
    assert _units_free(prefill.engine) == units
    assert _units_free(decode.engine) == decode.engine.kv.state_pool.num_units
    assert decode.engine.kv.num_free_blocks == decode.engine.kv.num_blocks - 1


def test_pd_tcp_equals_colocated_nemotron_h(tiny_nemotron_h_dir):
    """Over a real ZMQ socket, frames per layer and group: NemotronH's grouped norm and
    its three block kinds, with the conv and SSM states as the second group's two tensors."""
    prompts = _prompts(4, VOCAB, seed=5, lo=3, hi=60)
    want = _colocated(tiny_nemotron_h_dir, prompts)
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_nemotron_h_dir)), "P0")
    try:
        layout = prefill.source.layout
        decode = DecodeWorker(_kw(tiny_nemotron_h_dir), "D0", {"tcp": TcpTransport("D0", layout)})
        got = _pd(prefill, decode, prompts)
        assert got == want
        assert decode.loader.stats.loads == len(prompts)
        assert decode.loader.stats.recomputes == 0
        mamba = layout.groups[1]
        per_unit = sum(g.unit_bytes() for g in layout.groups[1:])
        assert mamba.unit_bytes() == per_unit
        assert decode.loader.stats.bytes_pulled >= len(prompts) * per_unit
        decode.close()
    finally:
        prefill.close()


def test_the_pulled_state_is_what_decode_runs_from(tiny_bamba_dir):
    """Zero P's held states before the pull: D's tokens must change (so the state really
    crosses and is read), while a request whose state is left alone still matches."""
    prompts = _prompts(2, VOCAB, seed=7, lo=40, hi=60)
    want = _colocated(tiny_bamba_dir, prompts)
    prefill, decode = _local_pair(tiny_bamba_dir)
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    tickets = {r.request_id: r.ticket for r in wait_for_tickets(prefill, 2, timeout_s=60)}
    conv, ssm = prefill.engine.runner.model.mamba_states
    unit = tickets["0"].group_unit_ids[1][0]
    conv[:, unit].zero_()
    ssm[:, unit].zero_()
    for rid, ticket in tickets.items():
        decode.submit(rid, prompts[int(rid)], GREEDY, ticket)
    got = _run(decode.step, decode.has_work)
    assert got["1"] == want["1"]
    assert got["0"][0][0] == want["0"][0][0]  # the ticket's token, sampled on P
    assert got["0"] != want["0"], "decoding from a zero state must differ"


def test_a_failed_pull_recomputes_the_whole_prompt(tiny_bamba_dir):
    """A dead prefill endpoint: the state does not exist anywhere else, so D computes the
    prompt from token 0 with a zero state, and the tokens still match."""
    prompts = _prompts(2, VOCAB, seed=4, lo=20, hi=50)
    want = _colocated(tiny_bamba_dir, prompts)
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_bamba_dir)), "P0")
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    tickets = {r.request_id: r.ticket for r in wait_for_tickets(prefill, 2, timeout_s=60)}
    prefill.close()  # the peer is gone: pulls time out
    decode = DecodeWorker(
        _kw(tiny_bamba_dir), "D0", {"tcp": TcpTransport("D0", prefill.source.layout)},
        timeout_s=0.5,
    )  # fmt: skip
    try:
        for rid, ticket in tickets.items():
            decode.submit(rid, prompts[int(rid)], GREEDY, ticket)
        assert _run(decode.step, decode.has_work, timeout_s=30) == want
        assert decode.loader.stats.recomputes == len(prompts)
        assert _units_free(decode.engine) == decode.engine.kv.state_pool.num_units
    finally:
        decode.close()


def test_a_ticket_without_the_state_is_refused_then_recomputed(tiny_bamba_dir):
    """A ticket whose unit groups do not match the layout (the state group dropped): the
    load fails as a bad ticket, never decoding from blocks without their state."""
    prompts = _prompts(1, VOCAB, seed=6, lo=30, hi=40)
    want = _colocated(tiny_bamba_dir, prompts)
    prefill, decode = _local_pair(tiny_bamba_dir)
    (result,) = wait_for_tickets_after(prefill, prompts)
    ticket = dataclasses.replace(result.ticket, group_unit_ids=result.ticket.group_unit_ids[:1])
    decode.submit("0", prompts[0], GREEDY, ticket)
    assert _run(decode.step, decode.has_work) == want
    assert decode.loader.stats.errors["bad_ticket"] == 1
    assert decode.loader.stats.recomputes == 1


def wait_for_tickets_after(prefill: PrefillWorker, prompts: list[list[int]]):
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    return wait_for_tickets(prefill, len(prompts), timeout_s=60)


def test_held_prompts_wait_for_free_state_units(tiny_bamba_dir):
    """Two units (max_num_seqs 2) and four prompts: two are held, the other two wait (not
    fail) until a release gives their units back."""
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_bamba_dir, max_num_seqs=2)), "P0")
    try:
        prompts = _prompts(4, VOCAB, seed=8, lo=10, hi=20)
        first = wait_for_tickets_after(prefill, prompts[:2])
        for i, p in enumerate(prompts[2:], 2):
            prefill.submit(str(i), p, GREEDY)
        for _ in range(5):
            assert prefill.step() == []
        assert prefill.stalled() and _units_free(prefill.engine) == 0
        for r in first:
            prefill.leases.release(r.request_id, "released")
        rest = wait_for_tickets(prefill, 2, timeout_s=60)
        assert sorted(r.request_id for r in rest) == ["2", "3"]
    finally:
        prefill.close()


def test_what_a_hybrid_refuses_by_name(tiny_bamba_dir):
    """The KV tier keeps blocks by prefix hash without states, and layer-wise early
    tickets publish before the state is final: both refused with the reason."""
    engine = Engine.from_args(**_kw(tiny_bamba_dir))
    with pytest.raises(ValueError, match="layer-wise early tickets cannot serve Bamba.*end of a"):
        PrefillWorker(engine, "P0", early_tickets=True)
    tier = HostKVTier(1 << 20)
    with pytest.raises(ValueError, match="the KV tier cannot serve BambaForCausalLM"):
        PrefillWorker(engine, "P0", tier=tier)
    with pytest.raises(ValueError, match="the KV tier cannot serve BambaForCausalLM"):
        DecodeWorker(_kw(tiny_bamba_dir), "D0", {}, tier=tier)


@pytest.fixture(scope="module")
def bamba_chat_dir(tmp_path_factory, smollm_dir) -> str:
    """The tiny Bamba with SmolLM2's tokenizer (and so its vocabulary), for the server."""
    import shutil

    from conftest import _save_tiny, slow_decay
    from transformers import BambaConfig

    cfg = BambaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, max_position_embeddings=512, initializer_range=0.1,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["BambaForCausalLM"],
    )  # fmt: skip
    path = slow_decay(_save_tiny(tmp_path_factory, "bamba-chat", cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{smollm_dir}/{name}", path)
    return path


def test_pd_server_serves_a_hybrid_with_the_bundled_tokenizer(bamba_chat_dir, tmp_path):
    """`pdserve serve --mode pd` on a hybrid: the tier it would start is off (said so), the
    completion equals the offline engine's, a repeated prompt is not routed to a decode
    worker's prefix cache (there is none), and layer-wise KV is refused by name."""
    from serve_server import Server
    from test_serve_e2e import _metric

    from pdserve import LLM, SamplingParams
    from pdserve.cluster.serve_process import ServeProcess

    # Longer than the router's pd_min_prompt_tokens (16), so it prefills on the P worker
    prompt = "Paris is the capital and largest city of France; the Seine runs through it, and"
    llm = LLM(model=bamba_chat_dir, device="cpu", max_model_len=256)
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text  # fmt: skip
    del llm
    server = Server(tmp_path, "--model", bamba_chat_dir, "--device", "cpu", "--max-model-len",
                    "256")  # fmt: skip
    try:
        assert "the KV tier is off for BambaForCausalLM" in server.log.read_text()
        for _ in range(2):  # the second time too: no decode worker caches the prefix
            out = server.client().completions.create(
                model=bamba_chat_dir, prompt=prompt, max_tokens=12, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.choices[0].text == want
            assert out.usage.completion_tokens == 12
        metrics = server.metrics()  # both prompts ran on the prefill worker, their KV pulled
        assert _metric(metrics, "pdserve:pd_decisions_total", reason="remote_prefill") == 2
        assert _metric(metrics, "pdserve:kv_transfer_bytes_total") > 0, metrics
        assert _metric(metrics, "pdserve:kv_recompute_fallbacks_total") == 0, metrics
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match="--kv-layer-wise is refused for BambaForCausalLM"):
        ServeProcess(tmp_path, "--model", bamba_chat_dir, "--device", "cpu", "--max-model-len",
                     "256", "--kv-layer-wise")  # fmt: skip


def test_pd_local_equals_colocated_jamba(tiny_jamba_dir):
    """Jamba's Mamba1 state (conv [K-1, d_inner], SSM [d_inner, N]) crosses as its unit."""
    prompts = _prompts(4, VOCAB, seed=9, lo=5, hi=60)
    want = _colocated(tiny_jamba_dir, prompts)
    prefill, decode = _local_pair(tiny_jamba_dir)
    mamba = prefill.source.layout.groups[1]
    assert (mamba.conv_shape, mamba.ssm_shape) == ((3, 128), (128, 8))
    assert _pd(prefill, decode, prompts) == want
    assert decode.loader.stats.loads == len(prompts) and decode.loader.stats.recomputes == 0
