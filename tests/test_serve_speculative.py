"""`pdserve serve --speculative-config` (vLLM's flag), PD mode on the bundled SmolLM2: the
decode worker drafts from the request's own text, answers as the offline engine without
drafts does (greedy and seeded sampling), and /metrics says what the drafts gained."""

from __future__ import annotations

import json

from serve_server import Server

from pdserve import LLM, SamplingParams

# A list the model keeps going: its next tokens repeat what the prompt and its own reply
# already hold, so drafts are kept.
PROMPT = "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday,"
NEW = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _series(text: str, name: str, label: str = "") -> float:
    """The decode workers' sum of a series (of those carrying `label`, e.g. 'x="1"')."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"pdserve:{name}{{") and 'role="decode"' in line and label in line
    )


def test_pd_server_drafts_and_answers_as_without_bundled(smollm_dir, tmp_path):
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=NEW, ignore_eos=True),
    ]
    offline = LLM(model=smollm_dir, device="cpu")
    want = [offline.generate(PROMPT, p, use_tqdm=False)[0].outputs[0].text for p in params]
    server = Server(tmp_path, "--device", "cpu", "--speculative-config", json.dumps(SPEC))
    try:
        client = server.client()
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
        drafted = _series(metrics, "spec_decode_num_draft_tokens_total")
        kept = _series(metrics, "spec_decode_num_accepted_tokens_total")
        assert 0 < kept <= drafted, (kept, drafted)
        by_pos = [
            _series(metrics, "spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
            for i in range(3)
        ]
        assert sum(by_pos) == kept and by_pos[0] >= by_pos[1] >= by_pos[2], by_pos
        info = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:engine_info{")]
        # the decode worker drafts; the prefill worker samples one token a request, so it
        # runs without speculation (and keeps async scheduling where that is the default)
        decode = [ln for ln in info if 'role="decode"' in ln]
        prefill = [ln for ln in info if 'role="prefill"' in ln]
        assert decode and all('speculative="ngram(k=3, n=1..3)"' in ln for ln in decode), info
        assert prefill and all('speculative="off"' in ln for ln in prefill), info
    finally:
        server.stop()
    assert "speculative ngram(k=3, n=1..3) (synchronous scheduling)" in server.log.read_text()
