"""One host-to-device copy per step: every per-step input packed into one staging buffer and sent at once.

On CPU the device is the host, so the worker's staging copies nothing; here a stand-in keeps a separate "device"
buffer on CPU (`StepStaging(separate_device=True)`), which a step's tensors are views of and which only the flush
fills, and every other way a tensor could reach the device is counted."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.runner_driver import make_runner
from tokenmill.messages import NewRequestData, RunningRequestData, SamplingParams, StepPlan
from tokenmill.workers import sampler
from tokenmill.workers.models.layers import RotaryEmbedding
from tokenmill.workers.staging import ALIGNMENT, StepStaging

CPU = torch.device("cpu")


def test_views_are_typed_aligned_and_filled_by_the_one_flush():
    staging = StepStaging(CPU, separate_device=True)
    staging.begin_step()
    ids = staging.upload(np.array([3, 1, 4]), torch.int64)
    mask = staging.upload(np.array([[True, False]]), torch.bool)
    lens = staging.upload(torch.tensor([7.5, 2.0]), torch.int32)
    for view in (ids, mask, lens):
        assert view.untyped_storage().data_ptr() == staging.device_buffer.untyped_storage().data_ptr()
        assert (view.data_ptr() - staging.device_buffer.data_ptr()) % ALIGNMENT == 0
    assert staging.num_copies == 0
    staging.flush()
    staging.flush()  # nothing new: no copy
    assert staging.num_copies == 1
    assert ids.tolist() == [3, 1, 4] and mask.tolist() == [[True, False]] and lens.tolist() == [7, 2]
    assert lens.dtype == torch.int32 and mask.shape == (1, 2)


def test_on_the_host_the_arrays_are_the_tensors_and_nothing_is_copied():
    staging = StepStaging(CPU)
    staging.begin_step()
    array = np.arange(5)
    ids = staging.upload(array, torch.int64)
    lens = staging.upload(array, torch.int32)
    assert ids.tolist() == [0, 1, 2, 3, 4]  # readable at once
    assert ids.data_ptr() == array.ctypes.data  # the array itself: not packed
    assert lens.dtype == torch.int32 and lens.tolist() == [0, 1, 2, 3, 4]
    staging.flush()
    assert staging.num_copies == 0


def test_on_the_host_numpy_converts_each_array_as_torch_would():
    """The host path converts in numpy (cheaper per call than torch's): same values, dtype and layout as `.to`."""
    staging = StepStaging(CPU)
    staging.begin_step()
    cases = [
        (np.arange(12, dtype=np.int64)[::3], torch.int32),  # strided
        (np.array([2**31 + 5, -1], dtype=np.int64), torch.int32),  # out of range: wraps as torch's cast does
        (np.array([0.1, 2.5]), torch.float32),
        (np.array([0, 3], dtype=np.uint8), torch.bool),
        (np.array([[1, 2], [3, 4]], dtype=np.int32), torch.int64),
        (np.array(7), torch.int32),  # 0-d stays 0-d
    ]
    for array, dtype in cases:
        got = staging.upload(array, dtype)
        assert got.dtype == dtype and got.is_contiguous() and got.shape == array.shape
        assert torch.equal(got, torch.from_numpy(np.array(array)).to(dtype))


def test_growing_mid_step_keeps_the_earlier_views():
    staging = StepStaging(CPU, separate_device=True, initial_bytes=128)
    staging.begin_step()
    first = staging.upload(np.arange(8), torch.int64)  # 64 bytes
    second = staging.upload(np.arange(100), torch.int64)  # does not fit: the pending bytes go out first
    staging.flush()
    assert first.tolist() == list(range(8)) and second.tolist() == list(range(100))
    assert staging.num_copies == 2  # the one step that grows pays a second copy
    staging.begin_step()
    again = staging.upload(np.arange(100), torch.int64)
    staging.flush()
    assert again.tolist() == list(range(100)) and staging.num_copies == 3


class UploadCounter:
    """Every way a host tensor could travel to the device outside the staging buffer's flush."""

    def __init__(self, monkeypatch) -> None:
        self.uploads: list[str] = []
        to, host_to_device = torch.Tensor.to, sampler._host_to_device

        def counting_to(tensor, *args, **kwargs):
            if "device" in kwargs or (args and isinstance(args[0], torch.device | str)):
                self.uploads.append(f"Tensor.to{args}")
            return to(tensor, *args, **kwargs)

        def counting_host_to_device(tensor, device):
            self.uploads.append("sampler._host_to_device")
            return host_to_device(tensor, device)

        monkeypatch.setattr(torch.Tensor, "to", counting_to)
        monkeypatch.setattr(sampler, "_host_to_device", counting_host_to_device)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
FILTERED = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.02, seed=3, max_tokens=8)


