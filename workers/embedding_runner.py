"""The model runner of an embedding instance: encode each step's whole prompts, pool them, return float32 vectors.

The scheduler sends embedding requests whole (never chunked) and gives them no KV blocks, so every request in a plan
is new, runs in one forward and is done: nothing is kept between steps and the scheduler manages no cache
(`num_kv_blocks_for_budget` is 0).

Two kinds of model serve embeddings:
- BERT-family encoders (`workers/models/bert.py`): bidirectional attention over the packed batch, no cache at all.
- decoders run with `--task embed` (Qwen3-Embedding style): causal attention through the same paged-attention path
  as generation, into a private scratch cache sized for one step (`max_num_batched_tokens` tokens), reused every
  step. Their checkpoints may be saved without the `model.` prefix and without an LM head, which is dropped here.

Pooling (mean / CLS / last token, L2-normalized or not) follows the model's sentence-transformers files unless
`--pooling` / `--normalize` override it (see `workers/pooling.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.messages import NewRequestData, StepPlan, StepResult
from tokenmill.pooling_config import PoolingConfig, load_pooling_config
from tokenmill.workers.attention import build_attention_metadata, token_positions
from tokenmill.workers.backends import attention_backend
from tokenmill.workers.kv_cache import PagedKVCache
from tokenmill.workers.models.registry import is_encoder, model_class
from tokenmill.workers.pooling import pool
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.worker import Worker

log = logging.getLogger(__name__)

EMBEDDING_DTYPE = np.dtype("<f4")  # what StepResult.embeddings carry: little-endian float32, as OpenAI's base64


class EmbeddingRunner(Worker):
    tasks: tuple[str, ...] = ("embed",)  # the request tasks this runner answers

    def __init__(self, config: EngineConfig, rank: int = 0):
        super().__init__(config, rank)
        self.pooling: PoolingConfig | None = None
        self.encoder = False
        if self.device.type == "cuda":
            # Two instances usually share the GPU (chat + embeddings): hold this one to its share.
            torch.cuda.set_per_process_memory_fraction(config.cache.gpu_memory_utilization, self.device)

    # ---------------------------------------------------------------- start-up

    def load_model(self) -> None:
        super().load_model()
        self.load_output_head()
        if not self.encoder:
            self._allocate_step_cache()

    def load_output_head(self) -> None:
        """What turns the final hidden states into a request's answer: here the pooling."""
        model_cfg = self.config.model
        self.pooling = load_pooling_config(model_cfg.path, self.architecture, model_cfg.pooling, model_cfg.normalize)
        log.info(
            "embeddings: %s pooling, %s",
            self.pooling.mode,
            "L2-normalized" if self.pooling.normalize else "not normalized",
        )

    @property
    def vocab_size(self) -> int:
        return 0  # no language-model head: nothing to sample or constrain

    def build_model(self) -> torch.nn.Module:
        self.encoder = is_encoder(self.architecture)
        if not self.encoder:
            model = super().build_model()
            model.lm_head = None  # embeddings come from the final hidden states; the head is never used
            return model
        if self.tp.size > 1:
            raise NotImplementedError("encoder embedding models run on one device (tensor_parallel_size 1)")
        return model_class(self.architecture)(self.hf_config, self.dtype, self.device)

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        weights = super().checkpoint_weights()
        return weights if self.encoder else decoder_body_weights(weights)

    def num_kv_blocks_for_budget(self) -> int:
        """No blocks for the scheduler to manage: embedding requests never keep KV between steps."""
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if num_blocks:
            raise ValueError(f"an embedding model keeps no KV cache, asked for {num_blocks} blocks")

    def _allocate_step_cache(self) -> None:
        """A decoder's scratch cache: room for one step's tokens, each sequence rounded up to whole blocks."""
        sched = self.config.scheduler
        max_tokens = sched.max_num_batched_tokens
        num_blocks = -(-max_tokens // self.block_size) + min(sched.max_num_seqs, max_tokens)
        self.kv_cache = PagedKVCache(self.model, None, num_blocks, self.block_size, self.dtype, self.device)
        # zeros: attention reads whole blocks and masks, and a masked NaN would still poison it
        self.kv_cache.zero_never_used(list(range(num_blocks)))
        log.info(
            "scratch KV for one %d-token step: %d blocks, %.1f MiB",
            max_tokens,
            num_blocks,
            num_blocks * self.kv_block_bytes() / 2**20,
        )

    # ---------------------------------------------------------------- steps

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Encode every request of the plan in one forward; rank 0 returns each one's pooled embedding."""
        if plan.running:
            raise ValueError(
                f"an embedding instance got {len(plan.running)} running requests; "
                "embedding requests must be scheduled whole, in one step"
            )
        requests = [new for new in plan.new_requests if new.num_scheduled_tokens > 0]
        for new in requests:
            _check_whole(new, self.tasks)
        if not requests:
            return StepResult(plan.step_id, [], [])
        started = time.perf_counter()
        lengths = np.fromiter((len(new.token_ids) for new in requests), dtype=np.int64, count=len(requests))
        query_start_loc = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(lengths, out=query_start_loc[1:])
        device = self.device
        input_ids = torch.tensor([t for new in requests for t in new.token_ids], dtype=torch.long).to(device)
        positions = torch.from_numpy(token_positions(lengths, lengths)).to(device)
        starts = torch.from_numpy(query_start_loc).to(device)
        if self.encoder:
            token_types = _token_type_ids(requests, lengths)
            token_type_ids = None if token_types is None else torch.from_numpy(token_types).to(device)
            hidden = self.model(input_ids, positions, starts, token_type_ids=token_type_ids)
        else:
            hidden = self.model(input_ids, positions, self._step_attention(lengths), self.kv_caches)
        if self.rank != 0:
            return StepResult(plan.step_id, [], [], model_time_s=time.perf_counter() - started)
        vectors = self.outputs(hidden, starts, requests).cpu().numpy().astype(EMBEDDING_DTYPE, copy=False)
        embeddings = {new.request_id: vectors[i].tobytes() for i, new in enumerate(requests)}
        return StepResult(plan.step_id, [], [], embeddings=embeddings, model_time_s=time.perf_counter() - started)

    def outputs(self, hidden: torch.Tensor, starts: torch.Tensor, requests: list[NewRequestData]) -> torch.Tensor:
        """One float32 row per request [B, D] from the step's hidden states [T, H]: here the pooled embedding."""
        assert self.pooling is not None, "load_model() first"
        return pool(hidden, starts, self.pooling)

    def _step_attention(self, lengths: np.ndarray):
        """Attention metadata placing the step's sequences one after another in the scratch cache."""
        blocks_needed = -(-lengths // self.block_size)
        first_block = np.cumsum(blocks_needed) - blocks_needed
        num_blocks = self.kv_caches[0][0].shape[0]
        if int(blocks_needed.sum()) > num_blocks:
            raise ValueError(
                f"a step of {int(lengths.sum())} tokens in {len(lengths)} sequences does not fit the "
                f"scratch cache of {num_blocks} blocks (max_num_batched_tokens is "
                f"{self.config.scheduler.max_num_batched_tokens})"
            )
        columns = np.arange(int(blocks_needed.max()))
        block_tables = np.where(columns[None, :] < blocks_needed[:, None], first_block[:, None] + columns[None, :], 0)
        return build_attention_metadata(
            lengths, lengths, block_tables, self.block_size, self.device, attention_backend(self.device.type)
        )


def _token_type_ids(requests: list[NewRequestData], lengths: np.ndarray) -> np.ndarray | None:
    """[T] token types of the packed step: 1 from each text pair's second segment on; None when all are 0."""
    if all(new.second_segment_start is None for new in requests):
        return None
    starts = np.cumsum(lengths) - lengths
    types = np.zeros(int(lengths.sum()), dtype=np.int64)
    for start, length, new in zip(starts, lengths, requests, strict=True):
        if new.second_segment_start is not None:
            types[start + new.second_segment_start : start + length] = 1
    return types


def _check_whole(new: NewRequestData, tasks: tuple[str, ...]) -> None:
    if new.task not in tasks:
        raise ValueError(f"request {new.request_id} has task {new.task!r} on an instance serving {tasks}")
    if new.num_computed_tokens != 0 or new.num_scheduled_tokens != len(new.token_ids):
        raise ValueError(
            f"embedding request {new.request_id} must run whole: {new.num_scheduled_tokens} of "
            f"{len(new.token_ids)} tokens scheduled from {new.num_computed_tokens}"
        )


def decoder_body_weights(
    weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]],
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A decoder checkpoint's tensors minus its LM head, under `model.` whether saved from *ForCausalLM or *Model."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith("model.") else f"model.{name}"), tensor
