"""The CUDA-graph capture plan (issue 26, item 7): decode buckets captured, prefill and mixed steps eager, and under
tensor parallelism no all-reduce inside a captured graph. The capture itself runs on CPU in a world of one (gloo)
with the tensor-parallel all-reduce forced on, the kernels through the Triton interpreter and a stand-in graph
object that records what happens while it "captures"."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers.triton_runner import BLOCK_SIZE, make_runner
from tokenmill.config import EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig, replace
from tokenmill.workers import backends, collectives, worker
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.capture_plan import plan_cuda_graphs
from tokenmill.workers.cuda_graphs import SegmentedReplay, cuda_graph_capture
from tokenmill.workers.models.layers import TensorParallel


class GraphRecorder:
    """Stand-in graphs (`new_graph`) and a log of captures, replays and all-reduces, each all-reduce marked with
    whether a graph was capturing when it ran."""

    def __init__(self) -> None:
        self.capturing: FakeGraph | None = None
        self.graphs: list[FakeGraph] = []
        self.events: list[str] = []
        self.all_reduces_in_capture = 0

    def new_graph(self) -> FakeGraph:
        graph = FakeGraph(self, len(self.graphs))
        self.graphs.append(graph)
        return graph

    def all_reduce(self, original):
        def recorded(tensor, group=None, **kwargs):
            self.all_reduces_in_capture += self.capturing is not None
            self.events.append("all_reduce")
            return original(tensor, group=group, **kwargs)

        return recorded


class FakeGraph:
    """The forward runs for real while it "captures" (on CPU nothing can be recorded); replay only logs."""

    def __init__(self, recorder: GraphRecorder, index: int) -> None:
        self.recorder = recorder
        self.index = index
        self.captured = False

    def capture_begin(self, pool=None) -> None:
        assert self.recorder.capturing is None and not self.captured, "one capture at a time, once per graph"
        self.recorder.capturing = self

    def capture_end(self) -> None:
        assert self.recorder.capturing is self
        self.recorder.capturing, self.captured = None, True

    def replay(self) -> None:
        assert self.captured
        self.recorder.events.append(f"graph {self.index}")


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(backends, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    backends.device_kernels.cache_clear()
    yield
    backends.device_kernels.cache_clear()


@pytest.fixture
def forced_tensor_parallel(monkeypatch):
    """A gloo world of one in which every TensorParallel all-reduce runs as under TP > 1 (through
    `workers/collectives.py`), each one recorded; yields the recorder."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    recorder = GraphRecorder()
    monkeypatch.setattr(dist, "all_reduce", recorder.all_reduce(dist.all_reduce))

    def forced_all_reduce(self: TensorParallel, partial: torch.Tensor) -> torch.Tensor:
        collectives.all_reduce(partial, self.group)
        return partial

    monkeypatch.setattr(TensorParallel, "all_reduce", forced_all_reduce)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    yield recorder
    dist.destroy_process_group()


def captured_runner(tiny_checkpoint, recorder: GraphRecorder, monkeypatch, tp_size: int):
    """A worker on CPU whose `capture_cuda_graphs` follows the plan of a CUDA worker with `tp_size` ranks."""
    path, _ = tiny_checkpoint("llama")
    runner = make_runner(path, max_num_seqs=4)
    monkeypatch.setattr(runner, "capture_plan", lambda: plan_cuda_graphs(runner.config, "cuda", 1, tp_size))
    monkeypatch.setattr(
        worker,
        "cuda_graph_capture",
        lambda device, split: cuda_graph_capture(device, split, new_graph=recorder.new_graph),
    )
    runner.capture_cuda_graphs()
    return runner


def decode_metadata(runner, num_seqs: int, query_len: int = 1):
    seq_lens = np.full(num_seqs, 6)
    block_tables = np.arange(num_seqs * 2).reshape(num_seqs, 2)
    return build_attention_metadata(
        np.full(num_seqs, query_len),
        seq_lens,
        block_tables,
        BLOCK_SIZE,
        runner.device,
        backends.attention_backend("cpu"),
    )


