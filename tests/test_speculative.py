"""Speculative decoding with n-gram drafts (runner/speculative/): a request's tokens are the
same with and without drafts, whatever its sampling settings, and only the steps change.

The tiny models here repeat themselves (random weights fall into loops under greedy
decoding), and the prompts repeat a pattern, so drafts are both accepted and rejected:
every test that claims equality also checks that both happened, or it would prove nothing.
float32 on the CPU: a drafted row's logits come from the prefill path (a query of several
tokens over the cache) and a lone decode's from the decode path, which sum in another
order; ties that close do not occur in these runs, and logprobs agree to 1e-5.
"""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE

from pdserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _prompts(n: int, seed: int = 3, vocab: int = 990) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pattern = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]
        out.append({"prompt_token_ids": (pattern * 12)[: rng.randint(8, 40)]})
    return out


def _llm(model_dir: str, spec: dict | None = NGRAM, **kw) -> LLM:
    kw.setdefault("device", DEVICE)
    kw.setdefault("dtype", "float32")
    if DEVICE != "cpu":
        kw.setdefault("async_scheduling", False)  # the peer runs as the drafting one does
    return LLM(model=model_dir, speculative_config=spec, **kw)


def _both(model_dir: str, prompts, params, **kw):
    plain = _llm(model_dir, spec=None, **kw).generate(prompts, params, use_tqdm=False)
    llm = _llm(model_dir, **kw)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    return plain, drafted, llm


