"""The offline API: `LLM(model, **engine_args).generate(prompts, SamplingParams(...))`, `.embed(texts)` for
embedding models, `.score(text_1, text_2)` and `.classify(texts)` for sequence classifiers.

It starts the same scheduler and worker processes as `tokenmill serve` and talks to them over the same sockets with a
blocking client, so offline results are exactly what the server would produce.
"""

from __future__ import annotations

import itertools
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from tqdm import tqdm

from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.data_parallel import DataParallelEngines, EngineSockets
from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.logprobs import TokenTexts
from tokenmill.frontend.outputs import CompletionOutput, next_delta
from tokenmill.frontend.prompt_logprobs import vllm_prompt_logprobs
from tokenmill.frontend.protocol import PromptLogprobs
from tokenmill.launcher import kv_capacity_error
from tokenmill.lora import check_adapter_tensors, read_peft_config
from tokenmill.messages import (
    EngineReady,
    EngineRequest,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
    StepOutputs,
    StepSummary,
    WatchSteps,
    choice_requests,
)
from tokenmill.speculative import parse_speculative_config
from tokenmill.stats import sum_counters

if TYPE_CHECKING:
    from tokenmill.llm_scoring import ClassificationResult, ScoringResult

READY_TIMEOUT_S = 600.0


@dataclass
class GenerationResult:
    """What `LLM.generate` returns per prompt (shaped like vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # with SamplingParams(prompt_logprobs=k), as vLLM: None for the first prompt token, then {token id: Logprob}
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingResult:
    """What `LLM.embed` returns per prompt (shaped like vLLM's EmbeddingRequestOutput: `.outputs.embedding`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class EngineStats:
    """The engine's step timings summed over every step reported to this LLM (from `SchedulerStats`).

    `step_time_s` is the scheduler's wall time per step (plan, send, wait for the worker, update);
    `model_time_s` is the part the worker spent in forward + sampling. The rest is scheduling and messaging.
    """

    num_steps: int = 0
    step_time_s: float = 0.0
    model_time_s: float = 0.0
    grammar_mask_time_s: float = 0.0  # of the scheduling time: filling structured-output bitmasks
    # speculative decoding: verifications (one per request per step), draft tokens verified, drafts accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @classmethod
    def from_totals(cls, totals: SchedulerStats | None) -> EngineStats:
        """The timings of `totals`, every report summed (`tokenmill.stats.sum_counters`); zeros before any."""
        if totals is None:
            return cls()
        return cls(
            totals.num_steps,
            totals.step_time_s,
            totals.model_time_s,
            totals.grammar_mask_time_s,
            totals.spec_num_drafts,
            totals.spec_num_draft_tokens,
            totals.spec_num_accepted_tokens,
        )

    def since(self, earlier: EngineStats) -> EngineStats:
        """The steps reported after the snapshot `earlier` was taken."""
        return EngineStats(
            self.num_steps - earlier.num_steps,
            self.step_time_s - earlier.step_time_s,
            self.model_time_s - earlier.model_time_s,
            self.grammar_mask_time_s - earlier.grammar_mask_time_s,
            self.spec_num_drafts - earlier.spec_num_drafts,
            self.spec_num_draft_tokens - earlier.spec_num_draft_tokens,
            self.spec_num_accepted_tokens - earlier.spec_num_accepted_tokens,
        )

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over verified draft tokens (0 when none were verified)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def overhead_time_s(self) -> float:
        return self.step_time_s - self.model_time_s

    @property
    def overhead_fraction(self) -> float:
        """Scheduling + messaging time over step time (0 when no step was reported)."""
        return self.overhead_time_s / self.step_time_s if self.step_time_s > 0 else 0.0


def _engine_config(model: str, kwargs: dict) -> EngineConfig:
    """Spread vLLM-style keyword arguments (dtype=..., max_model_len=..., block_size=...) over the config sections."""
    sections = {
        "model": ModelConfig,
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "parallel": ParallelConfig,
        "lora": LoRAConfig,  # enable_lora=True, max_loras=..., max_lora_rank=..., max_cpu_loras=...
    }
    values: dict[str, dict] = {name: {} for name in sections}
    kwargs = dict(kwargs)
    speculative = parse_speculative_config(kwargs.pop("speculative_config", None))
    for key, value in kwargs.items():
        owner = next((name for name, cls in sections.items() if key in cls.__struct_fields__), None)
        if owner is None:
            raise TypeError(f"LLM() got an unexpected engine argument {key!r}")
        values[owner][key] = value
    values["model"]["model"] = model
    return EngineConfig(**{name: sections[name](**vals) for name, vals in values.items()}, speculative=speculative)


def stop_engine(processes: DataParallelEngines, ctx: zmq.Context) -> None:
    """Stop an LLM's engine processes and close its sockets (its finalizer: it must not reference the LLM)."""
    processes.stop()
    ctx.destroy(linger=0)


class LLM:
    def __init__(self, model: str = "", **engine_args) -> None:
        from tokenmill.frontend.tokenizer import load_tokenizer
        from tokenmill.model_source import resolve_config

        # one engine replica, or data_parallel_size of them behind a router (tokenmill/data_parallel.py)
        self.processes = DataParallelEngines(resolve_config(_engine_config(model, engine_args)))
        self.config = self.processes.config
        self._ctx = zmq.Context()
        self._engines = EngineSockets(self._ctx, self.processes.configs)
        self._ids = itertools.count()
        self._stats_totals: SchedulerStats | None = None  # every report summed, as the server's engine client
        # called with every StepOutputs as it arrives (one per engine step that produced output); benchmarks use it
        # to time individual steps
        self.step_listener: Callable[[StepOutputs], None] | None = None
        self.summary_listener: Callable[[StepSummary], None] | None = None  # see watch_steps
        # Stops the processes when the LLM is collected (`del llm`, out of scope) or at interpreter exit. It holds the
        # processes and the socket context, never `self`: a bound method (as atexit.register(self.shutdown) was)
        # would keep the LLM, and so its processes and their memory, alive until the interpreter exits.
        self._finalizer = weakref.finalize(self, stop_engine, self.processes, self._ctx)
        try:
            self.processes.start()
            self.tokenizer = load_tokenizer(self.config.model)
            self.engine_info: EngineReady = self._wait_ready()
        except BaseException:
            self.shutdown()  # a failed start leaves no engine processes behind
            raise

    # ------------------------------------------------------------------ plumbing

    def _receive(self, timeout_ms: int = 200):
        """The next scheduler message, or None after timeout_ms; raises if an engine process has died."""
        msg = self._engines.receive(timeout_ms)
        if msg is not None:
            return msg
        dead = self.processes.dead_child()
        if dead is not None:
            raise RuntimeError(f"The engine stopped: {dead}.")
        return None

    def _wait_ready(self) -> EngineReady:
        """The first replica's EngineReady, once every replica has sent one."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        readies: list[EngineReady] = []
        while time.monotonic() < deadline:
            msg = self._receive()
            if isinstance(msg, EngineReady):
                error = kv_capacity_error(self.config, msg)
                if error is not None:
                    raise ValueError(error)
                readies.append(msg)
                if len(readies) == self.processes.size:
                    return readies[0]
        raise TimeoutError(f"the engine did not become ready within {READY_TIMEOUT_S:.0f} s")

    def shutdown(self) -> None:
        """Stop the engine processes (also done when the LLM is collected, and at interpreter exit). Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def watch_steps(self, listener: Callable[[StepSummary], None] | None, interval_s: float = 0.05) -> None:
        """Have the scheduler send a StepSummary (what the dashboard shows) at most every `interval_s`, handed to
        `listener` while generate() runs; None stops them."""
        self.summary_listener = listener
        self._engines.broadcast(WatchSteps(interval_s if listener is not None else 0.0))

    def engine_stats(self) -> EngineStats:
        """A snapshot of the step timings reported so far (subtract two with `since` to time one call)."""
        return EngineStats.from_totals(self._stats_totals)

    # ------------------------------------------------------------------ generation

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (vLLM's: none with generation_config="vllm");
        `generate` uses it when given no sampling params."""
        return SamplingParams(**self.config.model.generation_defaults)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text, or token ids); results come back in prompt order. Any number of prompts:
        they are fed to the engine as earlier ones finish. `lora_request`: the LoRA adapter of every prompt, or one
        per prompt (None: the base model), with LLM(..., enable_lora=True)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = self._lora_requests(lora_request, len(prompts))
        results: list[GenerationResult] = []

        def requests_of(i: int, prompt, params: SamplingParams) -> list[tuple[EngineRequest, tuple]]:
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            result = GenerationResult(f"{next(self._ids)}-{uuid.uuid4().hex[:8]}", text, ids)
            results.append(result)
            if params.max_tokens is None:
                params = msgspec.structs.replace(params, max_tokens=max(1, self.config.model.max_model_len - len(ids)))
            group = EngineRequest(
                request_id=result.request_id,
                prompt_token_ids=ids,
                sampling=params,
                arrival_time=time.time(),
                priority=priority[i] if priority else 0,
                lora_request=loras[i],
            )
            requests = []
            for index, request in enumerate(choice_requests(group)):  # sent one by one, to fill the window evenly
                completion = CompletionOutput(index)
                result.outputs.append(completion)
                requests.append(
                    (request, (result, completion, IncrementalDetokenizer(self.tokenizer, ids, request.sampling)))
                )
            return requests

        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        texts = TokenTexts(self.tokenizer)

        def on_output(out: RequestOutput, choice: tuple) -> bool:
            result, completion, detok = choice
            if out.error is not None:
                raise ValueError(out.error)
            if out.prompt_logprobs is not None and result.prompt_logprobs is None:  # every choice has them: the first
                result.prompt_logprobs = vllm_prompt_logprobs(result.prompt_token_ids, out.prompt_logprobs, texts)
            completion.add(next_delta(completion.index, detok, out))
            if not completion.finished:
                return False
            if completion.finish_reason == "stop" and out.finish_reason is None:
                self._engines.send_abort([out.request_id])  # a stop string ended it
            if result.finished:
                result.num_cached_tokens = out.num_cached_tokens
                bar.update(1)
            return True

        with bar:
            self._run(itertools.starmap(requests_of, zip(itertools.count(), prompts, params_list)), on_output)
        return results

    # ------------------------------------------------------------------ embeddings

    def _lora_requests(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each folder checked here (ValueError) before the engine reads it."""
        if lora_request is None:
            return [None] * num_prompts
        loras = [lora_request] * num_prompts if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(f"give one lora_request, or one per prompt ({num_prompts}), not {len(loras)}")
        if any(lora is not None for lora in loras) and not self.config.lora.enable_lora:
            raise ValueError("a lora_request was given but LoRA is disabled: create the LLM with enable_lora=True")
        for lora in {lora.lora_int_id: lora for lora in loras if lora is not None}.values():
            if lora.lora_int_id <= 0:
                raise ValueError(
                    f"LoRA adapter {lora.lora_name!r}: lora_int_id must be positive, got {lora.lora_int_id}"
                )
            config = read_peft_config(lora.lora_path, self.config.lora.max_lora_rank)
            check_adapter_tensors(config, self.config.model.hidden_size)
        return loras

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingResult]:
        """One pooled embedding per prompt (text, or token ids), in prompt order; needs an embedding model.
        `truncate_prompt_tokens` keeps each prompt's last N tokens (text keeps its special tokens)."""
        import numpy as np

        from tokenmill.frontend.tokenizer import encode_text_keep_last

        if self.config.model.task != "embed":
            raise ValueError(
                f"embed() needs an embedding model; {self.config.model.served_model_name} serves "
                f"'{self.config.model.task}' (pass task='embed' to LLM for a decoder)"
            )
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        results: list[EmbeddingResult] = []

        def requests_of(prompt) -> list[tuple[EngineRequest, EmbeddingResult]]:
            text = prompt if isinstance(prompt, str) else None
            if text is None:
                ids = list(prompt)[-truncate_prompt_tokens:] if truncate_prompt_tokens else list(prompt)
            elif truncate_prompt_tokens:
                ids = encode_text_keep_last(self.tokenizer, text, True, truncate_prompt_tokens)
            else:
                ids = self.tokenizer.encode(text)
            request_id = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            results.append(EmbeddingResult(request_id, text, ids, EmbeddingOutput([]), finished=False))
            request = EngineRequest(
                request_id=request_id,
                prompt_token_ids=ids,
                task="embed",
                sampling=SamplingParams(max_tokens=None),
                arrival_time=time.time(),
            )
            return [(request, results[-1])]

        bar = tqdm(total=len(prompts), desc="Embedded prompts", disable=not use_tqdm, dynamic_ncols=True)

        def on_output(out: RequestOutput, result: EmbeddingResult) -> bool:
            if out.error is not None or out.embedding is None:
                raise ValueError(
                    out.error
                    or f"the engine ended request {out.request_id} with '{out.finish_reason}' and no embedding"
                )
            result.outputs.embedding = np.frombuffer(out.embedding, dtype="<f4").tolist()
            result.finished = True
            bar.update(1)
            return True

        with bar:
            self._run(map(requests_of, prompts), on_output)
        return results

    # ------------------------------------------------------------------ scores and classes (tokenmill/llm_scoring.py)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringResult]:
        """One relevance score per (text_1, text_2) pair, 1:N or N:N; needs a sequence classifier (task 'score')."""
        from tokenmill import llm_scoring

        return llm_scoring.score(self, text_1, text_2, truncate_prompt_tokens)

    def classify(
        self, prompts: str | Sequence[str], truncate_prompt_tokens: int | None = None
    ) -> list[ClassificationResult]:
        """Label probabilities per text; needs a sequence classifier (task 'classify' or 'score')."""
        from tokenmill import llm_scoring

        return llm_scoring.classify(self, prompts, truncate_prompt_tokens)

    def run_pooling_requests(self, requests: list[EngineRequest]) -> list[bytes]:
        """Each pooling request's float32 answer (embedding, scores or probabilities), in request order."""
        answers: dict[str, bytes] = {}

        def on_output(out: RequestOutput, request_id: str) -> bool:
            if out.error is not None or out.embedding is None:
                raise ValueError(out.error or f"the engine ended request {request_id} with '{out.finish_reason}'")
            answers[request_id] = out.embedding
            return True

        self._run(iter([[(request, request.request_id)] for request in requests]), on_output)
        return [answers[request.request_id] for request in requests]

    # ------------------------------------------------------------------ feeding the engine

    def _run(
        self, batches: Iterator[list[tuple[EngineRequest, Any]]], on_output: Callable[[RequestOutput, Any], bool]
    ) -> None:
        """Send each batch's requests (a prompt's choices) while at most `max_waiting_requests` are in flight, so
        the scheduler's waiting queue never overflows however many prompts there are; hand each output to
        `on_output` with its batch entry's state until it returns True (that request is done). On any error, abort
        what is in flight."""
        window = self.config.scheduler.max_waiting_requests
        in_flight: dict[str, Any] = {}
        batch = next(batches, None)
        try:
            while batch is not None or in_flight:
                while batch is not None and (not in_flight or len(in_flight) + len(batch) <= window):
                    for request, state in batch:
                        in_flight[request.request_id] = state
                        self._engines.send_request(request)
                    batch = next(batches, None)
                for out in self._step_outputs():
                    state = in_flight.get(out.request_id)
                    if state is not None and on_output(out, state):
                        del in_flight[out.request_id]
        except BaseException:
            self._engines.send_abort(list(in_flight))
            raise

    def _step_outputs(self) -> list[RequestOutput]:
        """The outputs of the next engine step (none after a quiet poll); feeds the stats and the step listener."""
        msg = self._receive()
        if isinstance(msg, StepSummary) and self.summary_listener is not None:
            self.summary_listener(msg)
        if not isinstance(msg, StepOutputs):
            return []
        if msg.stats is not None:
            reports = [msg.stats] if self._stats_totals is None else [self._stats_totals, msg.stats]
            self._stats_totals = sum_counters(reports, gauges=msg.stats)
        if self.step_listener is not None:
            self.step_listener(msg)
        return msg.outputs
