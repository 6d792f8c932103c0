"""The mixed-adapter LoRA matmuls (Punica's idea): every token of a step gets its own adapter's low-rank update in
the same few matmuls, with no loop over requests.

A layer's slots hold A stacked as `a [S, R, in]` and B, transposed and scaled, as `bt [S, R, out]` (zero-padded to
R ranks; a fused layer's slices stacked along R). Each step gives every token a slot (`token_slots [T]`, -1 for the
base model), and the update is out[t] += (x[t] @ a[slot].T) @ bt[slot].

On CPU the slots run as one dense pair of matmuls: x against all S adapters' A at once (`[T, S * R]`), the columns of
the adapters a token does not use zeroed by a one-hot mask, then against all S adapters' B. That costs S times the
FLOPs of one adapter, but with S * R well under the hidden size it is two small GEMMs per layer, and no gather of
per-token weights (a gather-bmm: 11x slower at 32 tokens on a qkv-sized layer, `scripts/bench_lora.py --kernels`) nor a
Python loop over the step's adapters. Where oneDNN packs the layer's dtype the two GEMMs run on packed slot weights
(`add_lora_packed`, ~1.7x faster than `add_lora_masked` at 32 tokens, one thread). On CUDA the Triton kernels of
`kernels/lora_sgmv.py` read only each token's own slot.
"""

from __future__ import annotations

import torch

from tokenmill.workers.models.packed_linear import linear


class LoRAStep:
    """One step's slot per token, shared by every LoRA layer of the model; set once per step by the worker."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.token_slots: torch.Tensor | None = None  # [T] int64, -1: base; None: no token of the step uses LoRA
        self.one_hot: torch.Tensor | None = None  # [T, S, 1] in the activations' dtype (the CPU path's mask)

    def set(self, token_slots: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Use `token_slots` for the coming forward; None (no request of the step has an adapter) skips LoRA."""
        if token_slots is None:
            self.token_slots = self.one_hot = None
            return
        self.token_slots = token_slots
        self.one_hot = None
        if token_slots.device.type != "cuda":
            slots = torch.arange(self.num_slots, device=token_slots.device)
            self.one_hot = (token_slots[:, None] == slots[None, :]).to(dtype)[:, :, None]


def add_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, step: LoRAStep) -> None:
    """out [T, out] += each token's (x [T, in] @ a[slot].T) @ bt[slot], in place; nothing for base tokens."""
    if step.token_slots is None:
        return
    if x.is_cuda:
        from tokenmill.kernels.lora_sgmv import lora_expand, lora_shrink  # triton, only where CUDA runs

        lora_expand(lora_shrink(x, a, step.token_slots), bt, step.token_slots, out)
        return
    assert step.one_hot is not None
    add_lora_masked(x, out, a, bt, step.one_hot)


def add_lora_packed(
    x: torch.Tensor, out: torch.Tensor, a_packed: torch.Tensor, bt_packed: torch.Tensor, step: LoRAStep
) -> None:
    """The CPU path on oneDNN-packed slot weights (`packed_linear`): `a_packed` is A as a `[S * R, in]` linear
    weight, `bt_packed` B as an `[out, S * R]` one; packed once per adapter load, they skip MKL's per-call repacking
    (about 1.7x faster than `add_lora_masked` for a 32-token step)."""
    if step.one_hot is None:
        return
    num_tokens = x.shape[0]
    shrunk = linear(x, a_packed).view(num_tokens, step.num_slots, -1)
    shrunk.mul_(step.one_hot)
    out.add_(linear(shrunk.view(num_tokens, -1), bt_packed))


def add_lora_masked(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, one_hot: torch.Tensor
) -> None:
    """The CPU path: all slots' shrink in one matmul, masked to each token's slot, then all slots' expand."""
    num_slots, rank, in_features = a.shape
    num_tokens = x.shape[0]
    shrunk = torch.mm(x, a.view(num_slots * rank, in_features).t()).view(num_tokens, num_slots, rank)
    shrunk.mul_(one_hot)
    out.addmm_(shrunk.view(num_tokens, num_slots * rank), bt.view(num_slots * rank, -1))


def add_lora_gathered(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, token_slots: torch.Tensor
) -> None:
    """The gather-bmm alternative (each token's own A and B gathered, then batched matmuls): kept to measure the
    masked path against and as a second reference in the tests."""
    used = token_slots >= 0
    slots = token_slots.clamp(min=0)
    shrunk = torch.bmm(a[slots], x[:, :, None])  # [T, R, 1]
    delta = torch.bmm(shrunk.transpose(1, 2), bt[slots])[:, 0, :]  # [T, out]
    out.add_(delta * used[:, None].to(delta.dtype))