def _assert_same(plain, drafted, logprobs: bool = False) -> None:
    for a, b in zip(plain, drafted, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        if logprobs:
            assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
            for p, q, t in zip(x.logprobs, y.logprobs, x.token_ids, strict=True):
                assert set(p) == set(q)
                assert abs(p[t].logprob - q[t].logprob) < 1e-5
                assert p[t].rank == q[t].rank


def _assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    s = llm.engine.scheduler
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, (
        s.num_accepted_tokens,
        s.num_draft_tokens,
    )


def _count_tokens(llm: LLM) -> dict[str, int]:
    """Counts what each engine step hands out: deltas (one a request that got tokens) and
    their tokens."""
    counts = {"deltas": 0, "tokens": 0}
    step = llm.engine.step

    def counted():
        deltas = step()
        counts["deltas"] += len(deltas)
        counts["tokens"] += sum(len(d.new_token_ids) for d in deltas)
        return deltas

    llm.engine.step = counted
    return counts


def _record_drafts(llm: LLM) -> list[tuple[str, int, list[int]]]:
    """(request id, its output length, draft) of every draft the scheduler puts in a step."""
    seen = []
    sched = llm.engine.scheduler
    schedule = sched.schedule

    def recorded():
        so = schedule()
        for rid, draft in so.spec_token_ids.items():
            seen.append((rid, sched.requests[rid].num_output_tokens, list(draft)))
        return so

    sched.schedule = recorded
    return seen


def test_greedy_tokens_equal_the_plain_engine(tiny_llama_dir):
    """Guards the verification itself: a draft kept past a disagreeing sample, a sample
    read from the wrong row or the rejected positions' KV read later change greedy tokens.
    A step that keeps fewer drafts than agree with the plain engine's tokens (e.g. the
    sample after the last kept draft left out) gives the same tokens in more steps: the
    kept count is checked against the drafts each step put in, read against the plain
    engine's output."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(8)
    plain = _llm(tiny_llama_dir, spec=None).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama_dir)
    counts, drafts = _count_tokens(llm), _record_drafts(llm)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    _assert_same(plain, drafted)
    _assert_drafts_accepted_and_rejected(llm)
    agree, _ = _agreeing_drafts(drafts, plain, drafted)
    assert llm.engine.scheduler.num_accepted_tokens == agree
    # every step after the prompts' is decodes only: drafted positions run as decode rows
    assert llm.engine.runner.draft_steps["decode_rows"] > 0
    # drafts never reach past max_tokens, so no kept token is dropped by a stop
    assert counts["tokens"] == counts["deltas"] + agree
    assert counts["tokens"] == 8 * 40 == llm.engine.stats.generation_tokens
    steps = llm.engine.stats.num_steps
    assert steps < 40 + 2, f"{steps} steps: the drafts saved none"  # 8 prompts in 1-2 steps
    assert llm.engine.execution_path["speculative"] == "ngram(k=3, n=1..3)"


def test_seeded_sampling_equals_the_plain_engine(tiny_llama_dir):
    """At a temperature, with top-k and top-p: each drafted position is sampled with the
    request's seed at that position, so the kept tokens and their logprobs are the ones a
    step without drafts draws (runner/speculative/verify.py says why that is exact)."""
    params = [
        SamplingParams(
            temperature=0.3,
            top_k=50,
            top_p=0.9,
            seed=100 + i,
            max_tokens=30,
            ignore_eos=True,
            logprobs=2,
        )  # fmt: skip
        for i in range(8)
    ]
    plain, drafted, llm = _both(tiny_llama_dir, _prompts(8, seed=5), params)
    _assert_same(plain, drafted, logprobs=True)
    _assert_drafts_accepted_and_rejected(llm)


def test_stops_and_length_inside_a_draft(tiny_llama_dir):
    """A stop token or the length limit met inside the kept part of a draft ends the
    request there, as it would one token at a time: the tokens after it are dropped."""
    prompts = _prompts(8, seed=9)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs = _llm(tiny_llama_dir, spec=None).generate(prompts, free, use_tqdm=False)
    # a token each run makes late in its output: it stops there
    stops = sorted({o.outputs[0].token_ids[17] for o in runs})
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, stop_token_ids=stops)
    plain, drafted, llm = _both(tiny_llama_dir, prompts, params)
    _assert_same(plain, drafted)
    reasons = {o.outputs[0].finish_reason for o in drafted}
    assert reasons == {"stop", "length"} or reasons == {"stop"}, reasons
    assert any(len(o.outputs[0].token_ids) < 23 for o in drafted)
    _assert_drafts_accepted_and_rejected(llm)


def _agreeing_drafts(drafts, plain, drafted) -> tuple[int, set[str]]:
    """Drafted tokens that equal the plain engine's output at their place (what a step
    must keep), and the requests that drafted at all."""
    ids = {o.request_id: p.outputs[0].token_ids for o, p in zip(drafted, plain, strict=True)}
    agree, who = 0, set()
    for rid, done, draft in drafts:
        # draft[j] stands where output[done + j] does ("#i": the engine's id of child i)
        base = rid.split("#")[0]
        tokens = ids[base][done:]
        agree += next((j for j, (d, t) in enumerate(zip(draft, tokens)) if d != t), len(draft))
        who.add(base)
    return agree, who


def test_sampling_that_reads_history_drafts_exactly(tiny_llama_dir):
    """Penalties count the drafts before a position as output, min_tokens bans EOS per
    position until met, logit_bias and allowed_token_ids apply to every position: each
    such request drafts and its tokens equal the plain engine's. Beside them a long prompt
    is chunked (a budget of 24 tokens also cuts drafts short)."""
    prompts = _prompts(7, seed=11) + [{"prompt_token_ids": list(range(3, 90))}]
    pattern = prompts[5]["prompt_token_ids"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.05),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logit_bias={5: 2.0}),
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            ignore_eos=True,
            allowed_token_ids=sorted(set(pattern)) + [2, 7, 11],
        ),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    plain = _llm(tiny_llama_dir, spec=None, max_num_batched_tokens=24).generate(
        prompts, params, use_tqdm=False
    )
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=24)
    drafts = _record_drafts(llm)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    _assert_same(plain, drafted)
    _assert_drafts_accepted_and_rejected(llm)
    agree, who = _agreeing_drafts(drafts, plain, drafted)
    assert llm.engine.scheduler.num_accepted_tokens == agree
    assert who >= {o.request_id for o in drafted[:7]}, who
    # both ways a step with drafts runs: beside the long prompt's chunks (each drafted row
    # sampling its positions), and as decode rows once every row decodes
    assert min(llm.engine.runner.draft_steps.values()) > 0, llm.engine.runner.draft_steps


def test_prefix_cache_and_preemption_with_drafts(tiny_qwen3_dir):
    """Blocks filled through drafts hold the kept tokens' KV only: a second run of the same
    prompts hits them and gives the same tokens; a cache small enough to preempt requests
    mid-draft gives them too."""
    prompts = _prompts(6, seed=13, vocab=990)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = _llm(tiny_qwen3_dir, spec=None).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_qwen3_dir)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    _assert_same(plain, first)
    _assert_same(plain, again)
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
    _assert_drafts_accepted_and_rejected(llm)
    tight = _llm(tiny_qwen3_dir, num_gpu_blocks=14, max_model_len=128)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    _assert_same(plain, squeezed)
    assert tight.engine.scheduler.num_preemptions > 0
    _assert_drafts_accepted_and_rejected(tight)


def test_async_scheduling_drafts_where_text_repeats(tiny_llama_dir):
    """Async scheduling with drafts (runner/engine.py `step`): requests that repeat their
    prompts draft, each drafted step waited for where it is launched; once they are done,
    requests sampling random text draft next to nothing and their steps overlap the next
    one's planning again. Guards where drafts come from: one made while the request's last
    token is still in flight would guess from a sequence one token short (verification
    rejects what it gets wrong, so the tokens would not show it; the count does). Tokens,
    texts and logprobs equal the synchronous engine's without drafts."""
    repeat = _prompts(4, seed=17)
    rng = random.Random(23)
    noise = [{"prompt_token_ids": [rng.randrange(3, 990) for _ in range(30)]} for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True, logprobs=1)
        for i in range(4)
    ]
    prompts = repeat + noise
    plain = _llm(tiny_llama_dir, spec=None, async_scheduling=False)
    plain = plain.generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama_dir, async_scheduling=True)
    sched, engine = llm.engine.scheduler, llm.engine
    schedule, step = sched.schedule, engine.step
    in_flight_at_draft, overlapped = [], []

    def recorded():
        so = schedule()
        # after planning, a drafted request holds the placeholder of this step's sample only
        in_flight_at_draft.extend(sched.requests[r].num_output_placeholders - 1
                                  for r in so.spec_token_ids)  # fmt: skip
        return so

    def counted():
        deltas = step()
        overlapped.append(engine._inflight is not None)
        return deltas

    sched.schedule, engine.step = recorded, counted
    drafted = llm.generate(prompts, params, use_tqdm=False)
    _assert_same(plain, drafted, logprobs=False)
    for a, b in zip(plain[4:], drafted[4:], strict=True):
        for p, q, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(p[t].logprob - q[t].logprob) < 1e-5
    _assert_drafts_accepted_and_rejected(llm)
    assert in_flight_at_draft and not any(in_flight_at_draft)
    stats = engine.stats
    assert stats.spec_sync_steps > 0 and stats.spec_drains > 0, stats
    # the random text's steps overlap: at least the 28 steps after the repeats end
    assert sum(overlapped) >= 20, (sum(overlapped), len(overlapped), stats)
    # Without the early reads every planned request has its last token in flight: none
    # drafts (without the scheduler's guard 44 draft tokens were made one token short)
    llm = _llm(tiny_llama_dir, async_scheduling=True)
    llm.engine.scheduler.drafts_due = lambda: False
    _assert_same(plain, llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.scheduler.num_draft_tokens == 0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of ngram"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown keys"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min <= prompt_lookup_max",
        ),  # fmt: skip
        ('{"method": "ngram", "num_speculative_tokens": 2', "not valid JSON"),
        ('["ngram"]', "must be a JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused_by_name(tiny_llama_dir, config, message):
    with pytest.raises(ValueError, match=message):
        _llm(tiny_llama_dir, spec=config)


def test_what_speculation_does_not_run_with(tiny_llama_dir, tiny_bamba_dir):
    """The reference runner and hybrid Mamba models (a rejected draft would stay in the
    recurrent state)."""
    with pytest.raises(ValueError, match="needs the mrv2 runner"):
        _llm(tiny_llama_dir, runner="reference")
    with pytest.raises(ValueError, match="hybrid Mamba"):
        _llm(tiny_bamba_dir)
    # JSON, as --speculative-config gives it, is the dict's equal
    llm = _llm(tiny_llama_dir, spec='{"method": "ngram", "num_speculative_tokens": 2}')
    assert llm.engine.execution_path["speculative"] == "ngram(k=2, n=1..4)"


def test_the_drafters_token_arrays_follow_each_request():
    """The drafter's per-request arrays grow by new tokens only (runner/speculative/
    drafter.py) and always equal prompt + output, past every regrowth."""
    from pdserve.runner.config import SpeculativeConfig
    from pdserve.runner.request import Request
    from pdserve.runner.speculative.drafter import Drafter

    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=2), max_model_len=10_000)
    rng = random.Random(0)
    reqs = [
        Request(
            f"r{i}",
            [rng.randrange(50) for _ in range(rng.randint(1, 90))],
            SamplingParams(max_tokens=5000),
            seed=i,
        )  # fmt: skip
        for i in range(4)
    ]
    for _ in range(300):
        req = rng.choice(reqs)
        for _ in range(rng.randint(0, 3)):
            req.append_output_token(rng.randrange(50))
        assert drafter.tokens(req).tolist() == req.all_token_ids