def test_tensor_parallel_capture_keeps_every_all_reduce_between_segments(
    tiny_checkpoint, triton_on_cpu, forced_tensor_parallel, monkeypatch, caplog
):
    recorder = forced_tensor_parallel
    with caplog.at_level(logging.INFO, logger="tokenmill.workers.worker"):
        runner = captured_runner(tiny_checkpoint, recorder, monkeypatch, tp_size=2)
    plan = runner.capture_plan()
    assert plan.split_at_collectives and plan.batch_sizes == (1, 2, 4)
    assert plan.describe() in caplog.messages  # the plan, logged as the worker starts
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.batch_sizes == list(plan.batch_sizes)
    num_layers = runner.model.num_layers
    assert recorder.events.count("all_reduce") > 0  # the warm-up forwards reduced for real
    assert recorder.all_reduces_in_capture == 0
    for size in plan.batch_sizes:
        replay, _ = graphs._graphs[size]
        assert isinstance(replay, SegmentedReplay)
        # cut twice per layer (the embedding's all-reduce, under real TP > 1 a third cut, skips a world of one)
        assert len(replay.segments) == 2 * num_layers + 1
        assert [s.all_reduce is None for s in replay.segments] == [False] * (2 * num_layers) + [True]
        assert all(segment.graph.captured for segment in replay.segments)

    recorder.events.clear()
    attn = decode_metadata(runner, 3)
    assert graphs.can_run(attn) and graphs.padded_size(3) == 4
    with torch.inference_mode():
        graphs.run(torch.tensor([5, 6, 7]), torch.tensor([5, 5, 5]), attn)
    segments = graphs._graphs[4][0].segments
    expected = []
    for segment in segments:  # each segment replayed, then its all-reduce, eagerly
        expected.append(f"graph {segment.graph.index}")
        expected += ["all_reduce"] if segment.all_reduce is not None else []
    assert recorder.events == expected and recorder.all_reduces_in_capture == 0


def test_prefill_and_mixed_steps_run_eagerly(tiny_checkpoint, triton_on_cpu, forced_tensor_parallel, monkeypatch):
    runner = captured_runner(tiny_checkpoint, forced_tensor_parallel, monkeypatch, tp_size=2)
    graphs = runner.decode_graphs
    assert graphs is not None
    assert not graphs.can_run(decode_metadata(runner, 2, query_len=3))  # a prefill
    mixed = build_attention_metadata(
        np.array([1, 4]), np.array([6, 4]), np.array([[0, 1], [2, 3]]), BLOCK_SIZE, runner.device, graphs.attention
    )
    assert not graphs.can_run(mixed)
    assert not graphs.can_run(decode_metadata(runner, 5))  # over the largest bucket


def test_the_check_sees_collectives_a_whole_graph_would_capture(
    tiny_checkpoint, triton_on_cpu, forced_tensor_parallel, monkeypatch
):
    # the plan of a single rank does not split: were there all-reduces in its forward, they would be captured
    recorder = forced_tensor_parallel
    runner = captured_runner(tiny_checkpoint, recorder, monkeypatch, tp_size=1)
    assert not runner.capture_plan().split_at_collectives
    assert recorder.all_reduces_in_capture == 3 * 2 * runner.model.num_layers  # 3 buckets, 2 per layer


def plan_config(max_num_seqs: int = 48, **model) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(**model),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        parallel=ParallelConfig(device="cpu"),
    )


def test_the_plan_from_the_config():
    single = plan_cuda_graphs(plan_config(), "cuda", 1, 1)
    assert single.batch_sizes == (1, 2, 4, 8, 16, 32, 48) and not single.split_at_collectives
    assert "prefill and mixed steps" in single.describe() and "all-reduce" not in single.describe()
    tensor_parallel = plan_cuda_graphs(plan_config(), "cuda", 1, 4)
    assert tensor_parallel.batch_sizes == single.batch_sizes and tensor_parallel.split_at_collectives
    assert "all-reduces (4 ranks), between captured segments" in tensor_parallel.describe()
    large = plan_cuda_graphs(plan_config(max_num_seqs=1024), "cuda", 1, 1)
    assert large.batch_sizes[-1] == 512 and "decode batches over 512" in large.describe()
    for plan, why in [
        (plan_cuda_graphs(plan_config(), "cpu", 1, 1), "no CUDA graphs on cpu"),
        (plan_cuda_graphs(plan_config(enforce_eager=True), "cuda", 1, 2), "--enforce-eager"),
        (plan_cuda_graphs(plan_config(task="embed"), "cuda", 1, 1), "a pooling model"),
        (plan_cuda_graphs(plan_config(task="score"), "cuda", 1, 1), "a pooling model"),
        (plan_cuda_graphs(plan_config(), "cuda", 2, 1), "pipeline parallelism"),
        (plan_cuda_graphs(replace(plan_config(), lora=LoRAConfig(enable_lora=True)), "cuda", 1, 1), "--enable-lora"),
    ]:
        assert not plan.captures and not plan.split_at_collectives
        assert why in plan.describe()
