"""Mixed-adapter LoRA matmuls (Punica's SGMV) in Triton: shrink `s = x @ A[slot].T`, then expand
`out += s @ Bt[slot]`, each token with its own adapter slot (-1: the base model, no update).

Adapters live in slots: `a [S, R, in]`, `bt [S, R, out]` (B transposed, its scale folded in; `workers/lora/`).
A program owns one (slot, block of 16 tokens, block of outputs) and multiplies with `tl.dot` only the tokens of its
block that use its slot; a program whose block has none of them does nothing. A step's rows are grouped by request,
so a block is mostly one adapter's, and no sort of the tokens by slot is needed: each token is written by exactly the
programs of its own slot, so no two programs write the same element. Sums are float32 (`input_precision="ieee"`:
no TF32 rounding of float32 models).

`lora_delta_ref` is the float64 reference the kernels are tested against (TRITON_INTERPRET=1 without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 16


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    s_ptr,
    num_tokens,
    K,
    R,
    stride_x_row,
    stride_a_slot,
    stride_a_rank,
    stride_s_row,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_slots = tl.load(slots_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    mine = token_slots == slot
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        rows = offs_t.to(tl.int64)
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rows[:, None] * stride_x_row + offs_k[None, :],
                mask=mine[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            a = tl.load(
                a_base + offs_r[None, :] * stride_a_rank + offs_k[:, None],
                mask=(offs_r[None, :] < R) & (offs_k[:, None] < K),
                other=0.0,
            )  # [BLOCK_K, BLOCK_R]: A[slot] transposed
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        tl.store(
            s_ptr + rows[:, None] * stride_s_row + offs_r[None, :], acc, mask=mine[:, None] & (offs_r[None, :] < R)
        )


@triton.jit
def _expand_kernel(
    s_ptr,
    bt_ptr,
    slots_ptr,
    out_ptr,
    num_tokens,
    R,
    N,
    stride_s_row,
    stride_bt_slot,
    stride_bt_rank,
    stride_out_row,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    slot = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_slots = tl.load(slots_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    mine = token_slots == slot
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        rows = offs_t.to(tl.int64)
        bt_base = bt_ptr + slot.to(tl.int64) * stride_bt_slot
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            s = tl.load(
                s_ptr + rows[:, None] * stride_s_row + offs_r[None, :],
                mask=mine[:, None] & (offs_r[None, :] < R),
                other=0.0,
            )
            b = tl.load(
                bt_base + offs_r[:, None] * stride_bt_rank + offs_n[None, :],
                mask=(offs_r[:, None] < R) & (offs_n[None, :] < N),
                other=0.0,
            )
            acc += tl.dot(s, b.to(tl.float32), input_precision="ieee")
        out_ptrs = out_ptr + rows[:, None] * stride_out_row + offs_n[None, :]
        out_mask = mine[:, None] & (offs_n[None, :] < N)
        current = tl.load(out_ptrs, mask=out_mask, other=0.0)
        tl.store(out_ptrs, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_rows(tensor: torch.Tensor, what: str) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(f"{what} must have contiguous rows (last stride 1)")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """float32 `[T, R]`: row t is x[t] @ a[token_slots[t]].T, zero where the slot is -1."""
    num_tokens, in_features = x.shape
    num_slots, rank, _ = a.shape
    _check_rows(x, "x")
    a = a.contiguous()
    shrunk = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return shrunk
    block_r = max(16, min(64, triton.next_power_of_2(rank)))
    grid = (num_slots, triton.cdiv(num_tokens, BLOCK_TOKENS), triton.cdiv(rank, block_r))
    _shrink_kernel[grid](
        x, a, token_slots, shrunk, num_tokens, in_features, rank,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_T=BLOCK_TOKENS, BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    return shrunk


def lora_expand(shrunk: torch.Tensor, bt: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] += shrunk[t] @ bt[token_slots[t]] in place (in out's dtype, summed in float32); rows of slot -1 kept."""
    num_tokens, out_features = out.shape
    num_slots, rank, _ = bt.shape
    _check_rows(out, "out")
    bt = bt.contiguous()
    if num_tokens == 0:
        return
    grid = (num_slots, triton.cdiv(num_tokens, BLOCK_TOKENS), triton.cdiv(out_features, 64))
    _expand_kernel[grid](
        shrunk, bt, token_slots, out, num_tokens, rank, out_features,
        shrunk.stride(0), bt.stride(0), bt.stride(1), out.stride(0),
        BLOCK_T=BLOCK_TOKENS, BLOCK_N=64, BLOCK_R=16,
    )  # fmt: skip


def lora_delta_ref(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """float64 `[T, out]`: each token's (x @ a[slot].T) @ bt[slot], token by token; zero rows for slot -1."""
    delta = torch.zeros(x.shape[0], bt.shape[2], dtype=torch.float64)
    for row, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            delta[row] = (x[row].double().cpu() @ a[slot].double().cpu().t()) @ bt[slot].double().cpu()
    return delta
