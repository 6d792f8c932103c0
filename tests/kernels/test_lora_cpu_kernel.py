"""The native CPU LoRA kernel (`kernels/lora_cpu.cpp`) against a float64 reference: ranks 8, 16 and 64, several slot
groups of uneven sizes, fused slices expanded into their own columns, empty slots, base-model rows left untouched,
strided rows, one thread and several, and bfloat16 / float16 within their rounding; each on every x86 ISA build
(`TOKENMILL_CPU_ISA=avx2` builds it without AVX-512)."""

from __future__ import annotations

import platform

import pytest
import torch

from tests.helpers.cpu_isa import CPU_ISAS
from tokenmill.kernels import cpu_ops, lora_cpu
from tokenmill.kernels.lora_cpu import LoRAWeights, SlotRows


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert lora_cpu.library() is not None, "the CPU LoRA kernel did not build (see the warning in the log)"


@pytest.fixture(autouse=True, params=CPU_ISAS)
def isa(request, monkeypatch):
    """Every test runs on the kernel as the machine builds it and as an AVX2 machine would (`lora_add` calls
    `lora_cpu.library()`, pointed here at that build)."""
    if request.param != "native":
        if platform.machine().lower() not in ("x86_64", "amd64"):
            pytest.skip(f"TOKENMILL_CPU_ISA={request.param} selects an x86 build")
        monkeypatch.setenv("TOKENMILL_CPU_ISA", request.param)
        lib = lora_cpu.library_built_with(cpu_ops.native_flags())
        monkeypatch.setattr(lora_cpu, "library", lambda: lib)
    return request.param


@pytest.fixture
def threads():
    """`threads(n)` sets torch's (and so the kernel's) OpenMP thread count until the test ends."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _weights(num_slots: int, rank: int, in_features: int, widths: list[int], dtype: torch.dtype):
    """Random A and per-slice B blocks `[S, R, width_i]`, and the same in the kernel's layout."""
    a = torch.randn(num_slots, len(widths) * rank, in_features) / in_features**0.5
    blocks = [torch.randn(num_slots, rank, width) / rank**0.5 for width in widths]
    columns = [0]
    for width in widths:
        columns.append(columns[-1] + width)
    weights = LoRAWeights.of(a.to(dtype), columns, rank)
    weights.write_b([block.to(dtype) for block in blocks])
    return a, blocks, weights


def _reference(x: torch.Tensor, a: torch.Tensor, blocks: list[torch.Tensor], token_slots: list[int]) -> torch.Tensor:
    """float64 `[T, out]`: token by token, each slice's (x @ A_i[slot].T) @ B_i[slot] in its own columns."""
    rank = blocks[0].shape[1]
    delta = torch.zeros(x.shape[0], sum(block.shape[2] for block in blocks), dtype=torch.float64)
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        first = 0
        for index, block in enumerate(blocks):
            a_slice = a[slot, index * rank : (index + 1) * rank].double()
            delta[row, first : first + block.shape[2]] = (x[row].double() @ a_slice.t()) @ block[slot].double()
            first += block.shape[2]
    return delta


TOKEN_SLOTS = {
    "uneven groups, slots unused, base rows between": [2, 2, -1, 2, -1, 0, 2, 2, 2, 2, -1],
    "one adapter": [3] * 5,
    "every slot, every row an adapter's": [1, 0, 3, 2, 0, 1, 2, 3] * 4,
    "a long prefill of two adapters and the base": [0] * 37 + [-1] * 9 + [3] * 24,
    "decode: groups of one and two tokens": [0, 1, 2, 3, 1, -1, 3],
}


@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize(
    "widths", [[40, 16, 16], [130, 130], [72], [100, 64]], ids=["qkv", "gate_up", "single", "partial-tile"]
)
@pytest.mark.parametrize("case", list(TOKEN_SLOTS))
@pytest.mark.parametrize("num_threads", [1, 2])
def test_kernel_matches_the_float64_reference(rank, widths, case, num_threads, threads):
    threads(num_threads)
    torch.manual_seed(rank + len(widths))
    token_slots = TOKEN_SLOTS[case]
    a, blocks, weights = _weights(4, rank, 96, widths, torch.float32)
    x = torch.randn(len(token_slots), 96)
    out = torch.randn(len(token_slots), sum(widths))
    before = out.clone()
    slots = torch.tensor(token_slots)
    lora_cpu.lora_add(x, out, weights, SlotRows.of(slots, 4))
    torch.testing.assert_close((out - before).double(), _reference(x, a, blocks, token_slots), atol=1e-5, rtol=1e-4)
    assert out[slots < 0].equal(before[slots < 0]), "a base-model row changed"


