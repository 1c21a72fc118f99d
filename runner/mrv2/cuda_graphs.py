"""FULL CUDA graphs for uniform decode batches (every row computes one token).

One graph per capture size, captured largest first into one shared memory pool. A graph
covers embedding -> layers over the padded batch and reads only the persistent input
buffers, whose addresses never change. The LM head runs after the replay, eagerly, on the
real rows only: keeping [size, 151,936] logits alive per graph would pin ~3 GB of the
pool for 28 sizes, against one extra GEMM launch per step. Batches are padded
explicitly to the next capture size (pad rows: zero block-table row, seq_len 0, slot -1),
which the prepare kernels already do; a model's own per-row inputs (a hybrid's Mamba state
units) come from its ModelState's persistent buffers (`capture_inputs`). Mixed and
prefill steps run eagerly.

Step scope (`--cuda-graph-scope step`: `prep` and `tail` given). Every graph first runs
`prep(size)`, the step's input prep (kernels/decode_prep.py: it reads the number of real
rows and the new block ids from the packed step buffer, so one launch serves every step
of a size and a block boundary needs no staged-write launch), and each
size gets a second graph that also runs `tail` after the layers (final norm, LM head,
argmax, post-update of the token history) for steps whose rows all take a plain argmax.
That takes ~8 launches a step off the host (5 of them Triton, ~20-30 us each on a slow
host) and their gaps off the device. The tail's logits are an intermediate of its
capture, so the shared pool holds one [size, vocab] block for all sizes, not one per
graph; only the [size] sampled ids stay pinned.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable

import torch

from pdserve.runner.models.attention_metadata import AttentionMetadata
from pdserve.runner.mrv2.input_batch import InputBuffers
from pdserve.runner.mrv2.model_state import ModelState

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, then every 32: padding wastes < 1/8 of a step."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_num_seqs] or [max_num_seqs]


def capture_sizes(
    requested: list[int] | None, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[int, ...]:
    """The sizes to capture. A decode batch has at most max_num_seqs rows and
    max_num_batched_tokens tokens, and the graphs' token buffers hold exactly the latter:
    a 256-row graph over a 128-token buffer would read and write past its end."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    sizes = requested or default_capture_sizes(limit)
    return tuple(sorted({s for s in sizes if s <= limit}))


class CudaGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        buffers: InputBuffers,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_seq_len: int,
        decode_kernel: str | None = None,  # AttentionMetadata.decode_kernel
        max_run: int = 1,  # AttentionMetadata.max_run: k + 1 with k-token drafts
        prep: Callable[[int], None] | None = None,  # size -> launch the decode input prep
        tail: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        # ^ (hidden [size, H], size) -> sampled ids [size]: the greedy tail, captured too
        model_state: ModelState | None = None,  # its capture_inputs(size), before each
    ):
        self.model = model
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len  # fixed at capture: decode grids depend on it
        self.decode_kernel = decode_kernel
        self.max_run = max_run
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.prep = prep
        self.tail = tail
        self.model_state = model_state
        self.tail_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tail_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.replays = 0  # plain replays (the LM head then runs eagerly)
        self.tail_replays = 0
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def padded_size(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        n = b.max_num_reqs
        assert size <= min(n, b.input_ids.numel()), (
            f"capture size {size} exceeds the input buffers ({n} rows, "
            f"{b.input_ids.numel()} tokens)"
        )
        attn = AttentionMetadata(
            b.step_inputs[n : n + size + 1],
            b.seq_lens[:size],
            b.block_tables[:size],
            b.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            decode_kernel=self.decode_kernel,
            row_slots=b.step_inputs[:size] if self.max_run > 1 else None,  # idx_mapping
            max_run=self.max_run,
        )
        if self.prep is not None:
            self.prep(size)
        if self.model_state is not None:
            self.model_state.capture_inputs(size)
        return self.model(b.input_ids[:size], b.positions[:size], self.kv_caches, attn)

    @torch.inference_mode()
    def capture(self, progress: Callable[[int], None] | None = None) -> None:
        b = self.buffers
        n = b.max_num_reqs
        # All-pad inputs: nothing is written to the KV cache, attention reads nothing.
        b.step_inputs[n : 2 * n + 1].copy_(torch.arange(n + 1, dtype=torch.int32))
        b.seq_lens.zero_()
        b.block_tables.zero_()
        b.slot_mapping.fill_(-1)
        b.input_ids.zero_()
        b.positions.zero_()
        b.step_inputs[b.num_reqs_index] = 0  # prep: every row a pad
        b.step_inputs[b.mask_offset :].zero_()  # the tail's post-update writes no token
        if b.mailbox is not None:  # the prep reads the pads from there
            b.mailbox.reset(b.step_inputs.cpu().numpy())
        torch.cuda.synchronize()
        # This process's allocator, not the device's free memory: a PD pair sharing the GPU
        # allocates its KV cache while the other captures (a decode worker on the H200 said
        # its graphs took 30.3 GiB, its prefill peer's 28 GiB cache and weights included).
        reserved_before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # No cyclic GC while capturing: garbage holding CUDA objects (an old engine's
        # graphs or events) freed mid-capture destroys them with CUDA calls a capture
        # forbids, which invalidates the capture (cudaErrorStreamCaptureInvalidated, seen
        # on the H200 after tests left engines in reference cycles). torch's graph context
        # collects once before each capture; nothing is collected during it.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            for size in sorted(self.sizes, reverse=True):
                # Warm-up: compiles kernels (the tail's too), settles allocator state.
                hidden = self._forward(size)
                if self.tail is not None:
                    self.tail(hidden, size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
                if self.tail is not None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self._forward(size)
                        self.tail_outputs[size] = (hidden, self.tail(hidden, size))
                    self.tail_graphs[size] = graph
                if progress is not None:
                    progress(size)
        finally:
            if gc_was_on:
                gc.enable()
        torch.cuda.synchronize()
        if b.mailbox is not None:  # the warm-ups' post-updates moved its count
            b.mailbox.reset(b.step_inputs.cpu().numpy())
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = max(0, torch.cuda.memory_reserved() - reserved_before)
        logger.info(
            "captured %d CUDA graphs (sizes %d..%d%s) in %.1f s using %.0f MiB",
            len(self.graphs) + len(self.tail_graphs),
            self.sizes[0],
            self.sizes[-1],
            ", whole steps, each also with the greedy tail" if self.tail_graphs else "",
            self.capture_seconds,
            self.memory_bytes / 2**20,
        )

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` over the current buffer contents -> [size, hidden]
        pre-norm hidden states (rows past the batch are padding)."""
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size]

    @property
    def has_greedy_tail(self) -> bool:
        return bool(self.tail_graphs)

    def replay_greedy(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the greedy-tail graph of `size` -> ([size, hidden] pre-norm hidden states,
        [size] int64 argmax ids); the tail has already written each kept row's token
        (the step buffer's sample mask) into the token history."""
        self.tail_graphs[size].replay()
        self.tail_replays += 1
        return self.tail_outputs[size]
