"""The MRV2 model runner: one step is a recipe over slot state (DESIGN §3).

finish -> free -> add -> update -> apply staged writes -> prepare inputs -> forward ->
sample -> post-update. This file is central; keep it lean: model specifics go to
ModelState, kernels to `kernels/`, per-slot bookkeeping to RequestState.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pdserve.kernels.input_prep import post_update
from pdserve.runner.config import EngineConfig
from pdserve.runner.logprobs import prompt_logprobs, sampled_logprobs
from pdserve.runner.models.loader import load_model
from pdserve.runner.mrv2.input_batch import InputBatch, InputBuffers
from pdserve.runner.mrv2.kv_cache import allocate_kv_cache, bytes_per_block, choose_num_blocks
from pdserve.runner.mrv2.model_state import GQAModelState, ModelState
from pdserve.runner.mrv2.request_state import RequestState
from pdserve.runner.runner_output import ModelRunnerOutput, TopLogprobs
from pdserve.runner.sampler import Sampler
from pdserve.runner.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class MRV2ModelRunner:
    name = "mrv2"

    def __init__(self, config: EngineConfig, model_state: ModelState | None = None):
        self.config = config
        self.device = config.runner.torch_device
        self.block_size = config.cache.block_size
        self.model = load_model(config.model, self.device)
        m = self.model
        per_block = bytes_per_block(
            len(m.layers), self.block_size, m.num_kv_heads, m.head_dim, config.model.dtype
        )
        max_useful = config.scheduler.max_num_seqs * config.max_blocks_per_request
        self.num_blocks = config.cache.num_blocks or choose_num_blocks(
            per_block,
            self.device,
            config.cache.kv_cache_memory_bytes,
            config.cache.gpu_memory_utilization,
            max_useful,
        )
        self.kv_cache, self.kv_caches = allocate_kv_cache(
            len(m.layers),
            self.num_blocks,
            self.block_size,
            m.num_kv_heads,
            m.head_dim,
            config.model.dtype,
            self.device,
        )
        logger.info(
            "mrv2 runner: %d KV blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * per_block / 2**20,
        )
        max_reqs = config.scheduler.max_num_seqs
        self.state = RequestState(
            max_reqs,
            config.model.max_model_len + 1,
            config.max_blocks_per_request,
            config.model.vocab_size,
            self.device,
        )
        self.buffers = InputBuffers(
            max_reqs,
            config.scheduler.max_num_batched_tokens,
            config.max_blocks_per_request,
            self.device,
        )
        self.model_state = model_state or GQAModelState()
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        st = self.state
        for req_id in so.finished_req_ids:
            slot = st.req_to_slot.get(req_id)
            st.remove(req_id)
            if slot is not None:
                self.model_state.on_remove(slot)
        for new in so.new_requests:
            self.model_state.on_add(st.add(new))
        for cached in so.cached_requests:
            st.update(cached)
        st.apply_staged_writes()
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])

        slots = np.array([st.req_to_slot[r] for r in req_ids], dtype=np.int64)
        num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64)
        num_computed = st.num_computed_tokens[slots].copy()
        batch = self.buffers.build(
            slots, num_scheduled, num_computed, st.token_ids, st.block_table, self.block_size
        )
        self.model_state.prepare(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        self.model_state.post_forward(batch, hidden)
        logits = self.model.compute_logits(hidden[batch.logits_indices])

        seq_lens = batch.seq_lens_np
        sample_mask = seq_lens >= st.num_tokens[slots]
        num_outputs = st.num_tokens[slots] - st.num_prompt_tokens[slots]
        penalty_rows = st.sampling.penalty_rows(slots)
        meta = st.sampling.metadata(
            slots,
            seq_lens,
            num_outputs,
            [st.token_history(int(slots[r])) for r in penalty_rows] if len(penalty_rows) else None,
        )
        out = self.sampler(logits, meta)
        mask = torch.from_numpy(sample_mask).to(self.device)
        post_update(batch.idx_mapping, out.sampled_token_ids, batch.seq_lens, mask, st.token_ids)
        st.num_computed_tokens[slots] = seq_lens
        st.num_tokens[slots] += sample_mask

        prompt_lps = self._prompt_logprobs(req_ids, slots, batch, hidden, num_computed)
        sampled = out.sampled_token_ids.tolist()  # the one device->host sync of the step
        row_lps = sampled_logprobs(
            out.logprobs, self.state.sampling.num_logprobs[slots].tolist(), sample_mask
        )
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[t if keep else None for t, keep in zip(sampled, sample_mask)],
            logprobs=row_lps,
            prompt_logprobs=prompt_lps,
        )

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        slots: np.ndarray,
        batch: InputBatch,
        hidden: torch.Tensor,
        num_computed: np.ndarray,
    ) -> dict[str, tuple[int, list[TopLogprobs]]]:
        st, result = self.state, {}
        wanted = st.sampling.num_prompt_logprobs[slots]
        for row in np.nonzero(wanted >= 0)[0]:
            slot, start = int(slots[row]), int(num_computed[row])
            # Targets are prompt tokens start+1 .. min(seq_len, P-1): the logits at position
            # p score the prompt token at p + 1.
            end = min(int(batch.seq_lens_np[row]), int(st.num_prompt_tokens[slot]) - 1)
            if end <= start:
                continue
            first = int(batch.query_start_loc_np[row])
            logits = self.model.compute_logits(hidden[first : first + end - start])
            targets = st.token_ids[slot, start + 1 : end + 1]
            result[req_ids[row]] = (start + 1, prompt_logprobs(logits, targets, int(wanted[row])))
        return result
