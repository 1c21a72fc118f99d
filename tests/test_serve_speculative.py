"""`pdserve serve --speculative-config` (vLLM's flag), PD mode on the bundled SmolLM2: the
decode worker drafts from the request's own text, answers as the offline engine without
drafts does (greedy and seeded sampling), and /metrics says what the drafts gained. The
server is the session's `pd_layer_wise` (conftest.py), whose KV also moves layer-wise."""

from __future__ import annotations

from conftest import SERVE_DRAFTS

from pdserve import LLM, SamplingParams

# A list the model keeps going: its next tokens repeat what the prompt and its own reply
# already hold, so drafts are kept.
PROMPT = "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday,"
NEW = 24
K = SERVE_DRAFTS["num_speculative_tokens"]


def _series(text: str, name: str, label: str = "") -> float:
    """The decode workers' sum of a series (of those carrying `label`, e.g. 'x="1"')."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"pdserve:{name}{{") and 'role="decode"' in line and label in line
    )


def test_pd_server_drafts_and_answers_as_without_bundled(smollm_dir, pd_layer_wise):
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=NEW, ignore_eos=True),
    ]
    offline = LLM(model=smollm_dir, device="cpu")
    want = [offline.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].text for p in params]
    server = pd_layer_wise
    client = server.client()
    before = server.metrics()  # the server is shared: what this test adds is counted
    for p, text in zip(params, want, strict=True):
        extra = {"ignore_eos": True, "top_p": p.top_p}
        if p.seed is not None:
            extra["seed"] = p.seed
        r = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=NEW,
            temperature=p.temperature, extra_body=extra,
        )  # fmt: skip
        assert r.choices[0].text == text
    metrics = server.metrics()

    def added(name: str, label: str = "") -> float:
        return _series(metrics, name, label) - _series(before, name, label)

    drafted = added("spec_decode_num_draft_tokens_total")
    kept = added("spec_decode_num_accepted_tokens_total")
    assert 0 < kept <= drafted, (kept, drafted)
    by_pos = [
        added("spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"') for i in range(K)
    ]
    assert sum(by_pos) == kept and by_pos[0] >= by_pos[1] >= by_pos[2], by_pos
    # the waits drafts cost async scheduling: none here, as a CPU worker runs synchronously
    for name in ("worker_spec_sync_steps_total", "worker_spec_drains_total"):
        lines = [ln for ln in metrics.splitlines() if ln.startswith(f"pdserve:{name}{{")]
        assert lines and added(name) == 0, lines
    info = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:engine_info{")]
    # the decode worker drafts; the prefill worker samples one token a request, so it
    # runs without speculation
    decode = [ln for ln in info if 'role="decode"' in ln]
    prefill = [ln for ln in info if 'role="prefill"' in ln]
    assert decode and all('speculative="ngram(k=3, n=1..3)"' in ln for ln in decode), info
    assert prefill and all('speculative="off"' in ln for ln in prefill), info
    assert "speculative ngram(k=3, n=1..3) (synchronous scheduling)" in server.log.read_text()
