"""The worker: owns the device, the distributed groups, the model, the KV cache and the decode graphs, and runs each
StepPlan as one pipeline:

    apply the plan (request_state.py) -> prepare inputs (step_inputs.py) -> forward (step_forward.py: eager, graph
    or pipelined, chosen at start-up) -> sample stage (sample_stage.py) -> one StepResult (`step_result` below)

Start-up, as `workers/process.py` drives it: `Worker(config, rank)` -> `load_model()` -> `num_kv_blocks_for_budget()`
(on CUDA profiles a worst-case step and warms the Triton kernels up over a dummy cache, `workers/warm_up.py`, before
reading the free memory) -> `allocate_kv_cache(n)` -> `warm_up_kernels()` (where the profile did not run: a fixed
block count) -> `capture_cuda_graphs()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig, is_pooling_task
from tokenmill.kernels.kv_quant import check_kv_cache_device, kv_cache_torch_dtype
from tokenmill.messages import PromptLogprobs, StepPlan, StepResult
from tokenmill.workers.attention import (
    DECODE_GATHER_BYTES,
    AttentionMetadata,
    build_attention_metadata,
    token_positions,
)
from tokenmill.workers.backends import attention_backend, runs_triton
from tokenmill.workers.capture_plan import CapturePlan, plan_cuda_graphs
from tokenmill.workers.cpu_backend import CpuKernelBackend
from tokenmill.workers.cpu_graphs import CPU_GRAPH_BATCH_SIZES, NotCapturable
from tokenmill.workers.cpu_verify_graphs import MAX_VERIFY_TOKENS, CpuSpeculativeGraphs
from tokenmill.workers.cuda_graphs import DecodeGraphs, cuda_graph_capture
from tokenmill.workers.distributed import init_distributed, parallel_position, resolve_device
from tokenmill.workers.draft_proposer import DraftModel
from tokenmill.workers.kv_cache import KVCache, PagedKVCache, kv_block_bytes
from tokenmill.workers.lora.manager import LoRAManager, slot_dtype
from tokenmill.workers.memory_profile import GpuMemory, ProfiledStep, kv_blocks_in_budget, worst_case_step
from tokenmill.workers.model_facts import prompt_logprobs_row_cost, read_eos_token_ids, text_config, weight_bytes
from tokenmill.workers.model_loader import default_dtype, iter_weights, load_hf_config, resolve_dtype
from tokenmill.workers.models.layers import pack_linear_weights
from tokenmill.workers.models.llama import LlamaForCausalLM, PagedCausalLM
from tokenmill.workers.models.registry import architecture_of, model_class
from tokenmill.workers.pipeline_parallel import stage_forward
from tokenmill.workers.prompt_logprobs import compute_prompt_logprobs, prompt_logprobs_chunk_rows, prompt_rows
from tokenmill.workers.quantization.base import QuantizedWeight
from tokenmill.workers.request_state import CachedRequest, RequestStates, ScheduledRequest, plan_drafts
from tokenmill.workers.sample_profile import WorstCaseSampling, profile_sample_stage
from tokenmill.workers.sample_stage import SampledTokens, SampleStage
from tokenmill.workers.staging import ALIGNMENT as STAGING_ALIGNMENT
from tokenmill.workers.staging import StepStaging
from tokenmill.workers.step_forward import PipelinedStageForward, SingleStageForward, StepForward
from tokenmill.workers.step_inputs import InputPreparer
from tokenmill.workers.warm_up import DummyStepRunner, warm_up_steps

log = logging.getLogger(__name__)

StepPromptLogprobs = dict[str, PromptLogprobs]  # request id -> its prompt positions' logprobs, packed


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = resolve_device(config, rank)
        self.pp, self.tp = parallel_position(config, rank)
        self.world_size = config.parallel.world_size
        self.block_size = config.cache.block_size
        self.hf_config: Any = None  # a transformers PretrainedConfig
        self.architecture = ""
        self.dtype = torch.float32
        self.model: Any = None  # a PagedCausalLM (an encoder in embedding instances)
        self.weight_bytes = 0
        self.prompt_logprobs_row_cost = 0.0  # a prompt position's LM head and scoring, in forward tokens
        self.eos_token_ids: list[int] = []
        self.kv_cache: PagedKVCache | None = None  # set by allocate_kv_cache
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_cuda_graphs
        self._kernels_warm = False  # every Triton kernel variant compiled (warm_up_kernels ran, during the profile)
        self.profiled_step: ProfiledStep | None = None  # set by the memory profile (CUDA)
        self.draft: DraftModel | None = None  # speculative decoding's draft model (workers/draft_proposer.py)
        self.lora: LoRAManager | None = None  # with enable_lora: the adapters' slots (workers/lora/)
        self.requests = RequestStates([], self.device)  # every request held between steps
        # the step's stages, built by allocate_kv_cache (the forward chosen again once graphs are captured)
        self.forward: StepForward | None = None
        self.inputs: InputPreparer | None = None
        self.sampler: SampleStage | None = None
        self.staging: StepStaging | None = None  # the step inputs' one host-to-device copy, made by allocate_kv_cache
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._cuda_memory_at_start = torch.cuda.mem_get_info(self.device)  # (free, total) before any weight
        elif self.world_size > 1 and config.parallel.distributed_executor_backend == "mp":
            # the ranks share the host's cores: oversubscribed, every all-reduce would wait on the slowest rank
            torch.set_num_threads(max(1, torch.get_num_threads() // self.world_size))
        torch.manual_seed(config.model.seed)
        if self.world_size > 1:
            self.tp = init_distributed(config, rank, self.device, self.pp, self.tp)

    # ---------------------------------------------------------------- the model

    def load_model(self) -> None:
        """Build the model on the target device and dtype, then stream the checkpoint into it."""
        model_cfg = self.config.model
        self.hf_config = load_hf_config(model_cfg)
        self.architecture = model_cfg.architecture or architecture_of(self.hf_config)
        self.dtype = resolve_dtype(model_cfg, self.hf_config, self.device)
        started = time.perf_counter()
        with torch.device(self.device), default_dtype(self.dtype):
            model = self.build_model()
        model.load_weights(self.checkpoint_weights())
        self.model = model.eval()
        self.weight_bytes = weight_bytes(model)
        if self.vocab_size and model.lm_head is not None:  # a language model's last pipeline stage
            hidden_size = self.text_config.hidden_size
            self.prompt_logprobs_row_cost = prompt_logprobs_row_cost(model, self.vocab_size, hidden_size)
        if self.config.lora.enable_lora:
            self.lora = self._build_lora(model)
        if self.device.type == "cpu":
            pack_linear_weights(model)
        self.eos_token_ids = read_eos_token_ids(model_cfg.path, self.hf_config)
        self.requests = RequestStates(self.eos_token_ids, self.device)
        if self.config.speculative.method == "draft_model":
            self.draft = DraftModel(
                self.config,
                self.device,
                self.dtype,
                self.kv_cache_dtype,
                self.max_model_len(),
                self.vocab_size,
                model_cfg.path,
                self.tp,
            )
        log.info(
            "loaded %s (%s, %.1f MiB of weights on %s) in %.1f s",
            self.architecture,
            str(self.dtype).removeprefix("torch."),
            self.weight_bytes / 2**20,
            self.device,
            time.perf_counter() - started,
        )

    def _build_lora(self, model: Any) -> LoRAManager:
        """The LoRA slot pool on the model's layers (one decoder stage, generation only)."""
        if self.pp.size > 1 or self.config.model.task == "embed" or not isinstance(model, PagedCausalLM):
            raise ValueError("enable_lora needs a decoder for generation without pipeline parallelism")
        with torch.device(self.device), default_dtype(slot_dtype(self.config.lora, self.dtype)):
            return LoRAManager(model, self.config.lora, int(self.text_config.num_hidden_layers), self.dtype)

    def build_model(self) -> Any:
        """The model (a PagedCausalLM; an encoder in embedding instances) with uninitialised weights, on the current
        default device and dtype."""
        cls = model_class(self.architecture)
        if self.pp.size == 1:
            return cls(self.hf_config, tp=self.tp, max_model_len=self.max_model_len())
        if not (issubclass(cls, PagedCausalLM) and cls.supports_pipeline_parallel):
            raise ValueError(f"{self.architecture} does not support pipeline_parallel_size > 1")
        return cls(self.hf_config, tp=self.tp, pp=self.pp, max_model_len=self.max_model_len())

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(HF name, tensor) pairs for `load_weights`; a pipeline stage reads only its own tensors."""
        if self.pp.size == 1:
            return iter_weights(self.config.model, self.device)
        num_layers = self.text_config.num_hidden_layers
        tied = bool(getattr(self.text_config, "tie_word_embeddings", False))  # absent: untied, as transformers
        return iter_weights(
            self.config.model, self.device, wanted=lambda name: self.pp.weight_name(name, num_layers, tied) is not None
        )

    @property
    def text_config(self) -> Any:
        return text_config(self.hf_config)

    @property
    def vocab_size(self) -> int:
        """The width of the logits the sampler sees."""
        return int(self.text_config.vocab_size)

    @property
    def kv_sliding_window(self) -> int | None:
        """The window the scheduler may free KV blocks by: set when every layer is windowed, else None."""
        return self.model.kv_sliding_window if isinstance(self.model, PagedCausalLM) else None

    @property
    def replayed_step(self) -> tuple[int, int]:
        """The largest multi-token step replayed from a recording, (sequences, tokens over them); (0, 0): none."""
        if isinstance(self.decode_graphs, CpuSpeculativeGraphs):
            return self.decode_graphs.verify.max_seqs, self.decode_graphs.verify.max_tokens
        return 0, 0

    def _sliding_windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of this rank's layers, the draft model's included."""
        windows = set(self.model.sliding_windows)
        if self.draft is not None:
            windows.update(self.draft.sliding_windows)
        return tuple(sorted(windows))

    def max_model_len(self) -> int:
        return self.config.model.max_model_len or int(self.text_config.max_position_embeddings)

    # ---------------------------------------------------------------- the KV cache

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or fp8 with `--kv-cache-dtype fp8` (kernels/kv_quant.py)."""
        return kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.dtype)

    @property
    def kv_caches(self) -> list[KVCache]:
        """Per layer of this rank the (K, V) cache tensors; empty before `allocate_kv_cache`."""
        return self.kv_cache.layers if self.kv_cache is not None else []

    def kv_block_bytes(self) -> int:
        """Bytes of one block across every layer, K and V (the draft model's layers too: they share the blocks)."""
        return self._target_kv_block_bytes() + (self.draft.kv_block_bytes() if self.draft is not None else 0)

    def _target_kv_block_bytes(self) -> int:
        return kv_block_bytes(self.model, self.block_size, self.kv_cache_dtype)

    def decode_chunk_tokens(self) -> int:
        """Keys per decode-attention chunk on the torch path: `DECODE_GATHER_BYTES` of one layer's K and V."""
        num_layers = int(self.model.num_layers)
        return max(1, DECODE_GATHER_BYTES * num_layers * self.block_size // self._target_kv_block_bytes())

    def num_kv_blocks_for_budget(self) -> int:
        """How many KV blocks fit: the configured count, the CPU byte budget, or what the GPU has left.

        With tensor or pipeline parallelism every rank must call this; they agree on the smallest count."""
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
        """The blocks that fit in gpu_memory_utilization of the GPU besides everything else this worker holds
        (`workers/memory_profile.py`)."""
        free_at_start, total = self._cuda_memory_at_start
        peak = self._profile_peak_memory()  # weights + activations
        free_now, _ = torch.cuda.mem_get_info(self.device)
        memory = GpuMemory(free_at_start, total, free_now, torch.cuda.memory_reserved(self.device), peak)
        graph_share = 0.0
        plan = self.capture_plan()
        if plan.captures:  # the graphs' pool: their largest batch's share of the profiled step
            graph_share = min(1.0, plan.batch_sizes[-1] / self.config.scheduler.max_num_batched_tokens)
        return kv_blocks_in_budget(memory, self.config.cache.gpu_memory_utilization, self.kv_block_bytes(), graph_share)

    def _profile_peak_memory(self) -> int:
        """Bytes this process holds at the peak of a worst-case step, KV excluded: a forward of
        max_num_batched_tokens tokens, then (last stage) its sample stage at its costliest (`sample_profile.py`)."""
        sched = self.config.scheduler
        step = worst_case_step(sched.max_num_batched_tokens, self.max_model_len(), self.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.allocate_kv_cache(step.num_blocks)
        dummy_kv_bytes = step.num_blocks * self.kv_block_bytes()
        attn = build_attention_metadata(
            step.seq_lens,
            step.seq_lens,
            step.block_tables,
            self.block_size,
            self.device,
            attention_backend(self.device.type),
        )
        with torch.inference_mode():
            hidden = self._profile_forward(step.seq_lens, attn)
            forward_peak = torch.cuda.max_memory_reserved(self.device) - dummy_kv_bytes
            if self.pp.is_last:
                worst = WorstCaseSampling.from_config(self.config, self.vocab_size, self.max_model_len())
                compute_logits = self.model.compute_logits
                profile_sample_stage(worst, compute_logits, hidden, attn, self.rank, self.tp, self.eos_token_ids)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device) - dummy_kv_bytes
        # Every Triton kernel variant compiles and loads now, over the dummy cache, so what that holds outside
        # torch's allocator (kernel images, local memory) is gone from the free memory the budget is read from: the
        # second device run (2026-11-27) peaked 1.6 GiB past 0.9 of the GPU with the warm-up after the budget.
        self.warm_up_kernels()
        assert self.kv_cache is not None
        self.kv_cache.release()
        del hidden
        torch.cuda.empty_cache()
        self.profiled_step = ProfiledStep(int(step.seq_lens.sum()), forward_peak, peak)
        self.profiled_step.log()
        return peak

    def _profile_forward(self, seq_lens: np.ndarray, attn: AttentionMetadata) -> torch.Tensor:
        """This stage's output over whole prompts of `seq_lens` (dummy token ids; a later stage starts from zeros)."""
        num_tokens = int(seq_lens.sum())
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.from_numpy(token_positions(seq_lens, seq_lens)).to(self.device)
        intermediate = None
        if not self.pp.is_first:
            intermediate = torch.zeros(
                2, num_tokens, self.text_config.hidden_size, dtype=self.dtype, device=self.device
            )
        return stage_forward(self.model, self.pp, input_ids, positions, attn, self.kv_caches, intermediate)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer a K and a V cache `[num_blocks, block_size, num_kv_heads, head_dim]` (`workers/kv_cache.py`),
        and the forward that runs over them."""
        check_kv_cache_device(self.kv_cache_dtype, self.device)
        self.kv_cache = PagedKVCache(
            self.model, self.draft, num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
        self.decode_graphs = None
        self.forward = self._choose_forward()
        self.staging = StepStaging(self.device, initial_bytes=self._staging_bytes())
        self.inputs = InputPreparer(
            self.block_size,
            self.device,
            attention_backend(self.device.type),
            self.decode_chunk_tokens(),
            self._sliding_windows(),
            self.staging,
            self.vocab_size,
            self.lora,
        )
        self.sampler = SampleStage(self.model.compute_logits, self.rank, self.tp, self.device, self.draft)

    def capture_plan(self) -> CapturePlan:
        """Which decode batches are captured as CUDA graphs and how they meet the collectives
        (`workers/capture_plan.py`)."""
        return plan_cuda_graphs(self.config, self.device.type, self.pp.size, self.tp.size)

    def _staging_bytes(self) -> int:
        """Bytes a step's staged inputs take at the configured limits (the staging buffer still grows past them)."""
        sched = self.config.scheduler
        max_blocks = -(-self.max_model_len() // self.block_size)
        per_token = 3 * 8  # token id, position, slot
        # block-table row; query start, seq len, prefill start; sample row; sampling parameters, random / filter row
        per_seq = 4 * max_blocks + 3 * 4 + 8 + 4 * 4 + 2 * 8
        return sched.max_num_batched_tokens * per_token + sched.max_num_seqs * per_seq + 16 * STAGING_ALIGNMENT

    def _uses_cuda_graphs(self) -> bool:
        """Whether decode graphs are captured (the capture plan's answer; kept for callers written before it)."""
        return self.capture_plan().captures

    def warm_up_kernels(self) -> None:
        """Where steps run Triton kernels, compile every variant a step can use by running dummy steps that write no
        KV (`workers/warm_up.py`), and log how long it took; nothing elsewhere (nothing compiles at run time)."""
        if self._kernels_warm or not (runs_triton(self.device.type) and isinstance(self.model, PagedCausalLM)):
            return
        from tokenmill.workers.triton_backend import device_sm_count  # imports triton: only where it runs

        sched = self.config.scheduler
        steps = warm_up_steps(
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            self.max_model_len(),
            int(self.model.num_kv_heads),
            device_sm_count(self.device),
        )
        runner = DummyStepRunner(
            self.model,
            self.kv_caches,
            attention_backend(self.device.type),
            self.pp,
            self.tp,
            self.block_size,
            self.device,
            self.dtype,
            int(self.text_config.hidden_size),
            self._sliding_windows(),
        )
        started = time.perf_counter()
        with torch.inference_mode():
            for step in steps:
                runner.run(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._kernels_warm = True
        log.info(
            "warmed up the Triton kernels with %d dummy steps in %.1f s", len(steps), time.perf_counter() - started
        )

    def capture_cuda_graphs(self) -> None:
        """On the CPU, record the decoder's kernel calls for small decode batches (`workers/cpu_graphs.py`); on CUDA,
        follow the capture plan (logged): capture the decode-step graphs over the allocated KV cache."""
        if self._uses_cpu_graphs():
            self._record_cpu_graphs()
            return
        plan = self.capture_plan()
        log.info("%s", plan.describe())
        if not plan.captures:
            return
        max_blocks_per_seq = -(-self.max_model_len() // self.block_size)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                list(plan.batch_sizes),
                max_blocks_per_seq,
                self.block_size,
                self.device,
                cuda_graph_capture(self.device, plan.split_at_collectives),
            )
        self.forward = self._choose_forward()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        log.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s (%.2f GiB); --enforce-eager turns them off",
            list(plan.batch_sizes),
            time.perf_counter() - started,
            (free_before - free_after) / 2**30,
        )

    def _uses_cpu_graphs(self) -> bool:
        model_cfg = self.config.model
        return (
            self.device.type == "cpu"
            and not model_cfg.enforce_eager
            and not is_pooling_task(model_cfg.task)
            and self.world_size == 1
            # LoRA steps are recorded with their slots staged in fixed buffers (LoRAStep.stage); with speculative
            # decoding too, adapters stay eager: the draft runs without them and that pairing is untested recorded
            and not (self.config.lora.enable_lora and self.config.speculative.method is not None)
            and isinstance(self.model, LlamaForCausalLM)
            and isinstance(attention_backend("cpu"), CpuKernelBackend)
        )

    def _record_cpu_graphs(self) -> None:
        """Record the decoder's kernel calls at the batch sizes where Python's share of a step is large; a model whose
        forward computes outside the kernels (a torch fallback, MoE routing) stays eager, with one log line."""
        sizes = [size for size in CPU_GRAPH_BATCH_SIZES if size <= self.config.scheduler.max_num_seqs]
        # and short multi-token steps, every shape at start-up (workers/cpu_verify_graphs.py): verifications, and a
        # small prefill chunk beside a decode (the prefill limit's steps), which eagerly took ~3x a decode step
        started = time.perf_counter()
        if self.lora is not None:  # the staged grouping holds the largest recorded step: decode or short multi-token
            self.lora.record_steps(max(*sizes, MAX_VERIFY_TOKENS))
        try:
            with torch.inference_mode():
                self.decode_graphs = CpuSpeculativeGraphs(
                    self.model,
                    self.kv_caches,
                    sizes,
                    -(-self.max_model_len() // self.block_size),
                    self.block_size,
                    int(self.text_config.hidden_size),
                    self.dtype,
                )
        except NotCapturable as exc:
            log.info("decode steps stay eager on the CPU: %s", exc)
            return
        finally:
            if self.lora is not None:
                self.lora.begin_step(None)
        self.forward = self._choose_forward()
        log.info(
            "recorded the decoder's CPU kernel calls for decode batch sizes %s in %.1f s; --enforce-eager turns "
            "this off",
            sizes,
            time.perf_counter() - started,
        )

    def _choose_forward(self) -> StepForward:
        """Pipelined with pipeline stages; else the whole model here, replaying decode graphs once captured."""
        assert self.kv_cache is not None
        if self.pp.size > 1:
            return PipelinedStageForward(
                self.model, self.kv_cache, self.pp, self.tp, self.dtype, int(self.text_config.hidden_size)
            )
        return SingleStageForward(self.model, self.kv_cache, self.draft, self.decode_graphs, self.lora)

    # ---------------------------------------------------------------- steps

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan, prepare the inputs, run the forward, sample: one StepResult (empty on silent ranks)."""
        assert self.kv_cache and self.forward and self.inputs and self.sampler, "allocate_kv_cache first"
        assert self.staging is not None
        self.staging.begin_step()
        scheduled = self.requests.apply(plan, self.kv_cache.zero_never_used)
        if not scheduled:
            return step_result(plan.step_id, [], None, None, 0.0)
        started, inputs, drafts = time.perf_counter(), self.inputs, plan_drafts(plan)
        batch, hidden = self.forward(
            scheduled, lambda part: inputs.prepare(part, drafts, plan.grammar_request_ids, plan.grammar_bitmask)
        )
        if hidden is None:  # a pipeline stage before the last
            return step_result(plan.step_id, [], None, None, time.perf_counter() - started)
        prompt_logprobs = self._prompt_logprobs(scheduled, hidden)
        sampled = self.sampler.run(plan, batch, hidden)
        if sampled is not None:  # the rank that chose them: what the next plan may ask it to append (overlap)
            self.requests.record_sampled(batch.sampled_requests, sampled.new_token_ids)
        return step_result(
            plan.step_id, batch.sampled_requests, sampled, prompt_logprobs, time.perf_counter() - started
        )

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> StepPromptLogprobs | None:
        """Every rank: the LM head over the prompt positions that ask for logprobs; rank 0's completed entries."""
        rows = prompt_rows(scheduled)
        if rows is None:
            return None
        return compute_prompt_logprobs(
            self.model.compute_logits,
            hidden,
            rows,
            self.tp.rank,
            prompt_logprobs_chunk_rows(self.config.scheduler.max_num_seqs),
        )


def step_result(
    step_id: int,
    requests: list[CachedRequest],
    sampled: SampledTokens | None,
    prompt_logprobs: StepPromptLogprobs | None,
    model_time_s: float,
) -> StepResult:
    """The one place a generation step's StepResult is built: empty where this rank sampled nothing."""
    if sampled is None:
        return StepResult(step_id, [], [], model_time_s=model_time_s)
    return StepResult(
        step_id,
        [request.request_id for request in requests],
        [token_ids[0] for token_ids in sampled.new_token_ids],
        logprobs=sampled.logprobs,
        model_time_s=model_time_s,
        prompt_logprobs=prompt_logprobs or None,
        accepted_token_ids=sampled.new_token_ids if sampled.verified_drafts else None,
        draft_token_ids=sampled.draft_token_ids,
    )