ALLOWED = range(10, 20)  # the grammar of "f" in the mixed step allows these tokens only


def plans(vocab_size: int) -> list[StepPlan]:
    """A prefill step (a greedy and a filtered request), then a mixed one (both decode while a third prefills; the
    filtered one under a grammar)."""
    words = np.zeros(-(-vocab_size // 32), dtype=np.int32)
    words[0] = sum(1 << token for token in ALLOWED)
    return [
        StepPlan(
            0,
            [
                NewRequestData("g", [5, 9, 2, 7, 1], 5, GREEDY, [3, 7], 0, 5),
                NewRequestData("f", [8, 3, 3, 6], 4, FILTERED, [11], 0, 4),
            ],
            [],
            [],
        ),  # fmt: skip
        StepPlan(
            1,
            [NewRequestData("s", [4, 4, 2, 9, 9, 1], 6, SamplingParams(temperature=1.0, seed=5), [20, 21], 0, 6)],
            [RunningRequestData("g", [], [], 5, 1), RunningRequestData("f", [], [12], 4, 1)],
            [],
            grammar_request_ids=["f"],
            grammar_bitmask=words.tobytes(),
        ),
    ]


def run_plans(runner) -> tuple[list[dict[str, int]], list[int]]:
    """Each plan's sampled tokens (a running request's new token is its last sample) and the staging copies each
    step made."""
    tokens: list[dict[str, int]] = []
    copies: list[int] = []
    last: dict[str, int] = {}
    for plan in plans(runner.vocab_size):
        running = [msgspec.structs.replace(entry, new_token_ids=[last[entry.request_id]]) for entry in plan.running]
        copies_before = runner.staging.num_copies
        result = runner.execute(msgspec.structs.replace(plan, running=running))
        copies.append(runner.staging.num_copies - copies_before)
        last.update(zip(result.request_ids, result.sampled_token_ids))
        tokens.append(dict(zip(result.request_ids, result.sampled_token_ids)))
    return tokens, copies


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_a_step_makes_one_host_to_device_copy(tiny_checkpoint, use_cpu_backend, monkeypatch, backend):
    use_cpu_backend(backend)
    path, _ = tiny_checkpoint("llama")
    expected, host_copies = run_plans(make_runner(path))  # the worker's own staging: the device is the host
    assert host_copies == [0, 0]
    runner = make_runner(path)
    runner.staging = StepStaging(CPU, separate_device=True)
    runner.inputs = dataclasses.replace(runner.inputs, staging=runner.staging)
    for module in runner.model.modules():  # start-up tables, built once (on a GPU by the profiling step): not a step's
        if isinstance(module, RotaryEmbedding):
            module.cos_sin_table()
    counter = UploadCounter(monkeypatch)
    tokens, copies = run_plans(runner)
    assert counter.uploads == [] and copies == [1, 1]
    # the step read what that one copy sent: the same tokens as through the host's own staging, the grammar's too
    assert tokens == expected and tokens[1]["f"] in ALLOWED
