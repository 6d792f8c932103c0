"""The mixture-of-experts grouped GEMM against a float64 torch reference: random shapes, odd token counts, experts
that get no token, and the alignment's invariants."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import moe_grouped_gemm as moe_module
from tokenmill.kernels.moe_grouped_gemm import BLOCK_M, grouped_gemm, moe_align, moe_experts, moe_experts_ref

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}


def random_routing(num_tokens: int, num_experts: int, top_k: int, unused: set[int], generator) -> torch.Tensor:
    """topk_ids `[T, top_k]`: distinct experts per token, never one in `unused`."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    scores = torch.rand(num_tokens, len(allowed), generator=generator)
    return allowed[scores.topk(top_k, dim=-1).indices]


def make_case(num_tokens, num_experts, top_k, hidden, inter, dtype, seed, unused=frozenset()):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, dtype=torch.float64) / inter**0.5
    ids = random_routing(num_tokens, num_experts, top_k, set(unused), g)
    weights = torch.rand(num_tokens, top_k, generator=g, dtype=torch.float64)
    weights /= weights.sum(-1, keepdim=True)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, hidden, inter, unused",
    [
        (1, 4, 2, 64, 32, {0, 3}),  # one decode token
        (7, 8, 2, 48, 40, {1, 5, 6}),  # odd everything, dims that are not powers of two
        (33, 6, 3, 80, 24, {2}),  # more than one tile for some experts
        (19, 5, 1, 32, 72, set()),  # top-1, a K loop over several blocks
    ],
)
def test_moe_experts_match_float64_reference(num_tokens, num_experts, top_k, hidden, inter, unused, dtype):
    x, w13, w2, ids, weights = make_case(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=num_tokens)
    expected = moe_experts_ref(x, w13, w2, ids, weights)
    got = moe_experts(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights.float())
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    torch.testing.assert_close(got.double(), expected, **TOLERANCES[dtype])


def test_grouped_gemm_alone_with_weights_and_strided_input():
    x, w13, _, ids, weights = make_case(11, 5, 2, 40, 24, torch.float32, seed=3, unused={4})
    wide = torch.randn(11, 100, dtype=torch.float64)
    wide[:, 30:70] = x
    align = moe_align(ids, 5)
    out = torch.full((22, 48), float("nan"))
    grouped_gemm(wide[:, 30:70].float(), w13.float(), align, 2, out, pair_weights=weights.float())
    pairs = torch.arange(22)
    expected = torch.einsum("ph,pnh->pn", x[pairs // 2], w13[ids.reshape(-1)]) * weights.reshape(-1, 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)  # every pair written (no NaN left)


def test_alignment_groups_pairs_by_expert_in_whole_tiles():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 0], [1, 3]])  # expert 2 gets nothing
    align = moe_align(ids, 4)
    num_padded = int(align.num_padded)
    counts = [4, 2, 0, 5]  # per expert (0, 1, 2, 3)
    assert num_padded == sum(-(-c // BLOCK_M) * BLOCK_M for c in counts)
    sorted_ids = align.sorted_pair_ids[:num_padded]
    real = sorted_ids[sorted_ids < align.num_pairs]
    assert sorted(real.tolist()) == list(range(10))  # every pair exactly once
    tile_of_row = torch.arange(num_padded) // BLOCK_M
    experts_of_rows = align.tile_experts[tile_of_row][sorted_ids < align.num_pairs]
    assert experts_of_rows.tolist() == ids.reshape(-1)[real.long()].tolist()  # each tile holds one expert's pairs
    assert 2 not in align.tile_experts[: num_padded // BLOCK_M].tolist()
    assert (align.sorted_pair_ids[num_padded:] == align.num_pairs).all()


def test_no_tokens_launches_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("an empty batch must not launch a kernel")

    monkeypatch.setattr(moe_module, "_grouped_gemm_kernel", NoLaunch())
    out = moe_experts(
        torch.empty(0, 32),
        torch.randn(4, 16, 32),
        torch.randn(4, 32, 8),
        torch.empty(0, 2, dtype=torch.long),
        torch.empty(0, 2),
    )
    assert out.shape == (0, 32)


_COMPILE_SCRIPT = """
import sys
from triton.backends.compiler import GPUTarget
from tests.kernels.cuda_compile_check import TYPES, compile_kernel
from tokenmill.kernels import moe_grouped_gemm as m

for capability in (80, 90):
    for dtype, weights in [("bf16", True), ("fp16", False), ("fp32", True)]:
        ptr = TYPES[dtype]
        pointers = {"a_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "sorted_ids_ptr": "*i32", "tile_experts_ptr": "*i32",
                    "num_padded_ptr": "*i32", "pair_weights_ptr": "*fp32"}
        constexprs = dict(ROWS_PER_PAIR=8 if weights else 1, BLOCK_M=m.BLOCK_M, BLOCK_N=64, BLOCK_K=64,
                          HAS_WEIGHTS=weights, IEEE_DOT=dtype == "fp32")
        compiled = compile_kernel(m._grouped_gemm_kernel, GPUTarget("cuda", capability, 32), pointers, constexprs)
        assert compiled.asm.get("cubin")
        print(f"sm_{capability} moe {dtype}: ok")
"""


def test_grouped_gemm_compiles_for_nvidia_targets():
    """The interpreter accepts what the GPU compiler may not: compile to cubins (no GPU needed), without it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=repo_root
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok") == 6, result.stdout
