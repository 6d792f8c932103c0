"""Speculative-decoding verification steps on the CPU, recorded like decode steps (`workers/cpu_graphs.py`).

A verification step runs one or two requests' 1 + k query tokens (the sampled token and its drafts) through the
same compiled kernels as a decode step: the GGUF matmuls at T tokens, the attention kernel for short queries
(`CpuKernelBackend`, every sequence within `MAX_KERNEL_QUERY_LEN`), RMSNorm, rotary, the KV write. Eagerly its
few hundred kernel calls each pay the same Python as a decode step's (~4 ms a step at batch 1 on the default model,
a quarter of a verification step), so after decode steps were recorded a verification cost relatively more and
speculation gained less. Here each step shape (sequences, tokens) is recorded the first time it runs and replayed
after: its kernel calls depend on the shape only, while the values (token ids, positions, slots, query starts,
sequence lengths, block tables) are read by the kernels from static buffers at replay time.

The same shape is a small prefill chunk beside a decode, without speculation: a chunk of c tokens of a prompt whose
earlier tokens are cached attends as a verification of c tokens does. The prefill limit (`scheduler/prefill_limit.py`)
makes such steps whenever a prompt arrives while others decode; eagerly a 7-token chunk beside one decode took ~3x a
decode step on the default model (34 ms against 12.7), replayed ~2x (21 ms against 10.4; loaded 2-vCPU host). So the
worker records these shapes with or without speculation, all of them at start-up (`record_every_shape`: ~1 s more
there on the default model), since recording one in a live step stalls it ~0.1 s.

Shapes are bounded in tokens as the scheduler bounds speculation (`scheduler/spec_decode.py`): `MAX_VERIFY_TOKENS`
tokens (STEP_TOKEN_BUDGET); in sequences by `MAX_REPLAYED_SEQS` (4, or the batch's bound if smaller), more than the
`MAX_VERIFY_SEQS` a verification takes (MAX_SPECULATING_BATCH: with more running, none speculates), so that a prefill
chunk beside up to 3 decoders replays too: at most 22 recordings; each keeps its step's activations alive (a few MiB
for the default model). Recording a shape runs the forward over inert inputs (no slot written, block 0 read) under
the recorder, then replays it (the decode steps' capture, shared, has warmed the model up already), once per shape
per worker; a forward that cannot be recorded (`NotCapturable`) stays eager for that shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import cast

import torch

from tokenmill.workers.attention import AttentionMetadata
from tokenmill.workers.backends import attention_backend
from tokenmill.workers.cpu_graphs import CpuCallCapture, CpuDecodeGraphs, NotCapturable
from tokenmill.workers.cuda_graphs import KVCache

log = logging.getLogger(__name__)

# scheduler/spec_decode.py's MAX_SPECULATING_BATCH and STEP_TOKEN_BUDGET (tests check they agree): the largest
# verification step the scheduler plans by default
MAX_VERIFY_SEQS = 2
MAX_VERIFY_TOKENS = 8
# the most sequences a recorded multi-token step holds: a prefill chunk beside up to 3 decoders (issue 28's n = 2
# request beside a bystander: its second choice prefills the prompt's last block while the first choice and the
# bystander decode, a 3-sequence step that ran eagerly at 29-33 ms, ~2x a 3-sequence decode step), within the
# batch's bound
MAX_REPLAYED_SEQS = 4

Recording = tuple[Callable[[], None], torch.Tensor]  # (replay, the output it refills)


class CpuVerifyGraphs:
    """Steps of at most `max_tokens` query tokens in at most `max_seqs` sequences, none of them on the attention's
    prompt path: recorded per (sequences, tokens) on first use, replayed after.

    `model` is a `LlamaForCausalLM`: its `model.model` takes the embedded hidden states as `intermediate`, and the
    token embedding (a numpy dequantization for GGUF weights, which no recording sees) runs eagerly before."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: Sequence[KVCache],
        max_blocks_per_seq: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        max_seqs: int = MAX_VERIFY_SEQS,
        max_tokens: int = MAX_VERIFY_TOKENS,
        capture: CpuCallCapture | None = None,
    ) -> None:
        self.model = model
        # the model's decode-step capture where it has one (already warmed up), else its own
        self.capture = capture or CpuCallCapture()
        self.decoder = cast(torch.nn.Module, model.model)  # from the embedded hidden states on
        self.embed = cast(torch.nn.Module, self.decoder.embed_tokens)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.attention = attention_backend("cpu")
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long)
        self.positions = torch.zeros(max_tokens, dtype=torch.long)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype)
        self._recordings: dict[tuple[int, int], Recording | None] = {}  # None: the shape cannot be recorded

    @property
    def recorded_shapes(self) -> list[tuple[int, int]]:
        """The (sequences, tokens) shapes recorded so far."""
        return sorted(shape for shape, recording in self._recordings.items() if recording is not None)

    def can_run(self, attn: AttentionMetadata) -> bool:
        """Whether `run` replays this step (or records its shape now): a short multi-token step whose every
        sequence goes through the attention kernel, within the recorded bounds."""
        shape = (int(attn.seq_lens.shape[0]), attn.num_tokens)
        return (
            not attn.is_decode_only
            and not attn.prefills
            and 0 < shape[0] <= self.max_seqs
            and shape[1] <= self.max_tokens
            and attn.block_tables.shape[1] <= self.block_tables.shape[1]
            and self._recordings.get(shape, True) is not None
        )

    def record_every_shape(self) -> None:
        """Record every shape within the bounds now (22 by default), not on its first step: a recording runs the
        forward under the recorder and replays it (~0.1 s on the default model), a stall a live step would otherwise
        take once per shape."""
        for num_seqs in range(1, self.max_seqs + 1):
            for num_tokens in range(num_seqs + 1, self.max_tokens + 1):  # each sequence one token: a decode step
                if (num_seqs, num_tokens) not in self._recordings:
                    self._recordings[(num_seqs, num_tokens)] = self._record(num_seqs, num_tokens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Hidden states `[T, hidden]` of a step that `can_run`: its shape's recording replayed (recorded first if
        new; eagerly if the shape cannot be recorded)."""
        shape = (int(attn.seq_lens.shape[0]), input_ids.shape[0])
        if shape not in self._recordings:
            self._recordings[shape] = self._record(*shape)
        recording = self._recordings[shape]
        if recording is None:
            hidden: torch.Tensor = self.model(input_ids, positions, attn, self.kv_caches)
            return hidden
        num_seqs, num_tokens = shape
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(attn.slot_mapping)
        self.query_start_loc[: num_seqs + 1].copy_(attn.query_start_loc)
        self.seq_lens[:num_seqs].copy_(attn.seq_lens)
        self.block_tables[:num_seqs, : attn.block_tables.shape[1]].copy_(attn.block_tables)
        self.hidden[:num_tokens].copy_(self.embed(input_ids))
        replay, output = recording
        replay()
        return output

    def _record(self, num_seqs: int, num_tokens: int) -> Recording | None:
        """Record the decoder over inert inputs of this shape: every sequence but the last one token, the last the
        rest; no slot written (-1), keys read from block 0 only (zeroed at allocation, finite ever after)."""
        self.slot_mapping[:num_tokens].fill_(-1)
        self.positions[:num_tokens].zero_()
        self.block_tables[:num_seqs].zero_()
        starts = list(range(num_seqs)) + [num_tokens]
        self.query_start_loc[: num_seqs + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        self.seq_lens[:num_seqs].copy_(torch.tensor([b - a for a, b in zip(starts, starts[1:])], dtype=torch.int32))
        metadata = self._metadata(num_seqs, num_tokens, max_query_len=num_tokens - num_seqs + 1)

        def decoder() -> torch.Tensor:
            hidden = self.hidden[:num_tokens]
            output: torch.Tensor = self.decoder(
                self.input_ids[:num_tokens], self.positions[:num_tokens], metadata, self.kv_caches, (hidden, None)
            )
            return output

        try:
            recording = self.capture(decoder)
        except NotCapturable as exc:
            log.info("verification steps of %d tokens in %d sequences stay eager: %s", num_tokens, num_seqs, exc)
            return None
        log.debug("recorded verification steps of %d tokens in %d sequences", num_tokens, num_seqs)
        return recording

    def _metadata(self, num_seqs: int, num_tokens: int, max_query_len: int) -> AttentionMetadata:
        """Attention metadata over the static buffers' first rows: every sequence on the attention kernel."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            is_decode_only=False,
            max_query_len=max_query_len,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
            block_size=self.block_size,
            backend=self.attention,
        )


class CpuSpeculativeGraphs(CpuDecodeGraphs):
    """`CpuDecodeGraphs` that also replays short multi-token steps (`CpuVerifyGraphs`: verifications, small prefill
    chunks beside decodes): what the worker records on the CPU. Same arguments as `CpuDecodeGraphs`."""

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
        super().__init__(model, kv_caches, batch_sizes, max_blocks_per_seq, block_size, hidden_size, dtype)
        max_seqs = min(MAX_REPLAYED_SEQS, max(batch_sizes, default=1))
        self.verify = CpuVerifyGraphs(
            model,
            kv_caches,
            max_blocks_per_seq,
            block_size,
            hidden_size,
            dtype,
            max_seqs=max_seqs,
            capture=self.capture,
        )
        self.verify.record_every_shape()  # at start-up: in a live step each first recording stalled ~0.1 s

    def can_run(self, attn: AttentionMetadata) -> bool:
        return super().can_run(attn) or self.verify.can_run(attn)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        if super().can_run(attn):
            return super().run(input_ids, positions, attn)
        return self.verify.run(input_ids, positions, attn)
