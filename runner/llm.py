"""`LLM`: the offline API (vLLM's names), driving one `Engine` until a batch is done.

    llm = LLM()                                   # bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    outs = llm.chat([{"role": "user", "content": "Hi"}])

Every prompt of a call is validated before any is queued: a bad one raises `ValueError`
and nothing of that call runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.runner.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    run_searches,
)
from pdserve.runner.config_resolve import resolve_engine_config
from pdserve.runner.engine import Engine
from pdserve.runner.generation_defaults import sampling_defaults
from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestDelta,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pdserve.runner.parallel_sampling import child_params
from pdserve.runner.pooling import PoolingParams
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.structured.patterns import compile_spec

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        runner: str = "auto",
        seed: int = 0,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        **engine_kwargs: Any,
    ):
        self.config = resolve_engine_config(
            model=model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            runner=runner,
            seed=seed,
            **engine_kwargs,
        )
        # vLLM's: what `generate` without sampling params uses (checked before the load).
        self._defaults = sampling_defaults(
            generation_config, Path(self.config.model.path), override_generation_config or {}
        )
        self.engine = Engine(self.config)
        self._ids = itertools.count()

    @property
    def runner_name(self) -> str:
        return self.engine.runner_name

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's rule: the model's generation config (`generation_config="auto"`), a
        folder's, or none (`"vllm"`), under `override_generation_config`; what `generate`
        uses when given no sampling params."""
        return SamplingParams(**self._defaults)

    # ---- prompts ---------------------------------------------------------------------------

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tok = self.engine.tokenizer
            if tok is None:
                raise ValueError(
                    "text prompts need a tokenizer; this model has none: pass "
                    "{'prompt_token_ids': [...]} instead"
                )
            return prompt, list(tok(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._to_token_ids(prompt["prompt"])
        raise ValueError(
            "a prompt must be a string, {'prompt': str} or "
            f"{{'prompt_token_ids': [...]}} (got {type(prompt).__name__})"
        )

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `generate`; `priority`, one per prompt, needs an engine built with
        scheduling_policy="priority" (lower runs first); `lora_request`, one for all or one
        per prompt (None: the base model), an engine built with enable_lora=True."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _per_prompt(sampling_params, SamplingParams, len(prompts), "sampling params")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(
                    f"got {len(priority)} priorities for {len(prompts)} prompts: one per prompt"
                )
            params_list = [
                dataclasses.replace(p, priority=v) for p, v in zip(params_list, priority)
            ]
        loras = _per_prompt(lora_request, LoRARequest, len(prompts), "lora requests")
        wanted = {lr.lora_name: lr for lr in loras if lr is not None}
        if len(wanted) > self.config.lora.max_loras:
            raise ValueError(
                f"{len(wanted)} LoRA adapters in one call; the engine holds max_loras="
                f"{self.config.lora.max_loras} at once"
            )
        for lora in wanted.values():  # a bad adapter fails here, before anything is queued
            self.engine.load_lora(lora, keep=wanted)
        # Validate everything before queuing anything.
        jobs = []
        for prompt, params, lora in zip(prompts, params_list, loras):
            text, ids = self._to_token_ids(prompt)
            parent = f"llm-{next(self._ids)}"
            base_seed = params.seed if params.seed is not None else self.engine.next_seed()
            children = [(f"{parent}#{i}", p) for i, p in enumerate(child_params(params, base_seed))]
            for child_id, p in children:
                self.engine.validate(child_id, ids, p)
                if p.structured_outputs is not None:
                    # The DFA now (cached), so that one that cannot be built raises here;
                    # a serving engine builds it beside its steps.
                    compile_spec(p.structured_outputs)
            jobs.append((parent, text, ids, children, lora))
        outputs: dict[str, RequestOutput] = {}
        child_to_parent: dict[str, tuple[str, int]] = {}
        for parent, text, ids, children, lora in jobs:
            outputs[parent] = RequestOutput(
                parent, text, ids, [CompletionOutput(i, "", []) for i in range(len(children))]
            )
            for i, (child_id, p) in enumerate(children):
                self.engine.add_request(child_id, ids, p, lora_request=lora)
                child_to_parent[child_id] = (parent, i)
        self._run(outputs, child_to_parent, use_tqdm)
        return [outputs[parent] for parent, *_ in jobs]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's: the `params.beam_width` best beams of each prompt, one engine step of
        one-token asks a generated token (runner/beam_search.py)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        eos, max_len = frozenset(self.engine.eos_token_ids), self.config.model.max_model_len
        searches = [BeamSearch(self._to_token_ids(p)[1], params, eos, max_len) for p in prompts]
        step = params.step_params()

        def ask(token_lists: list[list[int]]) -> list[list[tuple[int, float, int]]]:
            outs = self.generate([{"prompt_token_ids": t} for t in token_lists], step,
                                 use_tqdm=False, lora_request=lora_request)  # fmt: skip
            return [[(t, lp.logprob, lp.rank) for t, lp in o.outputs[0].logprobs[0].items()]
                    for o in outs]  # fmt: skip

        bar = _progress(use_tqdm, params.max_tokens, "Beam search", "token")
        try:
            run_searches(searches, ask, bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        tok = self.get_tokenizer()
        skip = not params.include_stop_str_in_output
        return [s.answer(lambda ids: tok.decode(ids, skip_special_tokens=skip)) for s in searches]

    def _run(
        self,
        outputs: dict[str, RequestOutput],
        child_to_parent: dict[str, tuple[str, int]],
        use_tqdm: bool,
    ) -> None:
        remaining = len(child_to_parent)
        bar = _progress(use_tqdm, remaining, "Generating", "req")
        try:
            while remaining:
                deltas = self.engine.step()
                if self.engine.stalled:
                    # Nothing ran (e.g. a structured-output grammar is still being built
                    # on its thread): yield the GIL to it instead of spinning.
                    time.sleep(0.001)
                for delta in deltas:
                    if delta.request_id not in child_to_parent:
                        continue
                    parent, index = child_to_parent[delta.request_id]
                    self._apply(outputs[parent], index, delta)
                    if delta.finished:
                        remaining -= 1
                        if bar is not None:
                            bar.update(1)
            while self.engine.has_unfinished():  # async: retire the step still in flight
                self.engine.step()
        except BaseException:
            for child_id in child_to_parent:
                self.engine.abort(child_id)  # leave the engine clean for the next call
            raise
        finally:
            if bar is not None:
                bar.close()

    @staticmethod
    def _apply(out: RequestOutput, index: int, delta: RequestDelta) -> None:
        comp = out.outputs[index]
        comp.token_ids.extend(delta.new_token_ids)
        comp.text += delta.new_text
        if delta.new_logprobs is not None:
            comp.logprobs = (comp.logprobs or []) + delta.new_logprobs
            for tok, lp_dict in zip(delta.new_token_ids, delta.new_logprobs):
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + lp_dict[tok].logprob
        if delta.prompt_logprobs is not None and index == 0:
            out.prompt_logprobs = delta.prompt_logprobs
        if index == 0 and (delta.num_cached_tokens or delta.cached_revised):
            out.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            comp.finish_reason = delta.finish_reason
            comp.stop_reason = delta.stop_reason
            out.finished = all(c.finish_reason is not None for c in out.outputs)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `embed`: each prompt's final hidden states pooled as the model pools them
        (runner/pooling.py: a Sentence-Transformers checkpoint's pooling and normalising,
        else the last token's, normalised; `dimensions` on a Matryoshka model)."""
        done = self._pool(prompts, pooling_params, "embed", use_tqdm, lora_request)
        return [
            EmbeddingRequestOutput(
                rid, ids, EmbeddingOutput(d.embedding), True, d.num_cached_tokens
            )
            for rid, ids, d in done
        ]  # fmt: skip

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's `classify`, for a sequence classifier (runner/classify.py): each prompt's
        label probabilities (`PoolingParams(activation=False)`: the raw logits)."""
        done = self._pool(prompts, pooling_params, "classify", use_tqdm, lora_request)
        return [
            ClassificationRequestOutput(rid, ClassificationOutput(d.embedding), ids)
            for rid, ids, d in done
        ]

    def _pool(self, prompts, params, task: str, use_tqdm: bool, lora_request):
        """Run pooling requests of `task` to the end: [(request id, prompt ids, delta)]."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        jobs = [(f"{task}-{next(self._ids)}", self._to_token_ids(p)[1]) for p in prompts]
        for request_id, ids in jobs:  # validated as it is added; a refusal stops the rest
            try:
                self.engine.add_pooling_request(request_id, ids, params, lora_request, task)
            except BaseException:
                for queued, _ in jobs:
                    self.engine.abort(queued)
                raise
        vectors: dict[str, RequestDelta] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            desc = "Embedding" if task == "embed" else "Classifying"
            bar = tqdm(total=len(jobs), desc=desc, unit="req", dynamic_ncols=True)
        try:
            while len(vectors) < len(jobs):
                for delta in self.engine.step():
                    if delta.embedding is not None:
                        vectors[delta.request_id] = delta
                        if bar is not None:
                            bar.update(1)
            while self.engine.has_unfinished():  # async: retire the step still in flight
                self.engine.step()
        except BaseException:
            for request_id, _ in jobs:
                self.engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [(rid, ids, vectors[rid]) for rid, ids in jobs]

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `score`, one text against many or pairs of equal-length lists: for an
        embedding model the cosine similarity of their embeddings; for a cross-encoder (a
        one-label classifier) its probability on each pair, prompted as the tokenizer
        joins a pair (`tokenizer(text_1, text_pair=text_2)`)."""
        left = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
        right = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        if not right or len(left) not in (1, len(right)):
            raise ValueError("text_1 must be one text or as many as text_2 (at least one)")
        firsts = left * len(right) if len(left) == 1 else left
        if self.engine.pooling.task == "classify":
            pairs = [self._pair_prompt(a, b) for a, b in zip(firsts, right, strict=True)]
            outs = self.classify(pairs, None, use_tqdm, lora_request)
            scores = [o.outputs.probs[0] for o in outs]
        else:
            vecs = self.embed(left + right, PoolingParams(normalize=True), use_tqdm, lora_request)
            vectors = [o.outputs.embedding for o in vecs]
            mine = vectors[: len(left)] * (len(right) if len(left) == 1 else 1)
            scores = [_dot(a, b) for a, b in zip(mine, vectors[len(left) :], strict=True)]
        return [ScoringRequestOutput(f"score-{next(self._ids)}", ScoringOutput(x)) for x in scores]

    def _pair_prompt(self, a: PromptType, b: PromptType) -> dict:
        """A cross-encoder's prompt for one pair: the tokenizer's pair encoding of two texts."""
        labels = self.engine.pooling.classifier.num_labels
        if labels != 1:
            raise ValueError(f"score needs a classifier with one label (this one has {labels})")
        tok = self.engine.tokenizer
        if tok is None or not (isinstance(a, str) and isinstance(b, str)):
            raise ValueError("a cross-encoder scores pairs of texts, with the model's tokenizer")
        return {"prompt_token_ids": list(tok(a, text_pair=b).input_ids)}

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(
                conv,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
            )
            ids = tok(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _per_prompt(value: Any, single: type, n: int, what: str) -> list:
    """One value for all `n` prompts (or None), or a sequence of one per prompt."""
    if value is None or isinstance(value, single):
        return [value] * n
    out = list(value)
    if len(out) != n:
        raise ValueError(f"got {len(out)} {what} for {n} prompts: pass one, or one per prompt")
    return out


def _dot(a: list[float], b: list[float]) -> float:
    return float(sum(x * y for x, y in zip(a, b, strict=True)))


def _progress(on: bool, total: int, desc: str, unit: str) -> Any:
    """A tqdm bar over `total` units, or None when `on` is False."""
    if not on:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
