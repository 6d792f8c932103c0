"""CUDA graphs for decode steps: capture the model's forward once per batch size, then replay it.

A decode step (every sequence has exactly one new token) launches the same kernels with the same shapes whenever
the batch size is the same, so after the KV cache is allocated the worker captures one graph per size in
`graph_batch_sizes` (1, 2, 4, 8, ... up to max_num_seqs) and replays it instead of launching a few hundred small
kernels from Python. The graphs read their inputs from static buffers: a batch of B sequences is copied into the
first B rows and replays the graph of the smallest captured size >= B, whose padding rows write nowhere (slot -1,
which the KV-write kernel skips) and attend to nothing (seq_len 0, for which the decode kernel writes zeros). The
first B rows of the graph's output are the hidden states; the LM head and the sampler run outside the graph, on
the rows to sample only. Prefill, mixed and larger steps run eagerly, and `--enforce-eager` turns graphs off.

Capture needs the Triton decode path (`workers/triton_backend.py`), which reads only tensors, never host values.
Which sizes are captured, and whether a graph is cut at the tensor-parallel all-reduces so that they run eagerly
between its segments, is the worker's `CapturePlan` (`workers/capture_plan.py`). How a forward is captured is a
parameter (`Capture`): `cuda_graph_capture` on a GPU; tests pass one that runs eagerly, which exercises the static
buffers and the padding on CPU, or `cuda_graph_capture` with a stand-in graph object.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tokenmill.workers.attention import AttentionMetadata
from tokenmill.workers.backends import attention_backend
from tokenmill.workers.collectives import collectives_split_capture

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # as vLLM: beyond this, launch overhead is small next to the step itself

# capture(forward) -> (replay, output): after replay(), `output` holds what forward() would have returned
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]
KVCache = tuple[torch.Tensor, torch.Tensor]


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """Powers of two up to min(max_num_seqs, limit), plus that bound itself when it is not one."""
    top = min(max_num_seqs, limit)
    sizes = [1 << power for power in range(top.bit_length())]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class Graph(Protocol):
    """What capture needs of a graph: `torch.cuda.CUDAGraph`, or a stand-in in CPU tests."""

    def capture_begin(self, pool: Any = None) -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...


class Segment(NamedTuple):
    """A captured piece of a forward and the all-reduce that ends it (None for the last piece)."""

    graph: Graph
    all_reduce: tuple[torch.Tensor, ProcessGroup | None] | None


class SegmentedReplay:
    """A captured forward's replay: each segment's graph, then its all-reduce eagerly, in capture order."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments

    def __call__(self) -> None:
        for graph, collective in self.segments:
            graph.replay()
            if collective is not None:
                dist.all_reduce(collective[0], group=collective[1])


def cuda_graph_capture(
    device: torch.device, split_at_collectives: bool, new_graph: Callable[[], Graph] | None = None
) -> Capture:
    """Capture on `device` into one memory pool shared by every graph (they never run at the same time); with
    `split_at_collectives` (the `CapturePlan` under tensor parallelism) as segments cut at each all-reduce.
    `new_graph` stands in for `torch.cuda.CUDAGraph` in CPU tests (no pool, stream or synchronisation off CUDA)."""
    on_cuda = device.type == "cuda"
    pool = torch.cuda.graph_pool_handle() if on_cuda else None
    # capture never runs on the default stream (as torch.cuda.graph does)
    stream = torch.cuda.Stream(device) if on_cuda else None  # type: ignore[no-untyped-call]
    make_graph: Callable[[], Graph] = new_graph or torch.cuda.CUDAGraph

    def capture(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        forward()  # warm-up outside the graph: Triton compiles its kernels, cuBLAS picks its algorithms
        if on_cuda:
            torch.cuda.synchronize(device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            segments, output = capture_segments(forward, make_graph, pool, split_at_collectives)
        return SegmentedReplay(segments), output

    return capture


def capture_segments(
    forward: Callable[[], torch.Tensor], make_graph: Callable[[], Graph], pool: Any, split_at_collectives: bool
) -> tuple[list[Segment], torch.Tensor]:
    """Record `forward` into graphs: one, or with `split_at_collectives` one per stretch between all-reduces (the
    all-reduce itself is not run while capturing: every rank skips it alike, and replay runs it)."""
    segments: list[Segment] = []
    graph = make_graph()

    def end_segment(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
        nonlocal graph
        graph.capture_end()
        segments.append(Segment(graph, (tensor, group)))
        graph = make_graph()
        graph.capture_begin(pool=pool)

    graph.capture_begin(pool=pool)
    with collectives_split_capture(end_segment) if split_at_collectives else contextlib.nullcontext():
        output = forward()
    graph.capture_end()
    segments.append(Segment(graph, None))
    return segments, output


class DecodeGraphs:
    """Static decode inputs and one captured forward per batch size; `run` replays the one that fits a batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: Sequence[KVCache],
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        capture: Capture,
    ):
        self.batch_sizes = sorted(batch_sizes)
        self.block_size = block_size
        self.attention = attention_backend(device.type)
        max_batch = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        for size in reversed(self.batch_sizes):  # largest first, so the smaller graphs reuse its memory

            def forward(size: int = size) -> torch.Tensor:
                hidden: torch.Tensor = model(
                    self.input_ids[:size], self.positions[:size], self._metadata(size), kv_caches
                )
                return hidden

            self._graphs[size] = capture(forward)

    def _metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata over the first `size` rows of the static buffers (a decode-only batch)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            is_decode_only=True,
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
            block_size=self.block_size,
            decode=None,
            prefills=[],
            backend=self.attention,
        )

    def can_run(self, attn: AttentionMetadata) -> bool:
        return (
            attn.is_decode_only
            and 0 < attn.num_tokens <= self.batch_sizes[-1]
            and attn.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def padded_size(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds `num_seqs` sequences."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Hidden states `[B, hidden]` of a decode batch that `can_run`, by replaying the graph of its padded size."""
        num_seqs = input_ids.shape[0]
        size = self.padded_size(num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(attn.slot_mapping)
        self.seq_lens[:num_seqs].copy_(attn.seq_lens)
        self.block_tables[:num_seqs, : attn.block_tables.shape[1]].copy_(attn.block_tables)
        if num_seqs < size:  # padding rows keep stale (valid) ids, positions and block tables; these make them inert
            self.slot_mapping[num_seqs:size].fill_(-1)
            self.seq_lens[num_seqs:size].fill_(0)
        replay, output = self._graphs[size]
        replay()
        return output[:num_seqs]
