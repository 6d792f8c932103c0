"""The draft-model proposer for speculative decoding (vLLM V1's `draft_model` method), on the worker.

A second, smaller model with the target's vocabulary runs in the same worker process. Its paged KV cache has its
own tensors but is indexed by the target's block tables and block ids, so the scheduler's block manager covers both:
a block's bytes are the target's layers plus the draft's (`Worker.kv_block_bytes`).

Each step the draft runs over the step's scheduled tokens (the target's flat batch, positions and attention metadata,
its own KV tensors), which keeps its KV in step with the target's. After verification it proposes up to k tokens for
every sampled request, one position at a time from the request's newest token (the last accepted draft's bonus
token), greedily: the drafts are point masses, which `verify_point_mass_drafts` verifies exactly. That loop writes
draft KV up to k positions past the request's tokens, into the lookahead slots the scheduler allocates; a request
whose block table ends sooner gets fewer drafts. Rejected drafts' KV is overwritten when their positions are computed
again, as the target's is. The worker proposes for every sampled request; the scheduler schedules drafts only for
requests that may speculate (`Speculator.allowed`).

With tensor parallelism the draft is sharded as the target (the target's `TensorParallel`: its heads, MLP columns and
vocabulary split over the same ranks, its layers all-reducing in the same group), so its KV block bytes are per rank
as the target's. Every rank runs the fill and the proposals, with the same inputs: the verified tokens, which only
tensor-parallel rank 0 holds, reach the others in one broadcast (`SampleStage.propose_drafts`); every rank gathers
the draft's logits, so all of them propose the same tokens and rank 0 returns them. Pipeline parallelism is refused.
"""

from __future__ import annotations

import json
import logging
import os

import msgspec
import numpy as np
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.workers.attention import build_attention_metadata
from tokenmill.workers.backends import attention_backend
from tokenmill.workers.kv_cache import allocate_kv_caches, kv_block_bytes
from tokenmill.workers.model_facts import text_config
from tokenmill.workers.model_loader import default_dtype, iter_weights, load_hf_config
from tokenmill.workers.models.layers import TensorParallel, pack_linear_weights
from tokenmill.workers.models.registry import architecture_of, model_class

log = logging.getLogger(__name__)


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """The draft's ModelConfig: its checkpoint, the target's settings otherwise (float32 reference runs stay float32:
    a target run with quantization "none" runs its draft dequantized too)."""
    from tokenmill.model_source import locate_model

    spec = config.speculative
    path, gguf_file, _ = locate_model(spec.path or spec.model)
    quantization = "none" if config.model.quantization == "none" else None  # None: as the draft's checkpoint is
    return msgspec.structs.replace(
        config.model,
        model=spec.model,
        path=str(path),
        gguf_file=gguf_file,
        architecture="",
        quantization=quantization,
        generation_defaults={},
    )


class DraftModel:
    """The draft model, its KV cache, and the greedy proposals."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
        max_model_len: int,
        target_vocab_size: int,
        target_path: str,
        tp: TensorParallel = TensorParallel(),
    ) -> None:
        """`tp`: the target's tensor-parallel rank and group, which the draft is sharded over."""
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config: method 'draft_model' does not support pipeline parallelism yet; "
                "use 'ngram' or pipeline_parallel_size=1"
            )
        self.k = config.speculative.num_speculative_tokens
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.model_config = draft_model_config(config)
        self.hf_config = load_hf_config(self.model_config)
        vocab_size = int(text_config(self.hf_config).vocab_size)
        if vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {config.speculative.model!r} has a vocabulary of "
                f"{vocab_size} tokens, the target's has {target_vocab_size}; a draft model must use the "
                "target's tokenizer"
            )
        check_same_tokenizer(self.model_config.path, target_path, config.speculative.model)
        self.architecture = architecture_of(self.hf_config)
        with torch.device(device), default_dtype(dtype):
            try:
                # the rotary table covers the target's context
                model = model_class(self.architecture)(self.hf_config, tp=tp, max_model_len=max_model_len)
            except ValueError as exc:  # heads or MLP columns that do not split over the ranks
                split = f" cannot be split over tensor_parallel_size={tp.size}" if tp.size > 1 else ""
                message = f"speculative_config: the draft model {config.speculative.model!r}{split}: {exc}"
                raise ValueError(message) from None
        model.load_weights(iter_weights(self.model_config, device))
        self.model = model.eval()
        if device.type == "cpu":
            pack_linear_weights(model)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        log.info(
            "loaded the draft model %s (%s, %d layers) for speculative decoding, k=%d",
            self.model_config.path,
            self.architecture,
            model.num_layers,
            self.k,
        )

    def kv_block_bytes(self) -> int:
        """Bytes of one block across the draft's layers, K and V: this rank's KV heads, as the target's count."""
        return kv_block_bytes(self.model, self.block_size, self.kv_cache_dtype)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The draft's distinct sliding windows (its attention reads are precomputed with the target's)."""
        windows: tuple[int, ...] = self.model.sliding_windows
        return windows

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model, num_blocks, self.block_size, self.kv_cache_dtype, self.device)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> None:
        """Run the draft over a step's scheduled tokens: its KV at their positions, as the target's."""
        self.model(input_ids, positions, attn, self.kv_caches)

    def propose(self, last_tokens: list[int], positions: list[int], block_ids: list[list[int]]) -> list[list[int]]:
        """Greedy drafts for each request: up to k tokens after `last_tokens[i]` (at `positions[i]`), fewer where its
        block table or the context ends sooner."""
        num = len(last_tokens)
        limits = [
            max(0, min(self.k, len(blocks) * self.block_size - pos, self.max_model_len - pos))
            for blocks, pos in zip(block_ids, positions)
        ]
        drafts: list[list[int]] = [[] for _ in range(num)]
        tokens = list(last_tokens)
        backend = attention_backend(self.device.type)
        for step in range(max(limits, default=0)):
            active = [i for i in range(num) if limits[i] > step]
            seq_lens = np.array([positions[i] + step + 1 for i in active], dtype=np.int64)
            blocks_needed = -(-seq_lens // self.block_size)
            tables = np.zeros((len(active), int(blocks_needed.max())), dtype=np.int64)
            for row, i in enumerate(active):
                tables[row, : blocks_needed[row]] = block_ids[i][: blocks_needed[row]]
            attn = build_attention_metadata(
                np.ones(len(active), dtype=np.int64),
                seq_lens,
                tables,
                self.block_size,
                self.device,
                backend,
                sliding_windows=self.model.sliding_windows,
            )
            input_ids = torch.tensor([tokens[i] for i in active], dtype=torch.long).to(self.device)
            pos = torch.from_numpy(seq_lens - 1).to(self.device)
            hidden = self.model(input_ids, pos, attn, self.kv_caches)
            proposed = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(active, proposed):
                drafts[i].append(token)
                tokens[i] = token
        return drafts


def check_same_tokenizer(draft_path: str, target_path: str, name: str) -> None:
    """Where both checkpoints ship a tokenizer.json, their vocabularies must be the same token for token."""
    vocabs = []
    for path in (draft_path, target_path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            return
        with open(file) as f:
            vocabs.append(json.load(f).get("model", {}).get("vocab"))
    if vocabs[0] != vocabs[1]:
        raise ValueError(
            f"speculative_config: the draft model {name!r} has another tokenizer than the target's "
            "(tokenizer.json vocabularies differ); a draft model must use the target's tokenizer"
        )
