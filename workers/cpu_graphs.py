"""Decode "graphs" on the CPU: a decode step's compiled-kernel calls recorded once per batch size, then replayed.

At batch 1 on the CPU the decoder's kernels are a few hundred ctypes calls per step (per layer: two RMSNorms, the
QKV, O, gate/up and down GGUF matmuls, rotary, the KV write, attention, SiLU-and-mul), and the Python around each
call (argument checks, `torch.empty`, `data_ptr()`, views) cost about as much as the small kernels themselves. Like a
CUDA graph, `CpuCallCapture` runs the forward once over static buffers while recording every call into the
compiled kernel libraries (`kernels/cpu_ops.py`, `kernels/gguf_ops.py`) with its arguments converted to ctypes
values, keeps every tensor the forward allocated alive (the recorded pointers point into them), and replays the
recorded calls: the same kernels on the same memory with the same arguments, so the same bits as the eager forward.
The replay is one native loop over the calls (`kernels/call_replay.py`) where the platform allows, so a step pays no
per-call Python or ctypes conversion; elsewhere it is a Python loop over the ctypes calls.

A forward can be recorded only when everything it computes is one of those kernel calls: a `TorchDispatchMode`
watches the capture and refuses it (`NotCapturable`) on any torch operation other than allocations and views (a
torch fallback, a `.item()`, a copy), and the replay is checked bit for bit against the captured run. What depends
on values rather than addresses (token ids, positions, slots, sequence lengths, block tables) is read by the kernels
from `DecodeGraphs`' static buffers at replay time. The token embedding is recorded too where a GGUF table's lookup
is kernel calls alone (`GGUFWeight.lookup_is_native`: its rows gathered and dequantized by `kernels/row_ops.py`);
elsewhere it is a numpy dequantization, which no recording would see, so `CpuDecodeGraphs` runs it eagerly and
records the decoder from the embedded hidden states on.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill.kernels import call_replay, cpu_ops, gguf_ops, lora_cpu, row_ops
from tokenmill.workers.attention import AttentionMetadata
from tokenmill.workers.cuda_graphs import DecodeGraphs, KVCache
from tokenmill.workers.quantization.gguf import GGUFWeight

# The decode batch sizes recorded: where the per-call Python is a large share of a step (at 8 sequences the kernels'
# work is already ~8x a single token's); a batch between two sizes replays the larger with inert padding rows. 3 is
# one request's n = 2 choices beside a bystander (issue 28): replayed as 4, its padding row cost the bystander ~10% a
# step (default model, one thread: batch 3 at 1.51x batch 1's step, batch 4 at 1.83x); recording it took well under
# a second at start-up.
CPU_GRAPH_BATCH_SIZES = (1, 2, 3, 4, 8)

# (ctypes function, its arguments as ctypes values): one kernel call of a recorded forward
RecordedCall = tuple[Any, tuple[Any, ...]]

# Allocations (whose outputs the recording keeps alive) and nothing else besides views.
_ALLOCATIONS = frozenset({"aten::empty.memory_format", "aten::empty_strided", "aten::empty_like"})


class NotCapturable(RuntimeError):
    """The forward computes something outside the compiled kernels, so its calls alone cannot replay it."""


class _AllocationsAndViewsOnly(TorchDispatchMode):
    """Refuses every torch operation but allocations and views; keeps each one's output alive."""

    def __init__(self, keep: list[Any]) -> None:
        super().__init__()
        self.keep = keep

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in torch._dynamo.disable, whose first call imports torch._dynamo:
        # 0.6-1.5 s of the worker's start-up, for a mode no torch.compile ever runs under (TorchDispatchMode's own
        # docstring shows this override)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.name() not in _ALLOCATIONS and not func.is_view:
            raise NotCapturable(f"the forward runs the torch operation {func.name()}, which a replay would skip")
        output = func(*args, **(kwargs or {}))
        self.keep.append(output)
        return output


def _kernel_libraries() -> list[tuple[ctypes.CDLL, dict[str, list[Any]]]]:
    """The loaded kernel libraries with their functions' argument types."""
    libraries = [
        (cpu_ops.library(), cpu_ops._SIGNATURES),
        (gguf_ops.library(), gguf_ops._SIGNATURES),
        (row_ops.library(), row_ops._SIGNATURES),
        (lora_cpu.library(), lora_cpu._SIGNATURES),  # LoRA steps: the grouping staged in fixed buffers (LoRAStep)
    ]
    return [(lib, signatures) for lib, signatures in libraries if lib is not None]


