"""The worker's model runner: holds weights, the paged KV cache and per-request state; runs one StepPlan at a time.

A StepPlan is a diff: finished requests are forgotten, new ones arrive in full, running ones bring the tokens
sampled last step and any new blocks. Each scheduled request contributes `num_scheduled_tokens` tokens starting
at `num_computed_tokens`, so prompts, prompt chunks and decode tokens all run in one flat batch and one forward.
Only requests whose scheduled tokens reach the end of their known tokens get logits and a sampled token.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.kernels.kv_quant import check_kv_cache_device, kv_cache_torch_dtype
from tokenmill.messages import NewRequestData, StepPlan, StepResult
from tokenmill.workers.attention import (DECODE_GATHER_BYTES, AttentionMetadata, allocate_kv_caches,
                                         build_attention_metadata, kv_block_bytes, token_positions, zero_kv_blocks)
from tokenmill.workers.backends import attention_backend
from tokenmill.workers.cuda_graphs import DecodeGraphs, cuda_graph_capture, graph_batch_sizes
from tokenmill.workers.draft_proposer import DraftModel
from tokenmill.workers.model_loader import default_dtype, iter_weights, load_hf_config, resolve_dtype
from tokenmill.workers.models.layers import TensorParallel, pack_linear_weights
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.models.pipeline import PipelineStage
from tokenmill.workers.pipeline_parallel import pipelined_forward, stage_forward
from tokenmill.workers.models.registry import architecture_of, model_class
from tokenmill.workers.prompt_logprobs import (PromptLogprobsState, compute_prompt_logprobs, prompt_logprobs_state,
                                               prompt_rows)
from tokenmill.workers.rendezvous import rendezvous_store
from tokenmill.workers.rejection_sampler import verify_point_mass_drafts
from tokenmill.workers.sampler import RequestSamplingState, sample
from tokenmill.workers.grammar_mask import apply_grammar_bitmask

log = logging.getLogger(__name__)


@dataclass
class _Request:
    """What the worker remembers about one request between steps."""

    request_id: str
    token_ids: list[int]  # prompt + outputs known so far
    block_ids: list[int]
    task: str
    sampling: RequestSamplingState | None  # None for embedding requests
    prompt_logprobs: PromptLogprobsState | None = None  # while its prompt logprobs are being computed


@dataclass
class _StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [N] rows of the flat batch whose hidden state is sampled
    sampled_requests: list[_Request]
    # speculative decoding: per sampled request its draft tokens (1 + len rows each in sample_rows); None: no drafts
    drafts: list[list[int]] | None = None


def resolve_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:<rank> when CUDA is asked for (or available under "auto"), else cpu.

    The index wraps at the visible device count: a Ray actor sees only its own GPU (CUDA_VISIBLE_DEVICES)."""
    wanted = config.parallel.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.device = resolve_device(config, rank)
        parallel = config.parallel
        # ranks ordered as vLLM's: stage-major, the tensor-parallel ranks of one stage contiguous
        self.pp = PipelineStage(rank // parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.tp = TensorParallel(rank % parallel.tensor_parallel_size, parallel.tensor_parallel_size)
        self.world_size = parallel.world_size
        self.block_size = config.cache.block_size
        self.hf_config = None
        self.architecture = ""
        self.dtype = torch.float32
        self.model = None
        self.weight_bytes = 0
        self.eos_token_ids: list[int] = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._never_used_blocks = np.zeros(0, dtype=bool)
        self._requests: dict[str, _Request] = {}
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_cuda_graphs
        self.draft: DraftModel | None = None  # speculative decoding's draft model (workers/draft_proposer.py)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._cuda_memory_at_start = torch.cuda.mem_get_info(self.device)  # (free, total) before any weight
        elif self.world_size > 1 and parallel.distributed_executor_backend == "mp":
            # the ranks share the host's cores: oversubscribed, every all-reduce would wait on the slowest rank
            torch.set_num_threads(max(1, torch.get_num_threads() // self.world_size))
        torch.manual_seed(config.model.seed)
        if self.world_size > 1:
            self._init_distributed()

    def _init_distributed(self) -> None:
        """Join the world (every stage's every rank); with pipeline stages, each stage's tensor-parallel group."""
        if dist.is_initialized():
            return
        parallel = self.config.parallel
        if not parallel.dist_port:
            raise ValueError("tensor or pipeline parallelism needs parallel.dist_port")
        dist.init_process_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            store=rendezvous_store(parallel.dist_host, parallel.dist_port, self.rank, self.world_size),
            rank=self.rank,
            world_size=self.world_size,
        )
        if self.pp.size > 1 and self.tp.size > 1:
            size = self.tp.size
            groups = [dist.new_group(list(range(stage * size, (stage + 1) * size))) for stage in range(self.pp.size)]
            self.tp = self.tp._replace(group=groups[self.pp.rank])  # every rank makes every group, in one order

    # ---------------------------------------------------------------- start-up

    def load_model(self) -> None:
        """Build the model on the target device and dtype, then stream the checkpoint into it."""
        model_cfg = self.config.model
        self.hf_config = load_hf_config(model_cfg)
        # the rotary table's length, and LongRoPE's short/long choice (workers/models/rope.py)
        self.hf_config.tokenmill_max_model_len = self.max_model_len()
        self.architecture = model_cfg.architecture or architecture_of(self.hf_config)
        self.dtype = resolve_dtype(model_cfg, self.hf_config, self.device)
        started = time.perf_counter()
        with torch.device(self.device), default_dtype(self.dtype):
            model = self.build_model()
        model.load_weights(self.checkpoint_weights())
        self.model = model.eval()
        # dense parameters and the buffers of quantized weights (the bytes a decode step reads)
        quantized = [b for m in model.modules() if isinstance(m, QuantizedWeight) for b in m.buffers(recurse=False)]
        unique = {t.data_ptr(): t for t in [*model.parameters(), *quantized]}.values()
        self.weight_bytes = sum(t.numel() * t.element_size() for t in unique)
        if self.device.type == "cpu":
            pack_linear_weights(model)
        self.eos_token_ids = self._read_eos_token_ids()
        if self.config.speculative.method == "draft_model":
            self.draft = DraftModel(self.config, self.device, self.dtype, self.kv_cache_dtype, self.max_model_len(),
                                    self.vocab_size, model_cfg.path, self.tp)
        log.info(
            "loaded %s (%s, %.1f MiB of weights on %s) in %.1f s",
            self.architecture,
            str(self.dtype).removeprefix("torch."),
            self.weight_bytes / 2**20,
            self.device,
            time.perf_counter() - started,
        )

    def build_model(self) -> torch.nn.Module:
        """The model with uninitialised weights, on the current default device and dtype."""
        cls = model_class(self.architecture)
        if self.pp.size == 1:
            return cls(self.hf_config, tp=self.tp)
        if not getattr(cls, "supports_pipeline_parallel", False):
            raise ValueError(f"{self.architecture} does not support pipeline_parallel_size > 1")
        return cls(self.hf_config, tp=self.tp, pp=self.pp)

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs for `load_weights`; a pipeline stage reads only its own tensors."""
        if self.pp.size == 1:
            return iter_weights(self.config.model, self.device)
        num_layers = self.text_config.num_hidden_layers
        tied = bool(getattr(self.text_config, "tie_word_embeddings", False))
        return iter_weights(self.config.model, self.device,
                            wanted=lambda name: self.pp.weight_name(name, num_layers, tied) is not None)

    def _read_eos_token_ids(self) -> list[int]:
        """From generation_config.json when the checkpoint has one, else the model config's eos_token_id."""
        eos = None
        generation_config = os.path.join(self.config.model.path, "generation_config.json")
        if os.path.exists(generation_config):
            with open(generation_config) as f:
                eos = json.load(f).get("eos_token_id")
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None) or getattr(self.text_config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(eos)] if isinstance(eos, int) else [int(token) for token in eos]

    @property
    def text_config(self):
        """The language model's config: a multimodal config's `text_config` (Gemma 3), else the config itself."""
        get_text_config = getattr(self.hf_config, "get_text_config", None)
        return get_text_config() if get_text_config is not None else self.hf_config

    @property
    def vocab_size(self) -> int:
        """The width of the logits the sampler sees."""
        return int(self.text_config.vocab_size)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or fp8 with `--kv-cache-dtype fp8` (kernels/kv_quant.py)."""
        return kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.dtype)

    def kv_block_bytes(self) -> int:
        """Bytes of one block across every layer, K and V (the draft model's layers too: they share the blocks)."""
        return self._target_kv_block_bytes() + (self.draft.kv_block_bytes() if self.draft is not None else 0)

    def _target_kv_block_bytes(self) -> int:
        return kv_block_bytes(self.model, self.block_size, self.kv_cache_dtype)

    def decode_chunk_tokens(self) -> int:
        """Keys per decode-attention chunk on the torch path: `DECODE_GATHER_BYTES` of one layer's K and V."""
        return max(1, DECODE_GATHER_BYTES * self.model.num_layers * self.block_size // self._target_kv_block_bytes())

    def max_model_len(self) -> int:
        return self.config.model.max_model_len or int(self.text_config.max_position_embeddings)

    def num_kv_blocks_for_budget(self) -> int:
        """How many KV blocks fit: the configured count, the CPU byte budget, or what the GPU has left.

        With tensor parallelism every rank must call this; they agree on the smallest count.
        """
        cache = self.config.cache
        if cache.num_kv_blocks > 0:
            return cache.num_kv_blocks
        if self.device.type == "cuda":
            num_blocks = self._num_kv_blocks_on_gpu()
        else:
            num_blocks = cache.kv_cache_memory_bytes // self.kv_block_bytes()
        if self.world_size > 1:  # every stage holds its own layers' blocks: one count for all
            agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            num_blocks = int(agreed.item())
        return num_blocks

    def _num_kv_blocks_on_gpu(self) -> int:
        """The blocks that fit in gpu_memory_utilization of the GPU besides everything else this worker holds.

        Counted against the share: the weights and a worst-case step's activations (profiled), memory taken outside
        torch's allocator since start-up (NCCL, cuBLAS workspaces), and the decode CUDA graphs' pool. Other processes
        on the GPU (a second instance) are respected by never taking more than is free now, less the activations
        and graphs still to come. The CUDA context, created before the start-up snapshot, is left out of the count.
        """
        cache = self.config.cache
        free_at_start, total = self._cuda_memory_at_start
        peak = self._profile_peak_memory()  # weights + activations
        free_now, _ = torch.cuda.mem_get_info(self.device)
        held_by_torch = torch.cuda.memory_reserved(self.device)  # the weights: the profile's activations are released
        activations = max(0, peak - held_by_torch)
        outside_torch = max(0, free_at_start - free_now - held_by_torch)
        graphs = self._decode_graph_memory_estimate(activations)
        budget = min(
            cache.gpu_memory_utilization * total - peak - outside_torch - graphs,
            free_now - activations - graphs,
        )
        num_blocks = int(budget // self.kv_block_bytes())
        kv_bytes = max(0, num_blocks) * self.kv_block_bytes()
        allowed = cache.gpu_memory_utilization * total
        gib = [n / 2**30 for n in (total, allowed, held_by_torch, activations, outside_torch, graphs, kv_bytes)]
        log.info("GPU memory (GiB): %.2f total, %.2f allowed; weights and buffers %.2f, activations %.2f, "
                 "outside torch %.2f, decode graphs ~%.2f; KV cache %.2f", *gib)
        if num_blocks <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: weights and activations take {peak / 2**30:.2f} GiB, "
                f"{free_now / 2**30:.2f} GiB is free and {cache.gpu_memory_utilization:.2f} of {total / 2**30:.2f} GiB "
                "is allowed; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return num_blocks

    def _decode_graph_memory_estimate(self, activations: int) -> int:
        """The decode graphs' memory pool: the activations of their largest batch, scaled from the profiled step."""
        if not self._uses_cuda_graphs():
            return 0
        largest = graph_batch_sizes(self.config.scheduler.max_num_seqs)[-1]
        return int(activations * min(1.0, largest / self.config.scheduler.max_num_batched_tokens))

    def _profile_peak_memory(self) -> int:
        """Bytes this process holds at the peak of a worst-case step (max_num_batched_tokens tokens), KV excluded."""
        sched = self.config.scheduler
        max_len = self.max_model_len()
        seq_lens = [max_len] * (sched.max_num_batched_tokens // max_len)
        if sched.max_num_batched_tokens % max_len:
            seq_lens.append(sched.max_num_batched_tokens % max_len)
        blocks_per_seq = [-(-n // self.block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq)
        block_tables = np.zeros((len(seq_lens), max(blocks_per_seq)), dtype=np.int64)
        next_block = 0
        for row, count in enumerate(blocks_per_seq):
            block_tables[row, :count] = np.arange(next_block, next_block + count)
            next_block += count

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.allocate_kv_cache(num_blocks)
        dummy_kv_bytes = num_blocks * self.kv_block_bytes()
        lens = np.array(seq_lens)
        attn = build_attention_metadata(lens, lens, block_tables, self.block_size, self.device,
                                        attention_backend(self.device.type))
        num_tokens = sum(seq_lens)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.from_numpy(token_positions(lens, lens)).to(self.device)
        with torch.inference_mode():
            hidden = stage_forward(self.model, self.pp, input_ids, positions, attn, self.kv_caches)
            num_rows = min(sched.max_num_seqs, num_tokens)
            if self.pp.is_last:
                self.model.compute_logits(hidden[:num_rows]).softmax(dim=-1)  # the sampler works on copies
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device) - dummy_kv_bytes
        self.kv_caches = []
        if self.draft is not None:
            self.draft.kv_caches = []
        del hidden
        torch.cuda.empty_cache()
        log.info("profiled a %d-token step: %.2f GiB peak besides the KV cache", num_tokens, peak / 2**30)
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer a K and a V cache `[num_blocks, block_size, num_kv_heads, head_dim]`, left uninitialised.

        Each block is zeroed the first time a plan hands it out (block 0 at once: it pads block tables), which
        keeps attention's padding reads finite without touching the whole cache up front.
        """
        check_kv_cache_device(self.kv_cache_dtype, self.device)
        self.kv_caches = allocate_kv_caches(self.model, num_blocks, self.block_size, self.kv_cache_dtype, self.device)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)
        self._never_used_blocks = np.ones(num_blocks, dtype=bool)
        self._zero_never_used_blocks([0])

    def _uses_cuda_graphs(self) -> bool:
        model_cfg = self.config.model
        return (self.device.type == "cuda" and not model_cfg.enforce_eager and model_cfg.task != "embed"
                and self.pp.size == 1)

    def capture_cuda_graphs(self) -> None:
        """On CUDA, capture the decode-step graphs over the allocated KV cache (not with enforce_eager)."""
        if not self._uses_cuda_graphs():
            return
        sizes = graph_batch_sizes(self.config.scheduler.max_num_seqs)
        max_blocks_per_seq = -(-self.max_model_len() // self.block_size)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, sizes, max_blocks_per_seq, self.block_size, self.device,
                cuda_graph_capture(self.device),
            )  # fmt: skip
        free_after, _ = torch.cuda.mem_get_info(self.device)
        log.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s (%.2f GiB); --enforce-eager turns them off",
            sizes, time.perf_counter() - started, (free_before - free_after) / 2**30,
        )  # fmt: skip

    def _zero_never_used_blocks(self, block_ids: list[int]) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        fresh = np.unique(ids[self._never_used_blocks[ids]])
        if fresh.size == 0:
            return
        self._never_used_blocks[fresh] = False
        index = torch.from_numpy(fresh).to(self.device)
        zero_kv_blocks(self.kv_caches, index)
        if self.draft is not None:
            zero_kv_blocks(self.draft.kv_caches, index)

    # ---------------------------------------------------------------- steps

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's diff, run one forward over every scheduled token, and sample where a token is due."""
        for request_id in plan.finished_ids:
            self._requests.pop(request_id, None)
        scheduled: list[tuple[_Request, int, int]] = []
        handed_out: list[int] = []
        for new in plan.new_requests:
            request = self._add_request(new)
            handed_out.extend(new.block_ids)
            scheduled.append((request, new.num_computed_tokens, new.num_scheduled_tokens))
        for running in plan.running:
            request = self._requests[running.request_id]
            request.token_ids.extend(running.new_token_ids)
            request.block_ids.extend(running.new_block_ids)
            handed_out.extend(running.new_block_ids)
            scheduled.append((request, running.num_computed_tokens, running.num_scheduled_tokens))
        if handed_out:
            self._zero_never_used_blocks(handed_out)
        scheduled = [entry for entry in scheduled if entry[2] > 0]
        if not scheduled:
            return StepResult(plan.step_id, [], [])

        started = time.perf_counter()
        drafts = {running.request_id: running.spec_token_ids for running in plan.running if running.spec_token_ids}
        if self.pp.size > 1:  # micro-batches flow through the stages; only the last stage has hidden states
            batch, hidden = pipelined_forward(self.model, self.pp, self.tp, self.kv_caches, scheduled,
                                              lambda part: self._prepare_batch(part, drafts), self.dtype)
            if hidden is None:
                return StepResult(plan.step_id, [], [], model_time_s=time.perf_counter() - started)
        else:
            batch = self._prepare_batch(scheduled, drafts)
            graphs = self.decode_graphs
            if graphs is not None and graphs.can_run(batch.attn):
                hidden = graphs.run(batch.input_ids, batch.positions, batch.attn)
            else:
                hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches)
            if self.draft is not None:  # the draft's KV for the same tokens, in its own caches
                self.draft.fill(batch.input_ids, batch.positions, batch.attn)
        rows = prompt_rows(scheduled)  # every rank: the LM head over the prompt positions that ask for logprobs
        prompt_logprobs = rows and compute_prompt_logprobs(self.model.compute_logits, hidden, rows, self.tp.rank,
                                                           max(8, self.config.scheduler.max_num_seqs // 2))
        if not batch.sampled_requests:
            return StepResult(plan.step_id, [], [], model_time_s=time.perf_counter() - started)
        # every rank: the vocab-parallel LM head gathers its logits from all of them
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        if self.tp.rank != 0:  # the last stage's tensor-parallel rank 0 samples
            self._propose_drafts(batch.sampled_requests, None)  # a sharded draft proposes on every rank
            return StepResult(plan.step_id, [], [], model_time_s=time.perf_counter() - started)
        if plan.grammar_request_ids:
            logits = apply_grammar_bitmask(logits, [request.request_id for request in batch.sampled_requests],
                                           plan.grammar_request_ids, plan.grammar_bitmask)
        states = [request.sampling for request in batch.sampled_requests]
        if batch.drafts is not None:  # speculative decoding: verify every draft in the rows after its request's
            accepted = verify_point_mass_drafts(logits, states, batch.drafts)
            for state, token_ids in zip(states, accepted):
                state.output_token_ids.extend(token_ids)
            return StepResult(plan.step_id, [request.request_id for request in batch.sampled_requests],
                              [token_ids[0] for token_ids in accepted], model_time_s=time.perf_counter() - started,
                              prompt_logprobs=prompt_logprobs or None, accepted_token_ids=accepted,
                              draft_token_ids=self._propose_drafts(batch.sampled_requests, accepted))
        result = sample(logits, states)
        for state, token_id in zip(states, result.token_ids):
            state.output_token_ids.append(token_id)
        return StepResult(
            plan.step_id,
            [request.request_id for request in batch.sampled_requests],
            result.token_ids,
            logprobs=result.logprobs,
            model_time_s=time.perf_counter() - started,
            prompt_logprobs=prompt_logprobs or None,
            draft_token_ids=self._propose_drafts(batch.sampled_requests, [[token] for token in result.token_ids]),
        )

    def _propose_drafts(self, requests: list[_Request],
                        new_token_ids: list[list[int]] | None) -> list[list[int]] | None:
        """With a draft model, its proposals after each sampled request's new tokens (they reach the request's token
        list with the next plan), aligned with `requests`; None without one.

        With tensor parallelism every rank calls this at the same point of the step (the draft's layers all-reduce):
        rank 0 with the new tokens, the others with None, which receive them from rank 0."""
        if self.draft is None:
            return None
        counts, last_tokens = self._share_new_tokens(new_token_ids, len(requests))
        positions = [len(request.token_ids) + count - 1 for request, count in zip(requests, counts)]
        return self.draft.propose(last_tokens, positions, [request.block_ids for request in requests])

    def _share_new_tokens(self, new_token_ids: list[list[int]] | None, num: int) -> tuple[list[int], list[int]]:
        """(how many, the newest) of each sampled request's new tokens, on every tensor-parallel rank: broadcast from
        rank 0, which alone verified and sampled them (one small int64 tensor; no collective on one rank)."""
        if self.tp.size == 1:
            return [len(tokens) for tokens in new_token_ids], [tokens[-1] for tokens in new_token_ids]
        shared = torch.zeros(2 * num, dtype=torch.int64)
        if new_token_ids is not None:
            shared[:num] = torch.tensor([len(tokens) for tokens in new_token_ids], dtype=torch.int64)
            shared[num:] = torch.tensor([tokens[-1] for tokens in new_token_ids], dtype=torch.int64)
        shared = shared.to(self.device)
        dist.broadcast(shared, src=self.rank - self.tp.rank, group=self.tp.group)  # src: the group's rank 0, globally
        values = shared.tolist()
        return values[:num], values[num:]

    def _add_request(self, new: NewRequestData) -> _Request:
        sampling = None
        if new.task == "generate":
            prompt = new.token_ids[: new.num_prompt_tokens]
            sampling = RequestSamplingState(new.sampling, prompt, self.eos_token_ids, self.device)
            sampling.output_token_ids.extend(new.token_ids[new.num_prompt_tokens :])  # resumed after preemption
        request = _Request(new.request_id, list(new.token_ids), list(new.block_ids), new.task, sampling)
        request.prompt_logprobs = prompt_logprobs_state(new)
        self._requests[new.request_id] = request
        return request

    def _prepare_batch(self, scheduled: list[tuple[_Request, int, int]],
                       drafts: dict[str, list[int]] | None = None) -> _StepBatch:
        """The flat batch: token ids, positions, attention metadata and the rows to sample, built once per step.

        `drafts` (speculative decoding): request id -> draft tokens scheduled after its known tokens, this step only;
        such a request is sampled at its last known token and at every draft."""
        drafts = drafts or {}
        num_seqs = len(scheduled)
        query_lens = np.fromiter((n for _, _, n in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((start for _, start, _ in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = starts + query_lens
        blocks_needed = -(-seq_lens // self.block_size)
        block_tables = np.zeros((num_seqs, int(blocks_needed.max())), dtype=np.int64)
        input_ids: list[int] = []
        sample_rows: list[int] = []
        sampled_requests: list[_Request] = []
        sampled_drafts: list[list[int]] = []
        end_row = 0
        for seq, (request, start, num_tokens) in enumerate(scheduled):
            end = start + num_tokens
            request_drafts = drafts.get(request.request_id, ())
            known = len(request.token_ids) + len(request_drafts)
            if end > known or (request_drafts and end != known) or blocks_needed[seq] > len(request.block_ids):
                raise ValueError(
                    f"request {request.request_id}: {num_tokens} tokens scheduled from {start} but it knows "
                    f"{known} tokens and {len(request.block_ids)} blocks"
                )
            input_ids.extend(request.token_ids[start:end])
            if request_drafts:
                input_ids.extend(request_drafts)
            block_tables[seq, : blocks_needed[seq]] = request.block_ids[: blocks_needed[seq]]
            end_row += num_tokens
            if end == known and request.sampling is not None:
                sample_rows.extend(range(end_row - 1 - len(request_drafts), end_row))
                sampled_requests.append(request)
                sampled_drafts.append(list(request_drafts))

        device = self.device
        return _StepBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(device),
            positions=torch.from_numpy(token_positions(query_lens, seq_lens)).to(device),
            attn=build_attention_metadata(query_lens, seq_lens, block_tables, self.block_size, device,
                                          attention_backend(device.type), self.decode_chunk_tokens()),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long).to(device),
            sampled_requests=sampled_requests,
            drafts=sampled_drafts if drafts else None,
        )
