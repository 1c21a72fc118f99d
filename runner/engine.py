"""The engine of one worker: step-level API over scheduler + runner + output processing.

`add_request` / `step` / `abort` / `has_unfinished` are what workers (and the offline
`LLM`) drive. PD roles plug in through runner/kv_hooks.py: `add_request(hold_kv=True)`
and `release_held` on the prefill side, `add_prefilled_request` and a `KVLoader` on the
decode side (those methods live in runner/engine_pd.py). A step is `schedule ->
runner.execute -> update -> detokenize + stop checks -> deltas`. Bad input raises
`ValueError` naming the rule before anything is queued (runner/request_checks.py), so
one bad request never disturbs the others.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from pdserve.runner.bad_words import bad_word_ids
from pdserve.runner.config import EngineConfig
from pdserve.runner.config_resolve import resolve_engine_config
from pdserve.runner.detokenizer import IncrementalDetokenizer
from pdserve.runner.engine_pd import PDRoles
from pdserve.runner.engine_state import StepStats, Track
from pdserve.runner.kv_cache_manager import KVCacheManager
from pdserve.runner.kv_hooks import KVLoader, KVPublisher
from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.output_text import logprob_dict, next_text
from pdserve.runner.outputs import RequestDelta
from pdserve.runner.pooling import PoolingParams, model_pooling
from pdserve.runner.request import Request, RequestStatus
from pdserve.runner.request_checks import check_request
from pdserve.runner.runner_output import ModelRunnerOutput, TopLogprobs
from pdserve.runner.runner_select import execution_path
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.scheduler import Scheduler
from pdserve.runner.scheduler_output import SchedulerOutput
from pdserve.runner.seeding import derive_seed
from pdserve.runner.speculative.drafter import Drafter
from pdserve.runner.stop_checker import check_stop
from pdserve.runner.structured.grammar_cache import GrammarCache
from pdserve.runner.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


class Engine(PDRoles):
    def __init__(self, config: EngineConfig, kv_loader: KVLoader | None = None):
        self.config = config
        self.kv_loader = kv_loader
        # Prefill role, layer-wise early tickets: told which held prompts finish in a step
        # before its forward (runner/kv_hooks.py); set by the prefill worker.
        self.kv_publisher: KVPublisher | None = None
        self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.trust_remote_code)
        self.eos_token_ids = eos_token_ids(
            config.model.path, config.model.hf_config, self.tokenizer
        )
        if config.lora.enable_lora and config.runner.runner != "mrv2":
            raise ValueError(f"enable_lora needs the mrv2 runner (got {config.runner.runner!r})")
        if config.runner.runner == "mrv2":
            from pdserve.runner.mrv2.model_runner import MRV2ModelRunner as runner_cls
        else:
            from pdserve.runner.reference_runner import ReferenceRunner as runner_cls
        self.runner = runner_cls(config)
        self.grammars = GrammarCache(
            self.tokenizer, config.model.vocab_size, self.eos_token_ids,
            config.runner.torch_device,
        )  # fmt: skip
        bs = config.cache.block_size
        need = -(-(config.model.max_model_len + 1) // bs)
        if self.runner.num_blocks - 1 < need:
            raise ValueError(
                f"the KV cache ({self.runner.num_blocks - 1} blocks of {bs} tokens) cannot hold "
                f"one request of max_model_len={config.model.max_model_len} tokens; lower "
                "max_model_len or give the cache more memory"
            )
        self.kv = KVCacheManager(
            self.runner.num_blocks, bs, config.cache.enable_prefix_caching,
            self.runner.num_state_units, getattr(self.runner, "num_snapshot_units", 0),
        )  # fmt: skip
        drafter = (
            Drafter(config.speculative, config.model.max_model_len)
            if config.speculative is not None
            else None
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv, config.runner.async_scheduling, drafter
        )
        self._inflight: tuple[SchedulerOutput, Any] | None = None  # async: step N on device
        # The last step ran, launched and emitted nothing: whatever is unfinished waits on
        # something outside the engine (a KV load; blocks that held prompts keep until their
        # release), so stepping again changes nothing until that ends. The worker's loop
        # then sleeps instead of spinning (cluster/worker_loop.py).
        self.stalled = False
        self.stats = StepStats()
        self._tracks: dict[str, Track] = {}
        self._pending: list[RequestDelta] = []
        # prefill role: blocks (and a hybrid's state unit) under a lease
        self._held: dict[str, tuple[tuple[int, ...], int | None]] = {}
        # Embeddings and classifications (runner/pooling.py): how this model pools, and
        # vectors a step gave
        self.pooling = model_pooling(
            config.model.path, config.model.hf_config, config.model.classifier
        )
        self._embeddings: dict[str, list[float]] = {}
        # Requests whose structured-output grammar is still being built (grammar_cache.py)
        self._awaiting_grammar: dict[str, tuple[Request, Future]] = {}
        # decode role: how early tickets' first tokens arrived (`add_first_token`)
        self.first_tokens_by_source: Counter[str] = Counter()
        self._num_arrivals = 0
        self._max_model_len = config.model.max_model_len
        path = self.execution_path
        logger.info(
            "engine ready: model=%s runner=%s device=%s dtype=%s max_model_len=%d "
            "decode_attention=%s norms=%s graph_scope=%s experts=%s weights=%s lora=%s "
            "kv_cache=%s speculative=%s",
            config.model.source,
            path["runner"],
            config.runner.device,
            config.model.dtype,
            config.model.max_model_len,
            path["decode_attention"],
            path["norms"],
            path["graph_scope"],
            path["experts"],
            path["weights"],
            path["lora"],
            path["kv_cache"],
            path["speculative"],
        )

    @classmethod
    def from_args(cls, kv_loader: KVLoader | None = None, **kwargs: Any) -> Engine:
        return cls(resolve_engine_config(**kwargs), kv_loader=kv_loader)

    @property
    def runner_name(self) -> str:
        return self.runner.name

    @property
    def execution_path(self) -> dict[str, str]:
        """What this engine runs, as its ready log and the workers' stats say it."""
        spec = self.config.speculative
        return {
            **execution_path(self.config.runner, self.runner),
            # runner/speculative/: all-decode steps with drafts run as decode rows (graphs),
            # beside a prompt chunk eagerly (the runner's `draft_steps` counts both)
            "speculative": spec.describe() if spec is not None else "off",
        }

    def steps_by_path(self) -> dict[str, int]:
        """Steps with tokens by what ran them (the runner's count: `eager`, and on the MRV2
        runner `cuda_graph` and `cuda_graph_whole_step`)."""
        return self.runner.steps_by_path()

    def reset_counters(self) -> None:
        """Every count an operator reads (steps, tokens, prefix lookups, preemptions, steps by
        path) and the arrival count that unseeded requests' seeds derive from, back to a
        fresh engine's zeros (after a warm-up, runner/warm_up.py)."""
        self.stats = StepStats()
        self.scheduler.num_prompt_tokens_computed = self.scheduler.num_preemptions = 0
        self.scheduler.num_prefix_waits = 0
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0
        self.first_tokens_by_source.clear()
        self.grammars.reset_counters()
        self._num_arrivals = 0
        self.runner.reset_step_counts()

    # ---- requests -------------------------------------------------------------------------

    def next_seed(self) -> int:
        """The seed of the next request that brings none: a function of the engine seed and
        the arrival count, so a rerun in the same order reproduces the same samples."""
        seed = derive_seed(self.config.runner.seed, self._num_arrivals)
        self._num_arrivals += 1
        return seed

    def validate(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        """Raise ValueError/TypeError naming the rule a request breaks; changes nothing."""
        check_request(
            self.config, self.tokenizer, self.scheduler.requests, request_id, prompt_token_ids,
            params,
        )  # fmt: skip
        if request_id in self._awaiting_grammar:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)  # its DFA; the table is built apart

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
        kv_ticket: object | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. `hold_kv` (prefill role): sample one token, skip stop checks
        (the decode side applies them), and end with the blocks held: the last delta
        carries `kv_held`, and `release_held` frees them. `kv_ticket`: ask the
        `KVLoader` for the prompt's KV first (e.g. from the tier); whatever it cannot
        supply is computed here. `lora_request`: the LoRA adapter to run with, loaded now
        if it is not (an engine built with `enable_lora`)."""
        self.validate(request_id, prompt_token_ids, params)
        self._require_lm_head()
        if hold_kv or kv_ticket is not None:
            self.require_paged("hold_kv" if hold_kv else "kv_ticket")
        if kv_ticket is not None and self.kv_loader is None:
            raise ValueError("kv_ticket needs an engine built with a kv_loader")
        lora_name = self.load_lora(lora_request)
        self._new_request(
            request_id, prompt_token_ids, params, hold_kv=hold_kv, kv_ticket=kv_ticket,
            lora_name=lora_name,
        )  # fmt: skip

    def lora_requests(self) -> dict[str, Any] | None:
        """vLLM's `lora_requests_info`: the adapter slots and the adapters of running and
        of waiting requests (None: LoRA off)."""
        if not self.config.lora.enable_lora:
            return None
        s = self.scheduler
        waiting = [*s.waiting, *s.loading.values()]
        return {
            "max_lora": self.config.lora.max_loras,
            "running": sorted({r.lora_name for r in s.running if r.lora_name is not None}),
            "waiting": sorted({r.lora_name for r in waiting if r.lora_name is not None}),
        }

    def _require_lm_head(self) -> None:
        if getattr(getattr(self.runner, "model", None), "pooling_only", False):
            arch = self.config.model.architecture
            raise ValueError(
                f"this checkpoint ({arch}) has no LM head: it serves {self.pooling.serves()} only"
            )

    def add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        task: str = "embed",
    ) -> None:
        """Queue a pooling request (runner/pooling.py) of `task`, "embed" or "classify": its
        prompt runs and is pooled as the model pools; its one delta carries `embedding`
        (a classification's: the label probabilities) and nothing is generated."""
        if self.config.runner.runner != "mrv2":
            raise ValueError(f"{task} needs the mrv2 runner (got {self.runner_name!r})")
        spec = self.pooling.for_request(pooling_params, task)
        # One greedy token, never shown: the step that ends the prompt samples as usual
        # (its cost is one LM-head row), and its output is the pooled vector instead.
        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.validate(request_id, prompt_token_ids, params)
        lora_name = self.load_lora(lora_request)
        self._new_request(request_id, prompt_token_ids, params, lora_name=lora_name, pooling=spec)

    def load_lora(self, lora_request: LoRARequest | None, keep: Iterable[str] = ()) -> str | None:
        """The adapter in a device slot (runner/lora/), and its name (None: no adapter, the
        base model); one that no live request runs with and that is not in `keep` may give
        its slot up. Raises ValueError naming what is wrong with the adapter."""
        if lora_request is None:
            return None
        if not self.config.lora.enable_lora:
            raise ValueError("a lora_request needs an engine built with enable_lora=True")
        live = {r.lora_name for r in self.scheduler.requests.values()}
        live |= {r.lora_name for r, _ in self._awaiting_grammar.values()}
        evictable = set(self.runner.lora.by_name) - live - set(keep)
        self.runner.add_lora(lora_request, evictable)
        return lora_request.lora_name

    def require_paged(self, what: str) -> None:
        if self.config.runner.runner != "mrv2":
            raise ValueError(
                f"{what} moves paged KV blocks, which the {self.runner_name} runner does not "
                "have; use runner='mrv2'"
            )

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **pd: Any
    ) -> Request:
        seed = params.seed if params.seed is not None else self.next_seed()
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            bad_words=bad_word_ids(self.tokenizer, params.bad_words) if params.bad_words else (),
            **pd,
        )
        compiling = None
        if params.structured_outputs is not None:
            compiling = self.grammars.prepare(params.structured_outputs)
            if compiling.done():  # cached: no wait
                req.grammar, compiling = compiling.result(), None
        detok = (
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
            if self.tokenizer is not None
            else None
        )
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self._tracks[request_id] = Track(detok=detok, hold_back=hold)
        if compiling is not None:  # queued once its grammar is built (`_admit_compiled`)
            self._awaiting_grammar[request_id] = (req, compiling)
        else:
            self.scheduler.add_request(req)
        return req

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is built; one whose build failed ends with an
        error. A request that ended meanwhile (aborted, or finished by its first token)
        has no track left and is dropped."""
        for rid, (req, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[rid]
            if rid not in self._tracks:
                continue
            try:
                req.grammar = future.result()
            except Exception as e:  # the build's own failure: this request ends with it
                logger.warning("structured output for %s failed to compile: %s", rid, e)
                del self._tracks[rid]
                self._pending.append(RequestDelta(
                    rid, [], "", finish_reason="error", stop_reason=f"structured output: {e}",
                    num_prompt_tokens=req.num_prompt_tokens,
                ))  # fmt: skip
                continue
            self.scheduler.add_request(req)

    def abort(self, request_id: str) -> bool:
        """Abort a request at any point; its blocks are freed now and the next `step()`
        returns its final delta (finish_reason "abort"). False if it was not live."""
        waiting = self._awaiting_grammar.pop(request_id, None)
        if waiting is not None:  # its grammar is still being built: nothing else to free
            self._tracks.pop(request_id, None)
            self._pending.append(RequestDelta(
                request_id, [], "", finish_reason="abort",
                num_prompt_tokens=waiting[0].num_prompt_tokens,
            ))  # fmt: skip
            return True
        loading = request_id in self.scheduler.loading
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return self.release_held(request_id)
        if loading:
            self.kv_loader.cancel(request_id)  # its blocks are freed once the loader stops
        self._tracks.pop(request_id, None)
        self._pending.append(
            RequestDelta(
                request_id, [], "", finish_reason="abort", num_prompt_tokens=req.num_prompt_tokens
            )
        )
        return True

    def has_unfinished(self) -> bool:
        """Work left for `step()` (held blocks are not work: they wait for a release)."""
        return (
            self.scheduler.has_unfinished()
            or bool(self._pending)
            or bool(self._inflight)
            or bool(self._awaiting_grammar)
        )

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One engine step. Synchronous: schedule, run, emit. Async: schedule and launch step
        N+1, then wait for step N's tokens and emit them, so the device is never idle while
        the host plans (outputs arrive one step later).

        Async with a drafter: a draft is made from a request's last token, which is on
        the device while its step runs. A step is launched async while no request would
        draft; when one would (its tokens known so far already draft), step N's tokens are
        read first (`spec_drains`), and a step with drafts is waited for where it is
        launched (`spec_sync_steps`), as the synchronous loop waits for every step. Text
        that drafts nothing keeps async scheduling's overlap; text that drafts runs as
        the synchronous loop runs it."""
        start = time.perf_counter()
        if self._awaiting_grammar:
            self._admit_compiled()
        if self.kv_loader is not None:
            for result in self.kv_loader.poll():
                self._finish_load(result)
        deltas, self._pending = self._pending, []
        wait = 0.0
        drained = self._inflight is not None and self.scheduler.drafts_due()
        if drained:
            wait += self._wait_for(self._inflight, deltas)
            self._inflight = None
            self.stats.spec_drains += 1
        so = self.scheduler.schedule()
        for spec in so.kv_loads:
            self.kv_loader.start_load(spec)
        handle = None
        if so.num_reqs or so.finished_req_ids or so.state_copies:
            hook = self._publish(so) if self.kv_publisher is not None else None
            handle = self.runner.execute(so) if hook is None else self.runner.execute(so, hook)
        # steps to wait for now, oldest first
        ready = [self._inflight] if self._inflight is not None else []
        sync = not self.config.runner.async_scheduling
        if sync or so.spec_token_ids:
            self.stats.spec_sync_steps += not sync
            ready += [(so, handle)] if handle is not None else []
            self._inflight = None
        else:
            self._inflight = (so, handle) if so.num_reqs else None
        for r in ready:
            wait += self._wait_for(r, deltas)
        self.stalled = (
            handle is None and not ready and not drained and not deltas and self._inflight is None
        )
        self.stats.num_steps += 1
        self.stats.wait_s += wait
        self.stats.cpu_s += time.perf_counter() - start - wait
        return deltas

    def _wait_for(self, step: tuple[SchedulerOutput, Any], deltas: list[RequestDelta]) -> float:
        """Waits for `step`'s output, appends its deltas; returns the seconds waited."""
        t = time.perf_counter()
        out = step[1].get()
        waited = time.perf_counter() - t
        deltas += self._process(step[0], out)
        return waited

    def _process(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestDelta]:
        deltas = []
        row_of = {rid: i for i, rid in enumerate(out.req_ids)} if out.logprobs else None
        for rid, (first, entries) in out.prompt_logprobs.items():
            self._add_prompt_logprobs(rid, first, entries)
        live = self.scheduler.requests  # a vector of a request aborted meanwhile is dropped
        self._embeddings.update((rid, v) for rid, v in out.pooled.items() if rid in live)
        more = out.more_token_ids
        for req in self.scheduler.update_from_output(so, out):
            lp = out.logprobs[row_of[req.request_id]] if row_of is not None else None
            delta = self._process_token(req, lp)
            if more and req.request_id in more:
                delta = self._process_more(req, delta, out)
                self.stats.generation_tokens += len(delta.new_token_ids) - 1
            deltas.append(delta)
        self.stats.generation_tokens += len(deltas)  # one sampled token each
        return deltas

    def _process_more(self, req: Request, delta: RequestDelta, out: ModelRunnerOutput):
        """A drafted row's further tokens, each appended and stop-checked as if it had
        come alone (those after a stop are dropped), folded into the row's one delta."""
        lps = out.more_logprobs.get(req.request_id)
        for i, token in enumerate(out.more_token_ids[req.request_id]):
            if delta.finished:
                break
            req.append_output_token(token)
            d = self._process_token(req, lps[i] if lps else None)
            delta.new_token_ids += d.new_token_ids
            delta.new_text += d.new_text
            if d.new_logprobs:
                delta.new_logprobs = (delta.new_logprobs or []) + d.new_logprobs
            delta.finish_reason, delta.stop_reason = d.finish_reason, d.stop_reason
        return delta

    def _process_token(self, req: Request, lp: TopLogprobs | None) -> RequestDelta:
        """Detokenize, check stops, and cut the delta's text. Costs O(new text) per token:
        only the not-yet-emitted tail of the text is ever copied."""
        if req.hold_kv:
            return self._hold(req, lp)
        if req.pooling is not None:
            return self._pooled(req)
        track = self._tracks[req.request_id]
        token = req.output_token_ids[-1]
        if track.detok is None:
            # No tokenizer: no text, and no stop strings (validate refuses them), so only
            # token stops and length apply. Skips ~1 us of text slicing per token.
            decision = check_stop(req, [token], "", "", self._max_model_len)
            piece = ""
        else:
            decision, piece = next_text(req, track, token, self._max_model_len)
        finish = stop_reason = None
        if decision is not None:
            finish, stop_reason = decision.finish_reason, decision.stop_reason
        delta = RequestDelta(
            req.request_id,
            [token],
            piece,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
        )
        if lp is not None:
            delta.new_logprobs = [logprob_dict(self.tokenizer, lp)]
        if not track.first_delta_sent:
            track.first_delta_sent = True
            delta.prompt_logprobs = track.prompt_logprobs
            delta.num_cached_tokens = max(req.num_cached_tokens, 0)
            delta.queue_s = max(req.queue_s, 0.0)
        elif track.cached_revised:
            track.cached_revised = False
            delta.num_cached_tokens, delta.cached_revised = max(req.num_cached_tokens, 0), True
        if decision is not None:
            req.stop_reason = stop_reason
            status = (
                RequestStatus.FINISHED_LENGTH
                if finish == "length"
                else RequestStatus.FINISHED_STOPPED
            )
            self.scheduler.finish_request(req.request_id, status)
            del self._tracks[req.request_id]
        return delta

    def _pooled(self, req: Request) -> RequestDelta:
        """An embedding request's one delta: its vector, no tokens; it ends here."""
        delta = RequestDelta(
            req.request_id, [], "", finish_reason="stop",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0), queue_s=max(req.queue_s, 0.0),
        )  # fmt: skip
        delta.embedding = self._embeddings.pop(req.request_id, None)
        assert delta.embedding is not None, f"{req.request_id}: its prompt gave no vector"
        self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        self._tracks.pop(req.request_id, None)
        return delta

    def _add_prompt_logprobs(self, req_id: str, first: int, entries: list[TopLogprobs]) -> None:
        track = self._tracks.get(req_id)
        req = self.scheduler.requests.get(req_id)
        if track is None or req is None:
            return
        if track.prompt_logprobs is None:
            track.prompt_logprobs = [None] * req.num_prompt_tokens
        for i, entry in enumerate(entries):
            track.prompt_logprobs[first + i] = logprob_dict(self.tokenizer, entry)