def _as_ctypes(function: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments converted once to their declared ctypes types (a replayed call then converts nothing)."""
    return tuple(arg if isinstance(arg, kind) else kind(arg) for kind, arg in zip(function.argtypes, args, strict=True))


@contextlib.contextmanager
def recording_kernel_calls(calls: list[RecordedCall]) -> Iterator[None]:
    """Within: every call into the kernel libraries runs and is appended to `calls` (the libraries' functions are
    looked up on the library at each call, so replacing them on the library object intercepts every caller)."""
    replaced: list[tuple[ctypes.CDLL, str, Any]] = []

    def recorder(function: Any) -> Callable[..., int]:
        def call(*args: Any) -> int:
            converted = _as_ctypes(function, args)
            calls.append((function, converted))
            return int(function(*converted))

        return call

    try:
        for lib, signatures in _kernel_libraries():
            for name in signatures:
                function = getattr(lib, name)
                replaced.append((lib, name, function))
                setattr(lib, name, recorder(function))
        yield
    finally:
        for lib, name, function in replaced:
            setattr(lib, name, function)


class RecordedCalls:
    """A recorded forward's kernel calls, and the same calls laid out for the native replay loop (None where the
    platform or a call's argument types do not allow it)."""

    def __init__(self, calls: list[RecordedCall]) -> None:
        self.calls = calls
        self.native = call_replay.NativeCalls.build(calls)


def replay_calls(recorded: RecordedCalls) -> None:
    """Run the recorded kernel calls in order; a kernel refusing its arguments (nonzero status) raises."""
    if recorded.native is not None:
        recorded.native.run()
        return
    for function, args in recorded.calls:
        if function(*args) != 0:
            raise RuntimeError(f"{function.__name__} refused its recorded arguments on replay")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN: a capture's padding rows (sequence length 0) may hold NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


class CpuCallCapture:
    """A `Capture` for `DecodeGraphs` on the CPU: one recorded run of the forward, the replay checked against it.

    Its first forward runs once before being recorded, a warm-up: the kernels built, tables (rotary) and the
    per-weight matmul closures made, none of which a recording may do. The later forwards of the same model have
    nothing left to warm (the same weights, kernels and tables at another shape), so they are recorded straight
    away: one eager forward fewer for each of the worker's ~27 recordings at start-up (~2 s on the default model).
    Give each model its own."""

    def __init__(self) -> None:
        self.warmed_up = False

    def __call__(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        if not self.warmed_up:
            forward()
            self.warmed_up = True
        calls: list[RecordedCall] = []
        keep: list[Any] = []  # every tensor the recorded run allocated: the recorded pointers point into them
        with recording_kernel_calls(calls), _AllocationsAndViewsOnly(keep):
            output = forward()
        if not calls:
            raise NotCapturable("the forward called no compiled kernel")
        expected = output.clone()
        recorded = RecordedCalls(calls)
        replay_calls(recorded)
        if not _same_bits(output, expected):
            raise NotCapturable("replaying the recorded kernel calls did not reproduce the forward")
        keep.append(output)

        def replay() -> None:
            replay_calls(recorded)
            _ = keep  # holds the recorded run's tensors for as long as this replay exists

        return replay, output


def _lookup_is_native(embed: torch.nn.Module) -> bool:
    """Whether the token embedding's lookup is compiled kernel calls alone (a recording then replays it)."""
    weight = embed.weight
    return isinstance(weight, GGUFWeight) and embed.tp.size == 1 and weight.lookup_is_native()


class CpuDecodeGraphs(DecodeGraphs):
    """`DecodeGraphs` on the CPU: the decoder's recorded kernel calls replayed, the token embedding's among them
    where its lookup is native (else it runs eagerly first).

    `model` is a `LlamaForCausalLM` (its `model.model` takes the embedded hidden states as `intermediate`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: Sequence[KVCache],
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.embed = model.model.embed_tokens
        self.records_embedding = _lookup_is_native(self.embed)
        self.hidden = torch.zeros(max(batch_sizes), hidden_size, dtype=dtype)
        self.capture = CpuCallCapture()  # the model's, warmed by its first recording (the largest batch)

        def decoder(
            input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, caches: Sequence[KVCache]
        ) -> torch.Tensor:
            embedded = None if self.records_embedding else (self.hidden[: input_ids.shape[0]], None)
            output: torch.Tensor = model.model(input_ids, positions, attn, caches, embedded)
            return output

        super().__init__(
            decoder,  # type: ignore[arg-type]  # called as the model is: (ids, positions, metadata, caches)
            kv_caches,
            batch_sizes,
            max_blocks_per_seq,
            block_size,
            torch.device("cpu"),
            self.capture,
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        if not self.records_embedding:
            self.hidden[: input_ids.shape[0]].copy_(self.embed(input_ids))
        return super().run(input_ids, positions, attn)
