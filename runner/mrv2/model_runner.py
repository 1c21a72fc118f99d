"""The MRV2 model runner: one step is a recipe over slot state (DESIGN §3).

finish -> free -> add -> update -> apply staged writes -> prepare inputs -> forward ->
sample -> post-update. `execute` only enqueues device work and returns a handle; the
host reads the step's tokens when it calls `handle.get()` (async scheduling plans the
next step first). This file is central; keep it lean: model specifics go to ModelState,
kernels to `kernels/`, per-slot bookkeeping to RequestState, graphs to cuda_graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kernels.decode_prep import step_buffer_size
from pdserve.kernels.input_prep import post_update
from pdserve.kernels.sampling import greedy_argmax, topk_logprobs
from pdserve.runner.config import EngineConfig
from pdserve.runner.logprobs import rows_to_top_logprobs, sampled_logprobs
from pdserve.runner.lora.adapter import load_adapter
from pdserve.runner.lora.request import LoRARequest
from pdserve.runner.lora.slots import LoraSlots
from pdserve.runner.models.loader import load_model
from pdserve.runner.mrv2.cuda_graphs import CudaGraphs
from pdserve.runner.mrv2.host_ring import DeviceToHost, HostRing, PendingHost
from pdserve.runner.mrv2.input_batch import InputBatch, InputBuffers
from pdserve.runner.mrv2.kv_cache import allocate_blocks, block_bytes, choose_num_blocks
from pdserve.runner.mrv2.mamba_state import MambaModelState
from pdserve.runner.mrv2.model_state import GQAModelState, ModelState
from pdserve.runner.mrv2.pooling_state import PoolingState
from pdserve.runner.mrv2.request_state import RequestState
from pdserve.runner.mrv2.step_mailbox import StepMailbox
from pdserve.runner.runner_output import ModelRunnerOutput
from pdserve.runner.sampler import LogprobsTensors, Sampler, SamplingMetadata
from pdserve.runner.scheduler_output import SchedulerOutput
from pdserve.runner.speculative.verify import SampleRows, accepted_length, sample_rows

logger = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A step in flight: the host-side facts are known now, the device outputs later."""

    req_ids: list[str]
    sample_mask: np.ndarray  # [R] bool: rows whose sample is kept
    sampled: PendingHost | None
    logprob_ks: list[int] = field(default_factory=list)
    logprobs: tuple[PendingHost, PendingHost, PendingHost] | None = None
    prompt: list[tuple[str, int, int, tuple[PendingHost, PendingHost, PendingHost]]] = field(
        default_factory=list
    )  # (req_id, first target index, k, tensors)
    pooled: list[tuple[str, PendingHost]] = field(default_factory=list)  # embeddings
    spec: SampleRows | None = None  # a step with drafts: each row's sample rows

    def get(self) -> ModelRunnerOutput:
        if self.sampled is None:
            return ModelRunnerOutput([], [])
        sampled = self.sampled.fetch().tolist()
        lp = None
        if self.logprobs is not None:
            lp = LogprobsTensors(*(p.fetch() for p in self.logprobs))
        prompt_lps = {}
        for req_id, first, k, tensors in self.prompt:
            ids, vals, ranks = (p.fetch() for p in tensors)
            prompt_lps[req_id] = (first, rows_to_top_logprobs(ids, vals, ranks, [k] * len(ids)))
        pooled = {req_id: p.fetch().tolist() for req_id, p in self.pooled}
        if self.spec is not None:
            return self._verified(sampled, lp, prompt_lps, pooled)
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=(
                sampled  # the common case: every row caught up, no sample is discarded
                if self.sample_mask.all()
                else [t if keep else None for t, keep in zip(sampled, self.sample_mask.tolist())]
            ),
            logprobs=sampled_logprobs(lp, self.logprob_ks, self.sample_mask),
            prompt_logprobs=prompt_lps,
            pooled=pooled,
        )

    def _verified(self, sampled: list[int], lp, prompt_lps, pooled) -> ModelRunnerOutput:
        """A step with drafts: each row's first sample, and what it keeps after it."""
        rows = self.spec
        lps = (
            sampled_logprobs(lp, self.logprob_ks, rows.keep)
            if lp is not None
            else [None] * rows.num_rows
        )
        first, first_lps, more, more_lps = [], [], {}, {}
        offsets = rows.offsets.tolist()
        for r, (req_id, keep) in enumerate(zip(self.req_ids, self.sample_mask.tolist())):
            o = offsets[r]
            first.append(sampled[o] if keep else None)
            first_lps.append(lps[o])
            draft = rows.drafts.get(r)
            if draft is not None:
                a = accepted_length(draft, sampled[o : offsets[r + 1]])
                more[req_id] = sampled[o + 1 : o + 1 + a]
                more_lps[req_id] = lps[o + 1 : o + 1 + a]
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=first,
            logprobs=first_lps if lp is not None else [],
            prompt_logprobs=prompt_lps,
            pooled=pooled,
            more_token_ids=more,
            more_logprobs=more_lps if lp is not None else {},
        )


