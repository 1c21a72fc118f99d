"""The reference runner: any transformers causal LM, run eagerly, one request at a time.

No paging and no batching: each request keeps the model's own KV cache object and is fed
the tokens it has not computed yet. It ignores prefix-cache hits (it recomputes them),
so its results do not depend on the block bookkeeping. Slow, always works, and the
oracle the MRV2 runner is checked against. It shares the sampler and the per-slot
sampling state with the MRV2 runner, so seeded draws agree between the two.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import numpy as np
import torch

from pdserve.runner.config import EngineConfig
from pdserve.runner.logprobs import prompt_logprobs, sampled_logprobs
from pdserve.runner.runner_output import ModelRunnerOutput, ReadyHandle
from pdserve.runner.sampler import Sampler
from pdserve.runner.sampling_state import SamplingState
from pdserve.runner.scheduler_output import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)


class _Live:
    def __init__(self, new: NewRequestData, slot: int):
        self.slot = slot
        self.tokens = list(new.token_ids)
        self.num_prompt = new.num_prompt_tokens
        self.cache: Any = None  # the model's past_key_values
        self.cache_len = 0


def _dummy_model(model: Any, device: torch.device) -> torch.nn.Module:
    """transformers' model for the config, holding the same random weights the mrv2 runner
    loads under `--load-format dummy`."""
    from transformers import AutoModelForCausalLM

    from pdserve.runner.models.dummy_weights import dummy_weights

    hf = AutoModelForCausalLM.from_config(model.hf_config, dtype=model.dtype).to(device)
    state = hf.state_dict()
    with torch.no_grad():
        for name, tensor in dummy_weights(model.hf_config, model.dtype, device):
            state[name].copy_(tensor)
    return hf.eval()


class ReferenceRunner:
    name = "reference"

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.device = config.runner.torch_device
        if config.model.load_format == "dummy":  # runner/models/dummy_weights.py
            self.model = _dummy_model(config.model, self.device)
        else:
            self.model = (
                AutoModelForCausalLM.from_pretrained(
                    config.model.path,
                    dtype=config.model.dtype,
                    trust_remote_code=config.model.trust_remote_code,
                )  # fmt: skip
                .to(self.device)
                .eval()
            )
        # Blocks are bookkeeping only here (no paged memory); size them so that the
        # scheduler never preempts for lack of them.
        self.num_blocks = config.cache.num_blocks or (
            config.scheduler.max_num_seqs * config.max_blocks_per_request + 1
        )
        self.num_state_units = 0  # transformers keeps any recurrent state in its own cache
        max_reqs = config.scheduler.max_num_seqs
        self.sampling = SamplingState(max_reqs, config.model.vocab_size, self.device)
        self._free_slots = list(range(max_reqs - 1, -1, -1))
        self.live: dict[str, _Live] = {}
        self.sampler = Sampler()
        # transformers renamed `past_key_values` to `cache` in 5.2x; take whichever exists.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._steps = 0  # steps with tokens: all eager

    def steps_by_path(self) -> dict[str, int]:
        """Steps with tokens by what ran them: transformers' forward, eagerly."""
        return {"eager": self._steps}

    def reset_step_counts(self) -> None:
        self._steps = 0

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ReadyHandle:
        self._steps += bool(so.num_scheduled_tokens)
        return ReadyHandle(self._execute(so))

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            gone = self.live.pop(req_id, None)
            if gone is not None:
                self._free_slots.append(gone.slot)
        for new in so.new_requests:
            slot = self._free_slots.pop()
            self.live[new.req_id] = _Live(new, slot)
            self.sampling.add(
                slot, new.params, new.seed, new.stop_ids, new.bad_words, new.grammar,
                new.token_ids[new.num_prompt_tokens :],
            )  # fmt: skip
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])

        last_logits, seq_lens, prompt_lps = [], [], {}
        # Scheduler's computed count before this step: prefix hits for new requests, else
        # exactly what this runner has computed so far.
        computed = {n.req_id: n.num_computed_tokens for n in so.new_requests}
        for req_id in req_ids:
            live = self.live[req_id]
            before = computed.get(req_id, live.cache_len)
            end = before + so.num_scheduled_tokens[req_id]
            start = live.cache_len  # recompute anything the prefix cache claimed
            ids = torch.tensor([live.tokens[start:end]], device=self.device)
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: live.cache})
            live.cache, live.cache_len = getattr(out, self._cache_arg), end
            logits = out.logits[0].float()  # [end - start, V]
            last_logits.append(logits[-1])
            seq_lens.append(end)
            k = int(self.sampling.num_prompt_logprobs[live.slot])
            lp_start = max(start, before)
            lp_end = min(end, live.num_prompt - 1)
            if k >= 0 and lp_end > lp_start:
                targets = torch.tensor(live.tokens[lp_start + 1 : lp_end + 1], device=self.device)
                rows = logits[lp_start - start : lp_end - start]
                prompt_lps[req_id] = (lp_start + 1, prompt_logprobs(rows, targets, k))

        lives = [self.live[r] for r in req_ids]
        slots = np.array([lv.slot for lv in lives], dtype=np.int64)
        seq = np.array(seq_lens, dtype=np.int64)
        num_tokens = np.array([len(lv.tokens) for lv in lives], dtype=np.int64)
        sample_mask = seq >= num_tokens
        num_outputs = num_tokens - np.array([lv.num_prompt for lv in lives])
        pen_rows = self.sampling.penalty_rows(slots)
        histories = [
            (
                torch.tensor(lives[r].tokens[: lives[r].num_prompt], device=self.device),
                torch.tensor(lives[r].tokens[lives[r].num_prompt :], device=self.device),
            )
            for r in pen_rows
        ]
        meta = self.sampling.metadata(
            slots, seq, num_outputs, histories or None,
            recent_tokens=lambda rows, width: torch.tensor(
                [([-1] * width + lives[r].tokens)[-width:] for r in rows.tolist()],
                device=self.device,
            ),
            keep=sample_mask,
        )  # fmt: skip
        out = self.sampler(torch.stack(last_logits), meta)
        if meta.grammar is not None:
            meta.grammar.advance(out.sampled_token_ids)
        sampled = out.sampled_token_ids.tolist()
        for lv, tok, keep in zip(lives, sampled, sample_mask):
            if keep:
                lv.tokens.append(tok)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[t if keep else None for t, keep in zip(sampled, sample_mask)],
            logprobs=sampled_logprobs(
                out.logprobs, self.sampling.num_logprobs[slots].tolist(), sample_mask
            ),
            prompt_logprobs=prompt_lps,
        )
