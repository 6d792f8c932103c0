"""What the worker captures as CUDA graphs, and what it runs eagerly: one `CapturePlan`, built from the config at
start-up, logged, and followed by the capture (`workers/cuda_graphs.py`) and the forward (`workers/step_forward.py`).

Only decode batches are captured, one graph per batch bucket (`graph_batch_sizes`): a decode step launches the same
kernels with the same shapes whenever its padded batch size is the same. Prefill and mixed steps change shape every
step and run eagerly, as do decode batches above the largest bucket.

Under tensor parallelism the forward all-reduces twice per layer (after attention and after the MLP) and once after
the vocab-parallel embedding. We keep those collectives out of the graphs (`split_at_collectives`): each decode
graph is captured as segments that end at an all-reduce, and a replay runs segment, all-reduce, segment, ... with
the all-reduce launched eagerly in place on the segment's output (its address is fixed by the graph's memory pool).
This is vLLM's piecewise CUDA graphs, cut at the collectives instead of at attention. We chose it over capturing
the collectives with a capture-safe all-reduce (NCCL through torch.distributed inside `torch.cuda.graph`, a
symmetric-memory or custom all-reduce) because it is correct with any backend and any NCCL version, needs no
registered buffers or process-group stream handling that no GPU here has yet run (torch.distributed's all-reduce
makes CUDA calls that a capture forbids, which is why vLLM wrote its own NCCL binding for captured graphs), and
costs one graph launch per collective (2 per layer), far fewer than the eager kernels it replaces. A capture-safe
all-reduce can later drop the split without changing anything else: the plan is the one place that says which is
in force.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import EngineConfig, is_pooling_task
from tokenmill.workers.cuda_graphs import graph_batch_sizes


@dataclass(frozen=True)
class CapturePlan:
    """Which steps replay captured CUDA graphs, how a captured forward meets the collectives, and what runs eagerly."""

    batch_sizes: tuple[int, ...]  # the decode batch buckets captured, ascending; () when nothing is captured
    split_at_collectives: bool  # each captured graph is cut at every all-reduce, which runs eagerly between segments
    eager: tuple[str, ...]  # what runs eagerly, each with why

    @property
    def captures(self) -> bool:
        return bool(self.batch_sizes)

    def describe(self) -> str:
        """One start-up log line."""
        if not self.captures:
            return f"CUDA graphs: none captured; eager: {'; '.join(self.eager)}"
        segments = (
            "each graph in segments between the tensor-parallel all-reduces, which run eagerly"
            if self.split_at_collectives
            else "each graph whole (no collectives in the forward)"
        )
        return (
            f"CUDA graphs: decode batches of {list(self.batch_sizes)} sequences captured, {segments}; "
            f"eager: {'; '.join(self.eager)}"
        )


def plan_cuda_graphs(config: EngineConfig, device_type: str, pp_size: int, tp_size: int) -> CapturePlan:
    """The plan of a worker on `device_type` holding one of `pp_size` pipeline stages and `tp_size` tensor ranks."""
    off = _why_no_graphs(config, device_type, pp_size)
    if off is not None:
        return CapturePlan((), False, (f"every step ({off})",))
    sizes = tuple(graph_batch_sizes(config.scheduler.max_num_seqs))
    eager = ["prefill and mixed steps (their shapes change every step)"]
    if sizes[-1] < config.scheduler.max_num_seqs:
        eager.append(f"decode batches over {sizes[-1]} (launch overhead is small next to such a step)")
    eager.append("the LM head and the sampler (outside the graph, on the rows to sample)")
    split = tp_size > 1
    if split:
        eager.append(f"the tensor-parallel all-reduces ({tp_size} ranks), between captured segments")
    return CapturePlan(sizes, split, tuple(eager))


def _why_no_graphs(config: EngineConfig, device_type: str, pp_size: int) -> str | None:
    if device_type != "cuda":
        return f"no CUDA graphs on {device_type}"
    if config.model.enforce_eager:
        return "--enforce-eager"
    if is_pooling_task(config.model.task):
        return "a pooling model (embedding, scoring)"
    if pp_size > 1:
        return "pipeline parallelism: stages exchange hidden states between micro-batches"
    if config.lora.enable_lora:
        return "--enable-lora: a step's adapter slots are not among the captured graphs' inputs"
    return None