def test_what_drafts():
    """Every generating request drafts but one under a grammar (its automaton would have
    to step through the draft), a held prefill and an embedding (they sample once)."""
    from pdserve.runner.pooling import PoolingSpec
    from pdserve.runner.request import Request
    from pdserve.runner.speculative.drafter import can_draft

    looping = [5, 6, 7] * 10
    for params in (
        SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(logit_bias={3: 1.0}, allowed_token_ids=[3, 4], min_tokens=4),
        SamplingParams(bad_words=["x"]),
    ):
        assert can_draft(Request("r", looping, params, seed=0))
    grammar = Request("g", looping, SamplingParams(), seed=0)
    grammar.grammar = object()  # any grammar
    assert not can_draft(grammar)
    assert not can_draft(Request("h", looping, SamplingParams(), seed=0, hold_kv=True))
    pooled = Request("p", looping, SamplingParams(), seed=0)
    pooled.pooling = PoolingSpec.__new__(PoolingSpec)
    assert not can_draft(pooled)


def test_a_drafted_position_counts_the_drafts_before_it(tiny_llama_dir):
    """White-box: in a step with a draft of k tokens, sample row j's penalty table counts
    the request's output plus the first j drafts, and min_tokens bans EOS on exactly the
    rows whose output so far (drafts included) is short of it. (On these tiny models a
    table short by a few tokens rarely flips a greedy token, so the tokens alone would not
    show it.)"""
    llm = _llm(tiny_llama_dir)
    runner = llm.engine.runner
    sampler, metas = runner.sampler, []

    def spy(logits, meta):
        metas.append(meta)
        return sampler(logits, meta)

    runner.sampler = spy
    drafts = _record_drafts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=14, frequency_penalty=0.1)
    llm.generate(_prompts(1, seed=21), params, use_tqdm=False)
    drafted = [m for m in metas if m.output_counts is not None and len(m.output_counts) > 1]
    assert len(drafted) == len(drafts) > 2
    for meta, (_, done, draft) in zip(drafted, drafts, strict=True):
        assert len(meta.output_counts) == 1 + len(draft)
        assert meta.output_counts.sum(-1).tolist() == [done + j for j in range(1 + len(draft))]
        banned = set() if meta.banned_rows is None else set(meta.banned_rows.tolist())
        assert banned == {j for j in range(1 + len(draft)) if done + j < 14}
    assert any(done < 14 <= done + len(d) for _, done, d in drafts)  # min_tokens met mid-draft


