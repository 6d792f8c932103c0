"""The mixed-adapter LoRA matmuls (Punica's idea): every token of a step gets its own adapter's low-rank update in
the same few matmuls, with no loop over requests.

A layer's slots hold A stacked as `a [S, R, in]` and B, transposed and scaled, as `bt [S, R, out]` (zero-padded to
R ranks; a fused layer's slices stacked along R). Each step gives every token a slot (`token_slots [T]`, -1 for the
base model), and the update is out[t] += (x[t] @ a[slot].T) @ bt[slot].

On CPU the native kernel of `kernels/lora_cpu.py` runs each layer's update in one call (the step's tokens grouped
by slot once, `LoRAStep.rows`). Where it is not built or turned off, `add_lora_grouped` runs in torch: the step's
adapter tokens are grouped by slot once per step (`SlotGroups`, reused by every layer), each group padded to the
largest, and every used slot's A and B multiply only its own tokens in one batched matmul: one adapter's FLOPs
instead of all slots', base tokens and unused slots skipped, a fused layer's slices expanded into their own columns
(not through the block-diagonal B). Measured against the earlier paths (kept
here for `scripts/bench_lora.py --kernels` and as references in the tests): the dense masked pair of GEMMs over all
slots (`add_lora_masked`, and `add_lora_packed` on oneDNN-packed weights), and a per-token gather-bmm (11x slower at
32 tokens). Uneven groups pad toward the masked path's cost (all tokens on one slot but one: S x the rows). On CUDA
the Triton kernels of `kernels/lora_sgmv.py` read only each token's own slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

import torch

from tokenmill.kernels import lora_cpu
from tokenmill.kernels.lora_cpu import SlotRows
from tokenmill.workers.models.packed_linear import linear


class SlotGroups:
    """A step's adapter tokens grouped by slot, computed once per step and reused by every LoRA layer: the slots
    some token uses (`used`, None: all), each group padded to the largest group's `rows` so that all groups run as
    one batched matmul. Grouped row i is token `gather[i]` (a padding row repeats some token); token t's result is
    grouped row `scatter[t]`, kept where `lora_tokens` (None: every token has an adapter) is 1, the base's tokens 0."""

    def __init__(self, token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> None:
        counts = torch.bincount(token_slots + 1, minlength=num_slots + 1)[1:]
        used = torch.nonzero(counts).flatten()
        self.used: torch.Tensor | None = None if len(used) == num_slots else used
        self.rows = int(counts.max())
        tokens = torch.nonzero(token_slots >= 0).flatten()
        tokens = tokens[torch.argsort(token_slots[tokens], stable=True)]  # by slot, then by position
        group_of_slot = torch.zeros(num_slots, dtype=torch.int64).index_put_((used,), torch.arange(len(used)))
        group = group_of_slot[token_slots[tokens]]
        group_start = (torch.cumsum(counts[used], 0) - counts[used])[group]  # each token's group's first in `tokens`
        grouped_row = group * self.rows + torch.arange(len(tokens)) - group_start
        self.gather = torch.full((len(used) * self.rows,), int(tokens[0]), dtype=torch.int64)
        self.gather[grouped_row] = tokens
        self.scatter = torch.zeros(len(token_slots), dtype=torch.int64).index_put_((tokens,), grouped_row)
        every_token = len(tokens) == len(token_slots)
        self.lora_tokens = None if every_token else (token_slots >= 0).to(dtype)[:, None]


class LoRAStep:
    """One step's slot per token, shared by every LoRA layer of the model; set once per step by the worker. The CPU
    paths' groupings of the tokens (`rows` for the native kernel, `groups` for the torch path, `one_hot` for the
    masked path the benchmark and tests compare) are built on first use within the step, so a step builds only the
    one its layers read."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.token_slots: torch.Tensor | None = None  # [T] int64, -1: base; None: no token of the step uses LoRA
        self.dtype = torch.float32  # the activations'
        self._rows: SlotRows | None = None
        self._groups: SlotGroups | None = None
        self._one_hot: torch.Tensor | None = None
        # A recorded CPU step's grouping (`workers/cpu_graphs.py`): fixed buffers whose addresses the recorded kernel
        # calls hold; each replayed step stages its own grouping into them (`stage`). None until `record_staged`.
        self.staged: SlotRows | None = None

    def record_staged(self, max_tokens: int) -> None:
        """Make the coming forwards (a recording) run the native kernel on the staged grouping, every layer reading
        the same buffers (of up to `max_tokens` tokens; no adapter token until a step is staged)."""
        if self.staged is None or self.staged.order.shape[0] < max_tokens:
            self.staged = SlotRows(
                torch.zeros(max_tokens, dtype=torch.int64), torch.zeros(self.num_slots + 1, dtype=torch.int64)
            )
        self.staged.offsets.zero_()
        self._rows, self._groups, self._one_hot = self.staged, None, None
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64)  # a step with LoRA, as far as layers see

    def stage(self, token_slots: torch.Tensor | None) -> None:
        """A recorded step's grouping of `token_slots` (None: no adapter token) into the staged buffers."""
        assert self.staged is not None, "record_staged first"
        if token_slots is None:
            self.staged.offsets.zero_()
            return
        rows = SlotRows.of(token_slots, self.num_slots)
        self.staged.order[: rows.order.shape[0]].copy_(rows.order)
        self.staged.offsets.copy_(rows.offsets)

    def set(self, token_slots: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Use `token_slots` for the coming forward; None (no request of the step has an adapter) skips LoRA."""
        self._rows = self._groups = self._one_hot = None
        self.dtype = dtype
        if token_slots is None or not bool((token_slots >= 0).any()):
            self.token_slots = None
            return
        self.token_slots = token_slots

    @property
    def rows(self) -> SlotRows | None:
        """The native CPU kernel's grouping (`kernels/lora_cpu.py`); None on CUDA, without adapter tokens, or where
        the kernel is not built or turned off (`TOKENMILL_CPU_KERNELS=0`: the torch path runs)."""
        if self._rows is None and self._on_cpu(self.token_slots) and lora_cpu.enabled():
            self._rows = SlotRows.of(self.token_slots, self.num_slots)
        return self._rows

    @property
    def groups(self) -> SlotGroups | None:
        """The torch CPU path's tokens grouped by slot; None on CUDA or without adapter tokens."""
        if self._groups is None and self._on_cpu(self.token_slots):
            self._groups = SlotGroups(self.token_slots, self.num_slots, self.dtype)
        return self._groups

    @property
    def one_hot(self) -> torch.Tensor | None:
        """[T, S, 1] in the activations' dtype: the masked path's mask; None on CUDA or without adapter tokens."""
        if self._one_hot is None and self._on_cpu(self.token_slots):
            slots = torch.arange(self.num_slots, device=self.token_slots.device)
            self._one_hot = (self.token_slots[:, None] == slots[None, :]).to(self.dtype)[:, :, None]
        return self._one_hot

    @staticmethod
    def _on_cpu(token_slots: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
        return token_slots is not None and token_slots.device.type != "cuda"


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
    """The CPU path: all slots' shrink in one matmul, masked to each token's slot, then all slots' expand (in the
    activations' dtype, whatever the slots')."""
    a, bt = a.to(x.dtype), bt.to(x.dtype)
    num_slots, rank, in_features = a.shape
    num_tokens = x.shape[0]
    shrunk = torch.mm(x, a.view(num_slots * rank, in_features).t()).view(num_tokens, num_slots, rank)
    shrunk.mul_(one_hot)
    out.addmm_(shrunk.view(num_tokens, num_slots * rank), bt.view(num_slots * rank, -1))


def add_lora_grouped(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt_slices: list[BSlice], groups: SlotGroups
) -> None:
    """The CPU path on tokens grouped by slot: each used slot's A and B multiply only its own tokens (one batched
    matmul over the groups), so the FLOPs are one adapter's, not all slots'. A fused layer shrinks once against its
    slices' concatenated A (q/k/v share x) and expands each slice into its own output columns, not through a
    block-diagonal B. The results return to token order by a gather (`scatter`): an index_add_ is 10x slower. Slots
    stored in another dtype than the activations' (`--lora-dtype`) are widened to it, the used ones only."""
    if groups.used is not None:
        a = a.index_select(0, groups.used)
    a = a.to(x.dtype)
    grouped_x = x.index_select(0, groups.gather).view(a.shape[0], groups.rows, -1)
    shrunk = torch.bmm(grouped_x, a.transpose(1, 2))  # [G, rows, n * R]
    for piece in bt_slices:
        bt = (piece.bt if groups.used is None else piece.bt.index_select(0, groups.used)).to(x.dtype)
        delta = torch.bmm(shrunk[:, :, piece.first_rank : piece.first_rank + bt.shape[1]], bt)
        delta = delta.view(-1, bt.shape[2]).index_select(0, groups.scatter)  # [T, columns], in token order
        columns = out.narrow(1, piece.first_column, bt.shape[2])
        if groups.lora_tokens is None:
            columns.add_(delta)
        else:
            columns.addcmul_(delta, groups.lora_tokens)


@dataclass(frozen=True)
class BSlice:
    """One slice of a (fused) layer's B for the grouped path: `bt [S, R, columns]` maps ranks
    [first_rank, first_rank + R) of the shrunk activations to output columns [first_column, first_column + columns)."""

    bt: torch.Tensor
    first_rank: int
    first_column: int


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
