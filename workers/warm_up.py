"""Kernels warm before the worker reports ready (vLLM's `compile_or_warm_up_model`): a few dummy steps launch every
Triton kernel a step can use, so no request pays for their compilation.

Triton compiles a kernel once per set of constexprs and per specialization of its integer arguments (a value of 1,
or a multiple of 16). For one model those come from a step's kinds and sizes:

- a mixed step (a decode beside a prefill chunk of 17 tokens) and a prefill-only step of 16: the KV write, RMSNorm,
  rotary, the prefill kernel and the split-KV decode kernel;
- decode-only steps of batch 1 at contexts cut into 1, 2, ... S partitions, S the most the split-KV rule can choose
  on this device (`choose_num_splits` at batch 1 and the longest context): each split count is its own kernel, and
  the reduce kernel's with it; then decode batches of 2 and 16 sequences;
- on the last pipeline stage, the LM head and the sampler (a greedy and a seeded top-k/top-p/min-p row).

The dummy steps write nothing: every slot is -1, which the KV-write kernel skips (the padding rows of a CUDA graph
use the same rule), and every block table points at block 0, which is only read. So warm-up holds no block, leaks
none and leaves the cache as it found it. The CPU kernels and the torch backend compile nothing at run time: no
warm-up there (`Worker.warm_up_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.split_kv_decode import MIN_KEYS_PER_SPLIT, choose_num_splits
from tokenmill.messages import SamplingParams
from tokenmill.workers.attention import AttentionBackend, KVCache, build_attention_metadata, token_positions
from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.models.llama import PagedCausalLM
from tokenmill.workers.models.pipeline import PipelineStage
from tokenmill.workers.pipeline_parallel import stage_forward
from tokenmill.workers.sampler import RequestSamplingState, sample

# Token counts off and on Triton's multiple-of-16 specialization
PREFILL_TOKENS = (17, 16)
DECODE_BATCHES = (2, 16)


@dataclass(frozen=True)
class WarmUpStep:
    """One dummy step: each sequence's query tokens and context (both host values)."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


def warm_up_steps(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_kv_heads: int, num_sms: int
) -> list[WarmUpStep]:
    """The dummy steps that launch every kernel variant a step of these limits can use (module docstring)."""
    prefill = [min(tokens, max_model_len, max(1, max_num_batched_tokens - 1)) for tokens in PREFILL_TOKENS]
    steps = [WarmUpStep((1, prefill[0]), (1, prefill[0]))] if max_num_seqs > 1 else []
    steps.append(WarmUpStep((prefill[1],), (prefill[1],)))
    most_splits = choose_num_splits(1, num_kv_heads, max_model_len, num_sms)
    for splits in range(1, most_splits + 1):
        steps.append(WarmUpStep((1,), (min(splits * MIN_KEYS_PER_SPLIT, max_model_len),)))
    for batch in DECODE_BATCHES:
        if batch <= min(max_num_seqs, max_num_batched_tokens):
            steps.append(WarmUpStep((1,) * batch, (1,) * batch))
    return steps


@dataclass(frozen=True)
class DummyStepRunner:
    """Runs `WarmUpStep`s through one rank's model: its stage's layers, then the LM head and the sampler."""

    model: PagedCausalLM
    kv_caches: list[KVCache]
    backend: AttentionBackend
    pp: PipelineStage
    tp: TensorParallel
    block_size: int
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    sliding_windows: tuple[int, ...] = ()

    def run(self, step: WarmUpStep) -> None:
        query_lens, seq_lens = np.array(step.query_lens), np.array(step.seq_lens)
        block_tables = np.zeros((len(seq_lens), -(-int(seq_lens.max()) // self.block_size)), dtype=np.int64)
        attn = build_attention_metadata(
            query_lens, seq_lens, block_tables, self.block_size, self.device, self.backend, None, self.sliding_windows
        )
        attn.slot_mapping.fill_(-1)  # write nothing: the KV-write kernel skips slot -1
        num_tokens = int(query_lens.sum())
        positions = torch.from_numpy(token_positions(query_lens, seq_lens)).to(self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        intermediate = None
        if not self.pp.is_first:  # a later stage starts from zeros instead of the previous stage's hidden states
            intermediate = torch.zeros(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        hidden = stage_forward(self.model, self.pp, input_ids, positions, attn, self.kv_caches, intermediate)
        if self.pp.is_last:
            last_rows = torch.from_numpy(np.cumsum(query_lens) - 1).to(self.device)
            logits = self.model.compute_logits(hidden.index_select(0, last_rows))  # every TP rank: the head gathers
            if self.tp.rank == 0:
                sample(logits, dummy_sampling_states(len(query_lens), self.device))


def dummy_sampling_states(num_rows: int, device: torch.device) -> list[RequestSamplingState]:
    """Alternating greedy rows and seeded rows with top-k, top-p and min-p (seeded: the global generator, which
    unseeded requests draw from, is left as it was)."""
    greedy = SamplingParams(temperature=0.0)
    filtered = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.01, seed=0)
    return [RequestSamplingState(greedy if row % 2 == 0 else filtered, [0], [], device) for row in range(num_rows)]