def test_bad_words_see_the_drafts_before_them_bundled(smollm_dir):
    """A multi-token bad word is banned by the output's tail, drafts before a position
    included: the bundled SmolLM2 continuing a list of days, with the list's own
    continuation banned, writes what the plain engine writes, while drafting."""
    prompt = "Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday, Tuesday,"
    params = [
        SamplingParams(temperature=0.0, max_tokens=32, bad_words=[" Wednesday, Monday"]),
        SamplingParams(temperature=0.0, max_tokens=32, bad_words=[" Tuesday, Wednesday"]),
    ]
    prompts = [prompt, prompt]
    plain = _llm(smollm_dir, spec=None).generate(prompts, params, use_tqdm=False)
    llm = _llm(smollm_dir)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    _assert_same(plain, drafted)
    assert all(" Wednesday, Monday" not in o.outputs[0].text for o in drafted[:1])
    assert llm.engine.scheduler.num_accepted_tokens > 0


def test_an_embedding_beside_drafted_rows(tiny_llama_dir):
    """A one-token prompt pooled in a step where the other rows verify drafts: the step
    runs flat (the pooling reads the batch's own rows) and the vector is the one the
    prompt gets alone."""
    from pdserve.runner.engine import Engine

    def engine(spec):
        return Engine.from_args(model=tiny_llama_dir, device=DEVICE, dtype="float32",
                                speculative_config=spec, async_scheduling=False)  # fmt: skip

    alone = engine(None)
    alone.add_pooling_request("e", [17])
    want = next(d.embedding for d in _drain(alone) if d.embedding is not None)
    eng = engine(NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(_prompts(4, seed=23)):
        eng.add_request(f"g{i}", p["prompt_token_ids"], params)
    got = []
    for i in range(12):  # one a step, so some meet drafted rows
        eng.add_pooling_request(f"e{i}", [17])
        got += [d.embedding for d in eng.step() if d.embedding is not None]
    got += [d.embedding for d in _drain(eng) if d.embedding is not None]
    assert len(got) == 12
    for vector in got:
        assert max(abs(a - b) for a, b in zip(vector, want, strict=True)) < 1e-5
    assert eng.runner.draft_steps["flat"] > 0


def _drain(engine) -> list:
    out = []
    while engine.has_unfinished():
        out += engine.step()
    return out


@pytest.mark.parametrize("lookup", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_the_early_read_judge_keeps_up_with_a_growing_request(lookup):
    """Guards `Drafter.likely`'s runs, added a step's tokens at a time: after every new
    token (one or several at once, as a drafted step appends) its answer is the n-gram
    search's over the whole text, from its shortest pattern up, on seeded token streams
    over small alphabets (so that runs repeat) and a large one (so that they rarely do)."""
    from pdserve.runner.config import SpeculativeConfig
    from pdserve.runner.request import Request
    from pdserve.runner.speculative.drafter import Drafter
    from pdserve.runner.speculative.ngram import NgramProposer

    lo, hi = lookup
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=lo,
                               prompt_lookup_max=hi)  # fmt: skip
    drafter = Drafter(config, max_model_len=10_000)
    search = NgramProposer(1, drafter.shortest, hi)
    rng = random.Random(lo * 10 + hi)
    said = []
    for alphabet in (3, 8, 50_000):
        req = Request(f"r{alphabet}", [rng.randrange(alphabet) for _ in range(5)],
                      SamplingParams(max_tokens=500), seed=0)  # fmt: skip
        while req.num_output_tokens < 200:
            for _ in range(rng.choice((1, 1, 1, 4))):
                req.append_output_token(rng.randrange(alphabet))
            want = bool(search.propose(req.all_token_ids, 1))
            assert drafter.likely(req) == want, (alphabet, req.all_token_ids)
            said.append(want)
    assert any(said) and not all(said)


def test_a_lone_earlier_token_is_no_reason_to_wait():
    """Guards `Drafter.likely` (async scheduling reads the step in flight early when it
    says yes): text whose last two known tokens occurred together before will draft;
    text whose last token occurred once before by chance (sampled text that never
    repeats) will not, though a lookup of one token finds it. On an H100, sampled random
    text with n-gram drafts read 22 steps early for 2 drafts before this."""
    from pdserve.runner.config import SpeculativeConfig
    from pdserve.runner.request import Request
    from pdserve.runner.speculative.drafter import Drafter

    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), max_model_len=10_000)
    params = SamplingParams(max_tokens=100)
    chance = Request("chance", [11, 12, 13, 14, 15, 16, 13], params, seed=0)
    assert drafter.drafts(chance, 4) == [14, 15, 16]  # what a one-token lookup proposes
    assert not drafter.likely(chance)
    repeats = Request("repeats", [11, 12, 13, 14, 15, 12, 13], params, seed=0)
    assert drafter.likely(repeats)
    # nor when the draft would have no room once the token in flight is known
    assert not drafter.likely(Request("end", [11, 12, 13, 14, 15, 12, 13],
                                      SamplingParams(max_tokens=2), seed=0))  # fmt: skip
    # a lookup of one token only judges by one token
    one = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=1), 10_000)
    assert one.likely(chance)