class MRV2ModelRunner:
    name = "mrv2"

    def __init__(self, config: EngineConfig, model_state: ModelState | None = None):
        self.config = config
        self.device = config.runner.torch_device
        self.block_size = config.cache.block_size
        self.model = load_model(
            config.model, self.device, fold=not config.lora.enable_lora, cache=config.cache
        )
        m = self.model
        # LoRA adapter slots (runner/lora/): each request slot's adapter, and the device
        # stacks whose per-token index each step writes before the forward
        self.lora: LoraSlots | None = None
        self.slot_lora = np.zeros(config.scheduler.max_num_seqs, dtype=np.int32)
        if config.lora.enable_lora:
            sched = config.scheduler
            self.lora = LoraSlots(
                m, config.lora.max_loras, config.lora.max_lora_rank,
                max(sched.max_num_batched_tokens, sched.max_num_seqs), config.model.dtype,
            )  # fmt: skip
        max_reqs = config.scheduler.max_num_seqs
        # Model-family state (model_state.py); a hybrid's Mamba state is allocated before
        # the KV cache is sized, so a GPU budget counts it. Its units are the scheduler's to
        # hand out (runner/state_pool.py): one a request, held past its slot in PD.
        self.num_state_units = max_reqs if getattr(m, "num_mamba_layers", 0) else 0
        # With prefix caching, as many again for half as many requests hold states saved at
        # prompts' block boundaries (runner/state_snapshots.py)
        self.num_snapshot_units = (
            max(1, max_reqs // 2)
            if self.num_state_units and config.cache.enable_prefix_caching
            else 0
        )
        self.model_state = model_state or (
            MambaModelState(
                m,
                max_reqs,
                self.num_state_units + self.num_snapshot_units,
                self.device,
                *config.cache.mamba_dtypes(config.model.dtype),
            )  # fmt: skip
            if self.num_state_units
            else GQAModelState()
        )
        if isinstance(self.model_state, MambaModelState):
            conv, ssm = m.mamba_states
            logger.info("mrv2 runner: Mamba state for %d requests and %d prefix snapshots "
                        "(%.1f MiB; conv %s, SSM %s)", self.num_state_units,
                        self.num_snapshot_units, self.model_state.bytes / 2**20,
                        str(conv.dtype).removeprefix("torch."),
                        str(ssm.dtype).removeprefix("torch."))  # fmt: skip
        # Layers with paged KV: all of them, but a hybrid's attention layers only
        kv_layers = getattr(m, "num_kv_layers", len(m.layers))
        block_shape = m.kv_block_shape(self.block_size)
        kv_dtype = config.cache.kv_dtype(config.model.dtype)
        per_block = block_bytes(kv_layers, block_shape, kv_dtype)
        max_useful = config.scheduler.max_num_seqs * config.max_blocks_per_request
        self.num_blocks = config.cache.num_blocks or choose_num_blocks(
            per_block,
            self.device,
            config.cache.kv_cache_memory_bytes,
            config.cache.gpu_memory_utilization,
            max_useful,
        )
        self.kv_cache, self.kv_caches = allocate_blocks(
            kv_layers, self.num_blocks, block_shape, kv_dtype, self.device
        )
        logger.info(
            "mrv2 runner: %d KV blocks of %d tokens (%.1f MiB, %s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * per_block / 2**20,
            str(kv_dtype).removeprefix("torch."),
        )
        self.ring = HostRing(self.device)
        self.to_host = DeviceToHost(self.device)
        self.state = RequestState(
            max_reqs,
            config.model.max_model_len + 1,
            config.max_blocks_per_request,
            config.model.vocab_size,
            self.device,
            self.ring,
        )
        # A step's rows: one a request, or with drafts one a drafted position too (each
        # runs as a decode row when the batch is all decodes: execute); a request's drafted
        # rows share its K/V reads in the decode attention (AttentionMetadata.max_run)
        self.max_run = 1 + config.num_speculative_tokens
        max_rows = max_reqs * self.max_run
        self.buffers = InputBuffers(
            max_rows,
            config.scheduler.max_num_batched_tokens,
            config.max_blocks_per_request,
            self.device,
            self.ring,
        )
        self.pooling = PoolingState(max_reqs, m.config.hidden_size, self.device)
        self.sampler = Sampler()
        self.decode_kernel = config.runner.decode_kernel
        self.graphs: CudaGraphs | None = None
        self.graph_block_appends = 0  # new blocks written by a graph's prep, not staged
        self.eager_steps = 0  # steps with tokens that ran no graph
        # steps with drafts, by how they ran: each drafted position a decode row, or flat
        self.draft_steps = {"decode_rows": 0, "flat": 0}
        sizes = config.runner.cuda_graph_sizes
        self.mailbox: StepMailbox | None = None
        if self.device.type == "cuda" and sizes:
            if config.runner.cuda_graph_scope == "step":
                self.mailbox = StepMailbox(step_buffer_size(max_rows), max_rows, self.device)
                self.buffers.mailbox = self.mailbox
            self.graphs = CudaGraphs(
                self.model,
                self.buffers,
                self.kv_caches,
                list(sizes),
                config.model.max_model_len + 1,
                self.decode_kernel,
                max_run=self.max_run,
                **(self._step_parts() if config.runner.cuda_graph_scope == "step" else {}),
                model_state=self.model_state,
            )
            self.graphs.capture()

    @torch.inference_mode()
    def execute(
        self, so: SchedulerOutput, layer_hook: Callable[[int], None] | None = None
    ) -> StepHandle:
        """One step. `layer_hook(i)` is called once decoder layer i's KV writes are queued
        (after a graph replay: for every layer at once); see runner/kv_hooks.py."""
        st = self.state
        if so.state_copies:  # a hybrid's prefix snapshots, before anything reads the units
            self.model_state.copy_units(so.state_copies)
        for req_id in so.finished_req_ids:
            slot = st.req_to_slot.get(req_id)
            st.remove(req_id)
            if slot is not None:
                self.model_state.on_remove(slot)
        for new in so.new_requests:
            slot = st.add(new)
            self.model_state.on_add(slot, new)
            if self.lora is not None:
                self.slot_lora[slot] = self.lora.index_of(new.lora_name)
            self.pooling.add(slot, new.pooling)
        for cached in so.cached_requests:
            st.update(cached)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            st.apply_staged_writes()
            return StepHandle([], np.zeros(0, dtype=bool), None)

        # map() over the dict's __getitem__ runs the 512 lookups without a Python frame each.
        slots = np.fromiter(map(st.req_to_slot.__getitem__, req_ids), np.int64, len(req_ids))
        num_scheduled = np.fromiter(
            so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids)
        )
        num_computed = st.num_computed_tokens[slots]
        seq_lens = num_computed + num_scheduled
        num_tokens = st.num_tokens[slots]
        sample_mask = seq_lens >= num_tokens  # caught up: the sample is kept
        # A step with drafts (runner/speculative/) stages them after each row's last token.
        # When every row is a decode, each drafted position becomes a decode row of its own
        # (the slot's block table, the position's length): the step is a uniform decode of
        # those rows, graphs and all, since a layer writes every row's K/V before attending.
        # Otherwise (a prompt chunk beside them) it runs eagerly, a row sampling each of its
        # drafted positions (`flat`).
        spec = flat = None
        b_slots, b_sched, b_computed, b_mask = slots, num_scheduled, num_computed, sample_mask
        if so.spec_token_ids:
            spec = self._stage_drafts(
                so.spec_token_ids, req_ids, slots, num_scheduled, seq_lens, sample_mask
            )
            # (the step buffers hold 1 + k rows a request: __init__'s max_rows)
            if (num_scheduled == spec.counts).all() and not self.pooling.any(slots):
                b_slots, b_sched = spec.slots, np.ones(spec.num_rows, dtype=np.int64)
                b_computed, b_mask = spec.positions - 1, spec.keep
                self.draft_steps["decode_rows"] += 1
            else:
                flat = spec
                self.draft_steps["flat"] += 1
        pooling = self.pooling.any(b_slots)  # embedding rows: eager (pooling_state.py)
        uniform_decode = int(b_sched.max()) == 1 and not pooling
        graph_size = (
            self.graphs.padded_size(len(b_slots))
            if (self.graphs is not None and uniform_decode)
            else None
        )
        prep_in_graph = graph_size is not None and self.graphs.prep is not None
        appends = None
        if prep_in_graph and st.block_writes.num_pending and not st.token_writes.num_pending:
            # This step's new blocks ride in the step buffer: no staged-write launch.
            appends = st.block_writes.take_appends(set(b_slots.tolist()))
            self.graph_block_appends += len(appends or ())
        st.apply_staged_writes()
        batch = self.buffers.build(
            b_slots,
            b_sched,
            b_computed,
            st.token_ids,
            st.block_table,
            self.block_size,
            b_mask,
            graph_size,
            prep_in_graph=prep_in_graph,
            block_appends=appends,
        )
        self.model_state.prepare(batch)
        if self.lora is not None:  # each token's adapter slot, for the deltas (and graphs)
            ids = np.repeat(self.slot_lora[b_slots], b_sched)
            self.ring.to_device(ids, out=self.lora.token_slots)
        # Sample rows: one a batch row, or with drafts one a drafted position too, whose
        # sampling sees the drafts before it as output (`within`): the tokens a step
        # without drafts would have had there, wherever the draft is kept.
        s_slots, s_positions, s_keep = slots, seq_lens, sample_mask
        num_outputs = num_tokens - st.num_prompt_tokens[slots]
        within = np.zeros(len(slots), dtype=np.int64)
        if spec is not None:
            s_slots, s_positions, s_keep = spec.slots, spec.positions, spec.keep
            within = np.arange(spec.num_rows) - np.repeat(spec.offsets[:-1], spec.counts)
            num_outputs = np.repeat(num_outputs, spec.counts) + within
        penalty_rows = st.sampling.penalty_rows(s_slots)
        meta = st.sampling.metadata(
            s_slots,
            s_positions,
            num_outputs,
            [st.token_history(int(s_slots[r]), int(within[r])) for r in penalty_rows] or None,
            to_device=self.ring.to_device,
            recent_tokens=lambda rows, width: st.recent_tokens(
                s_slots[rows], width, self.ring.to_device, within[rows]
            ),
            keep=s_keep,
        )
        logprobs = None
        pending = None  # the sampled ids' host copy, when the mailbox has them
        if graph_size is not None and self.graphs.has_greedy_tail and _plain_argmax(meta):
            hidden, sampled = self.graphs.replay_greedy(graph_size)
            sampled = sampled[: batch.num_reqs]
            if self.mailbox is not None:
                pending = self.mailbox.launched(batch.num_reqs)
            self._layers_done(layer_hook)
            self.model_state.post_forward(batch, hidden)
        else:
            if graph_size is not None:
                hidden = self.graphs.replay(graph_size)
                self._layers_done(layer_hook)
                logits = self.model.compute_logits(hidden[: batch.num_reqs], float32=False)
            else:
                self.eager_steps += 1
                hidden = self.model(
                    batch.input_ids,
                    batch.positions,
                    self.kv_caches,
                    batch.attn(self.decode_kernel, self.max_run),
                    layer_hook,
                )
                index = (
                    batch.logits_indices
                    if flat is None
                    else self.ring.to_device(flat.logits_indices)
                )
                logits = self.model.compute_logits(hidden[index], float32=False)
                if pooling:
                    pooled = self.pooling.collect(
                        self.model.norm, hidden, slots, batch.query_start_loc_np,
                        num_computed, sample_mask, getattr(self.model, "score", None),
                    )  # fmt: skip
            self.model_state.post_forward(batch, hidden)
            out = self.sampler(logits, meta)
            if meta.grammar is not None:
                meta.grammar.advance(out.sampled_token_ids)
            mail = None
            if prep_in_graph and self.mailbox is not None:
                mail = self.mailbox.mail_out(self.buffers.mailbox_slot, False)
            sampled, logprobs = out.sampled_token_ids, out.logprobs
            if flat is None:
                post_update(
                    batch.idx_mapping,
                    sampled,
                    batch.seq_lens[: batch.num_reqs],
                    batch.sample_mask,
                    st.token_ids,
                    mail,
                )
            else:  # every drafted position's sample goes to its place; the host keeps
                # those up to the first rejected draft (a later step overwrites the rest)
                rows = self.ring.to_device(
                    np.stack([flat.slots, flat.positions, flat.keep]).astype(np.int32)
                )
                post_update(rows[0], sampled, rows[1], rows[2], st.token_ids)
            if mail is not None:  # its prep read the mailbox; this post-update moved it on
                self.mailbox.launched()
        st.num_computed_tokens[slots] = seq_lens
        # A drafted row counts every draft as kept; the next step's CachedRequestData
        # corrects both counts (`num_tokens`) once the host knows what was kept.
        st.num_tokens[slots] += sample_mask if spec is None else sample_mask * spec.counts

        if pending is None:
            pending = self.to_host.copy(sampled)
        handle = StepHandle(req_ids, sample_mask, pending, spec=spec)
        if logprobs is not None:
            handle.logprob_ks = st.sampling.num_logprobs[s_slots].tolist()
            lp = logprobs
            handle.logprobs = (
                self.to_host.copy(lp.token_ids),
                self.to_host.copy(lp.logprobs),
                self.to_host.copy(lp.ranks),
            )
        if graph_size is None and b_slots is slots:  # decode rows only: no prompt positions
            handle.prompt = self._prompt_logprobs(req_ids, slots, batch, hidden, num_computed)
        if pooling:
            handle.pooled = [(req_ids[row], self.to_host.copy(v)) for row, v in pooled]
        return handle

    def _stage_drafts(
        self,
        drafts: dict[str, list[int]],
        req_ids: list[str],
        slots: np.ndarray,
        num_scheduled: np.ndarray,
        seq_lens: np.ndarray,
        sample_mask: np.ndarray,
    ) -> SampleRows:
        """Stage each drafted row's draft into its token history after its last token (the
        step's input prep reads them from there) and lay out the step's sample rows."""
        st, row_of = self.state, {rid: r for r, rid in enumerate(req_ids)}
        by_row = {}
        for req_id, draft in drafts.items():
            row = row_of[req_id]
            slot = int(slots[row])
            st.token_writes.stage(slot, int(st.num_tokens[slot]), draft)
            by_row[row] = draft
        return sample_rows(slots, seq_lens, np.cumsum(num_scheduled), sample_mask, by_row)

    def add_lora(self, request: LoRARequest, evictable: Iterable[str] = ()) -> None:
        """Loads `request`'s adapter into a slot (no-op when it is loaded); an adapter in
        `evictable` (no live request runs with it) may give up its slot."""
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True")
        if request.lora_name not in self.lora.by_name:
            adapter = load_adapter(request.lora_name, request.lora_path, self.lora.max_rank)
            self.lora.add(adapter, evictable)

    def steps_by_path(self) -> dict[str, int]:
        """Steps with tokens so far, by what ran them: `eager` (no graph), `cuda_graph` (a
        decode graph, then the LM head and sampler eagerly) and `cuda_graph_whole_step`
        (step scope, every row a plain argmax: one graph from the input prep to the token
        history)."""
        g = self.graphs
        return {
            "eager": self.eager_steps,
            "cuda_graph": g.replays if g is not None else 0,
            "cuda_graph_whole_step": g.tail_replays if g is not None else 0,
        }

    def reset_step_counts(self) -> None:
        """`steps_by_path` from zero (after a warm-up)."""
        self.eager_steps = 0
        if self.graphs is not None:
            self.graphs.replays = self.graphs.tail_replays = 0

    def _layers_done(self, layer_hook: Callable[[int], None] | None) -> None:
        """After a graph replay every layer's KV writes are queued at once."""
        for layer in range(len(self.kv_caches)) if layer_hook is not None else ():
            layer_hook(layer)

    def _step_parts(self) -> dict:
        """What a step-scope graph holds beyond the layers (CudaGraphs `prep`, `tail`)."""
        st, b = self.state, self.buffers

        def prep(size: int) -> None:
            b.prepare_decode(size, st.token_ids, st.block_table, self.block_size)

        return {"prep": prep, "tail": self._greedy_tail}

    def _greedy_tail(self, hidden: torch.Tensor, size: int) -> torch.Tensor:
        """The greedy tail a graph captures after the layers (CudaGraphs `tail`): every
        operand is a persistent buffer, so the graph replays it over each step's values.
        Pad rows compute a token that post-update drops (their mask entry is 0)."""
        b = self.buffers
        # Two Triton launches over R x chunks programs (~16 us of torch's argmax at R = 32):
        # launches the graph makes cost the host nothing.
        sampled = greedy_argmax(self.model.compute_logits(hidden, float32=False))
        mask = b.step_inputs[b.mask_offset : b.mask_offset + size]
        mail = self.mailbox.mail_out(b.mailbox_slot, True) if self.mailbox is not None else None
        post_update(
            b.step_inputs[:size], sampled, b.seq_lens[:size], mask, self.state.token_ids, mail
        )
        return sampled

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        slots: np.ndarray,
        batch: InputBatch,
        hidden: torch.Tensor,
        num_computed: np.ndarray,
    ):
        st, result = self.state, []
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
            targets = st.token_ids[slot, start + 1 : end + 1].long()
            k = int(wanted[row])
            tensors = topk_logprobs(logits, k, targets)
            result.append(
                (req_ids[row], start + 1, k, tuple(self.to_host.copy(t) for t in tensors))
            )
        return result


def _plain_argmax(meta: SamplingMetadata) -> bool:
    """A step the greedy tail can take: every row greedy, nothing banned or penalised (the
    sampler's metadata then carries no per-row tensor) and no logprobs wanted."""
    return meta.temperature is None and meta.max_num_logprobs is None