@pytest.mark.parametrize("in_features", [20, 77, 1000])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_inputs_past_the_last_full_vector(in_features, weight_dtype):
    """The shrink's tail after its last full vector (8 lanes on AVX2, 16 on AVX-512): input sizes that no lane width
    divides, and output slices past the last full expand block."""
    torch.manual_seed(in_features)
    token_slots = TOKEN_SLOTS["uneven groups, slots unused, base rows between"]
    a, blocks, weights = _weights(4, 16, in_features, [70, 24], weight_dtype)
    # the reference reads what the kernel reads: the weights rounded to their dtype
    a, blocks = a.to(weight_dtype).float(), [block.to(weight_dtype).float() for block in blocks]
    x = torch.randn(len(token_slots), in_features)
    out = torch.zeros(len(token_slots), 94)
    lora_cpu.lora_add(x, out, weights, SlotRows.of(torch.tensor(token_slots), 4))
    torch.testing.assert_close(out.double(), _reference(x, a, blocks, token_slots), atol=1e-5, rtol=1e-4)


def test_a_step_of_base_rows_only_changes_nothing():
    _, _, weights = _weights(2, 8, 32, [24], torch.float32)
    out = torch.randn(3, 24)
    before = out.clone()
    lora_cpu.lora_add(torch.randn(3, 32), out, weights, SlotRows.of(torch.tensor([-1, -1, -1]), 2))
    assert out.equal(before)


def test_strided_rows_read_and_write_only_their_columns():
    """x and out as column slices of wider tensors (a fused layer's output view): the other columns stay as they
    were."""
    torch.manual_seed(0)
    token_slots = [1, -1, 0, 1, 1]
    a, blocks, weights = _weights(2, 16, 48, [32, 8, 8], torch.float32)
    x_wide, out_wide = torch.randn(5, 64), torch.randn(5, 100)
    x, out = x_wide[:, 8:56], out_wide[:, 20:68]
    before = out_wide.clone()
    lora_cpu.lora_add(x, out, weights, SlotRows.of(torch.tensor(token_slots), 2))
    expected = _reference(x, a, blocks, token_slots)
    torch.testing.assert_close((out - before[:, 20:68]).double(), expected, atol=1e-5, rtol=1e-4)
    assert out_wide[:, :20].equal(before[:, :20]) and out_wide[:, 68:].equal(before[:, 68:])


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_half_precision_tensors_accumulate_in_float32(dtype, tolerance):
    torch.manual_seed(1)
    token_slots = [0, 1, -1, 2, 0, 1]
    a, blocks, weights = _weights(3, 16, 64, [48, 48], dtype)
    x = torch.randn(len(token_slots), 64)
    out = torch.zeros(len(token_slots), 96, dtype=dtype)
    lora_cpu.lora_add(x.to(dtype), out, weights, SlotRows.of(torch.tensor(token_slots), 3))
    rounded = [block.to(dtype) for block in blocks]
    expected = _reference(x.to(dtype), a.to(dtype), rounded, token_slots)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_slot_rows_group_tokens_by_slot_in_token_order():
    rows = SlotRows.of(torch.tensor([2, -1, 0, 2, 0, -1]), 4)
    assert rows.order.tolist() == [2, 4, 0, 3]
    assert rows.offsets.tolist() == [0, 2, 2, 4, 4]


@pytest.mark.parametrize(("weight_dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("widths", [[40, 16, 16], [72], [20]], ids=["qkv", "single", "partial-block"])
def test_float32_activations_over_half_precision_slots_match_the_float64_reference(weight_dtype, tolerance, widths):
    """`--lora-dtype bfloat16` / `float16` under a float32 model: the kernel reads the narrow weights, accumulates and
    writes float32; against the reference on the same rounded weights the only error is float32 summation's, and
    against the unrounded weights it is within the weight dtype's rounding."""
    torch.manual_seed(2)
    token_slots = [0, 1, -1, 2, 0, 1, 1, 1, 2]
    a, blocks, weights = _weights(3, 16, 64, widths, weight_dtype)
    x = torch.randn(len(token_slots), 64)
    out = torch.randn(len(token_slots), sum(widths))
    before = out.clone()
    lora_cpu.lora_add(x, out, weights, SlotRows.of(torch.tensor(token_slots), 3))
    assert out.dtype == torch.float32
    rounded = _reference(x, a.to(weight_dtype), [block.to(weight_dtype) for block in blocks], token_slots)
    torch.testing.assert_close((out - before).double(), rounded, atol=1e-5, rtol=1e-4)
    exact = _reference(x, a, blocks, token_slots)
    torch.testing.assert_close((out - before).double(), exact, atol=tolerance, rtol=tolerance)
    assert out[torch.tensor(token_slots) < 0].equal(before[torch.tensor(token_slots) < 0])


def test_writing_one_slot_lays_out_only_that_slot():
    """`write_b(blocks, slot)` after an adapter load: that slot's tiles equal a full layout of the new blocks, every
    other slot's bytes stay as they were (an adapter loaded beside running ones must not touch their weights)."""
    torch.manual_seed(3)
    _, blocks, weights = _weights(3, 8, 32, [130, 24], torch.float32)
    before = weights.b.clone()
    changed = [block.clone() for block in blocks]
    for block in changed:
        block[1] = torch.randn_like(block[1])
    weights.write_b(changed, slot=1)
    _, _, fresh = _weights(3, 8, 32, [130, 24], torch.float32)
    fresh.write_b(changed)
    assert weights.b[1].equal(fresh.b[1]) and not weights.b[1].equal(before[1])
    assert weights.b[0].equal(before[0]) and weights.b[2].equal(before[2])
