"""Kernels warm at start-up: before the worker reports ready, dummy steps launch every Triton kernel kind a step can
use (here through the interpreter on CPU), write no KV and leave the outputs as they were."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from tests.helpers.runner_driver import run_greedy
from tests.helpers.triton_runner import NUM_BLOCKS, force_triton_on_cpu, make_runner
from tokenmill.config import EngineConfig
from tokenmill.kernels.split_kv_decode import choose_num_splits
from tokenmill.messages import Shutdown, WorkerReady, decoder, encode
from tokenmill.workers import backends, process, triton_backend, warm_up
from tokenmill.workers.warm_up import warm_up_steps

STEP_KERNELS = {"_write_kv_kernel", "_rms_norm_kernel", "_rotary_kernel", "_prefill_kernel", "_split_kv_partial_kernel"}


@pytest.fixture
def triton_on_cpu(monkeypatch):
    force_triton_on_cpu(monkeypatch)
    yield
    backends.device_kernels.cache_clear()


@pytest.fixture
def launches(monkeypatch) -> Counter:
    """Every Triton kernel launch, by kernel name (the interpreter's launch entry point)."""
    counts: Counter = Counter()
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    return counts


def test_warm_up_launches_every_kernel_kind_and_writes_no_kv(tiny_checkpoint, triton_on_cpu, launches, caplog):
    path, _ = tiny_checkpoint("llama")
    runner = make_runner(path, max_num_seqs=2)
    for k_cache, v_cache in runner.kv_caches:  # stale but finite contents, as a busy cache holds
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    assert not launches
    with caplog.at_level(logging.INFO, logger="tokenmill.workers.worker"):
        runner.warm_up_kernels()
    assert STEP_KERNELS <= set(launches), launches
    assert "warmed up the Triton kernels" in caplog.text and " s" in caplog.text
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):  # every slot was -1: nothing written
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_warm_up_leaves_the_outputs_as_they_were(tiny_checkpoint, triton_on_cpu):
    path, hf_model = tiny_checkpoint("qwen3")
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 9)]
    outputs = []
    for warm in (False, True):
        runner = make_runner(path, max_num_seqs=2)
        if warm:
            runner.warm_up_kernels()
        outputs.append(run_greedy(runner, prompts, 3, num_blocks=NUM_BLOCKS, chunk_size=4, arrival_steps=[0, 1]))
    assert outputs[0] == outputs[1]


def test_no_warm_up_where_nothing_compiles(tiny_checkpoint, use_cpu_backend, launches, monkeypatch):
    use_cpu_backend("kernels")
    ran: list[object] = []
    monkeypatch.setattr(warm_up.DummyStepRunner, "run", lambda self, step: ran.append(step))
    path, _ = tiny_checkpoint("llama")
    make_runner(path).warm_up_kernels()
    assert ran == [] and not launches


def test_decode_steps_cover_every_split_count_the_rule_can_choose():
    steps = warm_up_steps(256, 8192, 8192, num_kv_heads=8, num_sms=132)
    decode_contexts = [step.seq_lens[0] for step in steps if step.query_lens == (1,)]
    splits = [choose_num_splits(1, 8, context, 132) for context in decode_contexts]
    most = choose_num_splits(1, 8, 8192, 132)
    assert most > 1 and splits == list(range(1, most + 1))
    # any decode step of this device and model picks one of them
    assert all(choose_num_splits(b, 8, c, 132) <= most for b in (1, 3, 40) for c in (1, 700, 8192))
    kinds = {(len(step.query_lens), max(step.query_lens)) for step in steps}
    assert {(2, 17), (1, 16), (2, 1), (16, 1)} <= kinds  # mixed, prefill-only, and decode batches of 2 and 16


def test_warm_up_steps_fit_the_limits():
    for step in warm_up_steps(1, 8, 32, num_kv_heads=2, num_sms=triton_backend.INTERPRETER_SM_COUNT):
        assert len(step.query_lens) == 1 and sum(step.query_lens) <= 8 and max(step.seq_lens) <= 32


class _Socket:
    def __init__(self, incoming: list[bytes], sent: list[bytes]) -> None:
        self.incoming, self.sent = incoming, sent

    def recv(self) -> bytes:
        return self.incoming.pop(0)

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)


def test_the_worker_reports_ready_only_after_warm_up(monkeypatch):
    events: list[str] = []
    sent: list[bytes] = []

    class Worker:  # the start-up calls serve_worker makes, recorded
        weight_bytes, device, dtype, architecture, eos_token_ids, vocab_size = 0, "cpu", "float32", "x", [], 8
        kv_sliding_window = None
        prompt_logprobs_row_cost = 0.0
        replayed_step = (0, 0)

        def load_model(self) -> None:
            events.append("load")

        def num_kv_blocks_for_budget(self) -> int:
            return 4

        def allocate_kv_cache(self, num_blocks: int) -> None:
            events.append("allocate")

        def warm_up_kernels(self) -> None:
            events.append("warm up")

        def capture_cuda_graphs(self) -> None:
            events.append("capture")

    def socket(ctx, config, name, kind, bind):
        return _Socket([encode(Shutdown())], sent) if name == "plans" else _Socket([], sent)

    monkeypatch.setattr(process, "make_worker", lambda config, rank: Worker())
    monkeypatch.setattr(process, "worker_socket", socket)
    original_send = _Socket.send
    monkeypatch.setattr(_Socket, "send", lambda self, frame: (events.append("ready"), original_send(self, frame)))
    process.serve_worker(EngineConfig(), 0, logging.getLogger("test"))
    assert events == ["load", "allocate", "warm up", "capture", "ready"]
    assert isinstance(decoder(WorkerReady).decode(sent[0]), WorkerReady)
