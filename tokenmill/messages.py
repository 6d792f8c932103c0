"""Every message that crosses a process boundary, as plain msgspec Structs.

Frontend -> scheduler:  EngineRequest, AbortRequest, Ping, WatchSteps
Scheduler -> frontend:  StepOutputs (one per engine step, every request's new tokens), Pong, EngineReady,
                        StepSummary (sampled, while watched: the dashboard's feed)
Scheduler -> workers:   StepPlan (diffs: new requests in full, running ones as new blocks/tokens), Shutdown
Worker rank 0 -> sched: WorkerReady, StepResult, WorkerError

Messages are encoded with msgpack; structs are array-like (compact, positional) and tagged, so
one decoder per socket reads a union of message kinds. Nothing here is ever pickled.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """A constraint on the output, as vLLM's `structured_outputs`: exactly one of `json` (a JSON schema),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings), `grammar` (Lark, or GBNF/EBNF) and
    `structural_tag`. The scheduler compiles it (llguidance) and masks every sampled token with it.

    `begin_after_token_ids`: the constraint applies only once the output holds this token sequence (a reasoning
    model's end of thinking); None constrains from the first token."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    begin_after_token_ids: list[int] | None = None


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """Per-request sampling, as in vLLM. Also the offline API's user-facing object."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per sampled token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None  # top logprobs to return per prompt token (the first token's is None)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


# ---------------------------------------------------------------- frontend -> scheduler


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """The LoRA adapter a request runs with (vLLM's LoRARequest): a name, an id unique per loaded adapter (positive;
    a reload of the same name gets a new id, so no process mistakes the new weights for the old), and the local
    folder holding it in PEFT's layout (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class EngineRequest(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """A prompt to run `sampling.n` times: one message, one copy of the prompt and params, whatever n is."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    task: Literal["generate", "embed", "classify", "score"] = "generate"
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    # a request resumed on a fresh engine after its engine failed (--restart-on-failure): the tokens it had already
    # streamed. The scheduler takes them as its outputs so far, as after a recompute preemption: they are prefilled
    # with the prompt, and max_tokens, min_tokens, penalties and a seed's per-position draws count them as outputs,
    # so the request goes on exactly where it stopped
    resumed_output_token_ids: list[int] = []
    # time.monotonic() after which the request ends with what it has ("length", stop_reason "timeout"); 0: none.
    # Monotonic time is one clock for every process of a host (Linux CLOCK_MONOTONIC), where frontend and scheduler run
    deadline: float = 0.0
    lora_request: LoRARequest | None = None  # None: the base model
    # a cross-encoder's text pair: the index of the second text's first token (token_type_id 1 from there on, as
    # vLLM's compressed token types); None: every token is of type 0
    second_segment_start: int | None = None


def choice_requests(request: EngineRequest) -> list[EngineRequest]:
    """The request's n choices, as the scheduler runs them: choice i is `{request_id}-{i}` (the request itself when n
    is 1) with n=1, and a seeded request's choice i gets seed + i, so choices differ but stay reproducible. Unseeded
    choices share one SamplingParams and every choice shares the prompt list."""
    sampling = request.sampling
    if sampling.n == 1:
        return [request]
    single = msgspec.structs.replace(sampling, n=1)
    return [
        msgspec.structs.replace(
            request,
            request_id=f"{request.request_id}-{i}",
            sampling=single
            if sampling.seed is None or i == 0
            else msgspec.structs.replace(single, seed=sampling.seed + i),
        )
        for i in range(sampling.n)
    ]


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Ping(msgspec.Struct, tag=True, array_like=True):
    nonce: int


class WatchSteps(msgspec.Struct, tag=True, array_like=True):
    """Publish a StepSummary at most every `interval_s` (a dashboard or /debug/steps is connected); 0 stops them."""

    interval_s: float


FrontendMessage = EngineRequest | AbortRequest | Ping | WatchSteps


# ---------------------------------------------------------------- scheduler -> frontend

FinishReason = Literal["stop", "length", "abort", "error"]
# a prompt token's logprob (from the position before it): (its logprob, its rank in the vocabulary (1 = most likely),
# top ids, top logprobs); the raw model distribution, as vLLM's prompt_logprobs. What `PromptLogprobs.entries` gives
# the frontend when it formats them; between processes they travel packed.
PromptLogprobsEntry = tuple[float, int, list[int], list[float]]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """A request's prompt logprobs as packed little-endian arrays, one row per prompt token after the first: the
    token's logprob (float32 [P]), its rank (int32 [P]), the top `num_top` ids (int32 [P, num_top]) and their
    logprobs (float32 [P, num_top]). A few bytes per value from the worker to the frontend, where they become
    Python objects only as they are formatted (a prompt of 100k tokens with k = 20 is 17 MB, not ~200 MB of tuples)."""

    num_top: int
    logprobs: bytes = b""
    ranks: bytes = b""
    top_ids: bytes = b""
    top_logprobs: bytes = b""

    @property
    def num_positions(self) -> int:
        return len(self.logprobs) // 4

    @classmethod
    def from_arrays(
        cls, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
    ) -> PromptLogprobs:
        """From [P] logprobs and ranks and [P, k] top ids and logprobs (any numeric dtypes)."""
        return cls(
            int(top_ids.shape[1]),
            logprobs.astype("<f4").tobytes(),
            ranks.astype("<i4").tobytes(),
            top_ids.astype("<i4").tobytes(),
            top_logprobs.astype("<f4").tobytes(),
        )

    @classmethod
    def from_entries(cls, entries: list[PromptLogprobsEntry], num_top: int) -> PromptLogprobs:
        """From one tuple per prompt token, each with `num_top` top entries (fakes and tests)."""
        columns = list(zip(*entries)) or [(), (), (), ()]
        return cls.from_arrays(
            np.array(columns[0]),
            np.array(columns[1]),
            np.array(columns[2]).reshape(len(entries), num_top),
            np.array(columns[3]).reshape(len(entries), num_top),
        )

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(logprobs [P], ranks [P], top ids [P, k], top logprobs [P, k]), read-only views of the bytes."""
        rows = self.num_positions
        return (
            np.frombuffer(self.logprobs, "<f4"),
            np.frombuffer(self.ranks, "<i4"),
            np.frombuffer(self.top_ids, "<i4").reshape(rows, self.num_top),
            np.frombuffer(self.top_logprobs, "<f4").reshape(rows, self.num_top),
        )

    def entries(self) -> list[PromptLogprobsEntry]:
        """One Python tuple per prompt token: for formatting (the frontend) and tests."""
        logprobs, ranks, top_ids, top_logprobs = (a.tolist() for a in self.arrays())
        return list(zip(logprobs, ranks, top_ids, top_logprobs))


# why a request was refused: "overloaded" (retry later; the frontend answers 429 with Retry-After), "queue_timeout"
# (it waited longer than --max-queue-time to start: 503 with Retry-After) or "invalid"
ErrorKind = Literal["overloaded", "queue_timeout", "invalid"]


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step. `finish_reason` is set on its last output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS / stop id that finished it (not in new_token_ids' text)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # one entry per new token: (logprob of the token, top ids, top logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    embedding: bytes | None = None  # float32, raw
    error: str | None = None
    # the `stop_token_ids` entry that finished it; None for EOS (as vLLM); "timeout" when its deadline ended it
    stop_reason: int | str | None = None
    error_kind: ErrorKind | None = None  # with `error`: why it was refused; None reads as "invalid"
    # with a request's first output when it asked for prompt_logprobs: one row per prompt token after the first
    prompt_logprobs: PromptLogprobs | None = None
    # with its last output: seconds it waited in the scheduler's queue before it was first scheduled (for traces)
    queue_time_s: float = 0.0


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens looked up since the last report
    prefix_cache_hits: int  # tokens found since the last report
    num_preemptions: int  # since the last report
    # filled in by the scheduler process: steps since the last report, their summed wall time, and the part of it
    # the worker spent in forward + sampling (the rest is scheduling and messaging overhead)
    num_steps: int = 0
    step_time_s: float = 0.0
    model_time_s: float = 0.0
    grammar_mask_time_s: float = 0.0  # the scheduler's time filling structured-output bitmasks (part of step time)
    # speculative decoding since the last report, as vLLM's spec_decode counters: requests that verified drafts
    # (one per request per step), draft tokens verified, drafts accepted, and accepted drafts by position (0 = first)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # LoRA (gauges): the distinct adapter names of the running and the waiting requests (vLLM's lora_requests_info)
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None


class Pong(msgspec.Struct, tag=True, array_like=True):
    nonce: int


class EngineReady(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    weight_bytes: int
    device: str
    dtype: str
    architecture: str


# one engine step, condensed for the dashboard: (step id, prefill tokens, decode tokens, requests in the batch,
# step wall time in seconds, requests preempted while planning it)
StepRecord = tuple[int, int, int, int, float, int]


class QueueEntry(msgspec.Struct, array_like=True):
    """One request in the scheduler's queues, as the dashboard shows it."""

    request_id: str
    running: bool  # False: waiting (new, or preempted and waiting to be recomputed)
    prompt_computed: int  # prompt tokens whose KV is computed
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    priority: int
    preemptions: int
    color: int  # the code its blocks carry in StepSummary.block_map (0 for a waiting request: it holds none)


class StepSummary(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """The scheduler's state after a step, sampled (scheduler/step_summary.py; sent only while WatchSteps asks).

    `steps` holds every step since the previous summary (the timeline misses none however sampled). `block_map` has
    one byte per KV block: 0 free, 1 free but holding prefix-cache content (evictable), 2 in use by a request not in
    `queue`, 3+ in use by the queue entry with that `color`."""

    engine: int  # which engine (scheduler) this is: one per frontend today, an index under data parallelism
    step_id: int  # the last step planned (-1: none yet)
    time: float  # wall clock (time.time()) when built
    steps: list[StepRecord]
    num_running: int
    num_waiting: int
    queue: list[QueueEntry]  # running (in batch order), then waiting; capped
    num_blocks: int
    block_size: int
    num_free_blocks: int  # cached ones included, as kv_cache_usage counts them
    num_cached_blocks: int  # free blocks that still hold prefix-cache content
    block_map: bytes
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up since start-up
    prefix_cache_hits: int  # tokens found since start-up
    num_preemptions: int  # since start-up
    summary_time_s: float  # the scheduler's time spent building summaries since start-up


SchedulerMessage = StepOutputs | Pong | EngineReady | StepSummary


# ---------------------------------------------------------------- scheduler -> workers


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has not seen (or is resuming after preemption): sent in full."""

    request_id: str
    token_ids: list[int]  # prompt + any outputs so far
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    task: Literal["generate", "embed", "classify", "score"] = "generate"
    lora_request: LoRARequest | None = None  # None: the base model
    second_segment_start: int | None = None  # as EngineRequest's: where a text pair's token_type_id 1 starts


class RunningRequestData(msgspec.Struct, array_like=True):
    """A request the worker already holds: only what changed since the last step."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled last step (the worker appends them)
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # speculative decoding: draft tokens to verify this step, after its known tokens (this step only: the worker
    # never appends them; the accepted ones come back as next step's new_token_ids). Counted in
    # num_scheduled_tokens, which is then 1 + len(spec_token_ids).
    spec_token_ids: list[int] = []
    # overlap scheduling: the step before this one sampled a token for this request that the scheduler had not seen
    # when it planned this step; the worker appends the token it sampled (after new_token_ids), and a later plan
    # never sends it
    append_last_sampled: bool = False


class StepPlan(msgspec.Struct, tag=True, array_like=True):
    step_id: int
    new_requests: list[NewRequestData]
    running: list[RunningRequestData]
    finished_ids: list[str]  # forget these (finished, aborted or preempted) before running the step
    # structured outputs: the requests sampled under a grammar this step, and their allowed-token bitmask
    # (int32 rows of ceil(vocab / 32) words, bit t of a row set when token t is allowed), one row each, in order
    grammar_request_ids: list[str] = []
    grammar_bitmask: bytes = b""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


WorkerCommand = StepPlan | Shutdown


# ---------------------------------------------------------------- workers -> scheduler


class WorkerReady(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    rank: int
    num_kv_blocks: int
    weight_bytes: int
    device: str
    dtype: str
    architecture: str
    eos_token_ids: list[int] = []
    vocab_size: int = 0  # the logits' width (0: no language-model head)
    # the model's sliding window when every attention layer has one (the largest), else None: the scheduler then
    # frees the blocks of a running request that slid out of it
    sliding_window: int | None = None
    # a prompt position's LM head and scoring when it asks for prompt logprobs, in tokens of forward (0: none here);
    # the scheduler charges it to the step's token budget
    prompt_logprobs_row_cost: float = 0.0
    # the worker's process id on the scheduler's host (0: unknown); asked for its stacks when it stops answering
    pid: int = 0
    # the largest multi-token step the worker replays from a recording (0: none; workers/cpu_verify_graphs.py):
    # sequences, and tokens over them all; the scheduler's learnt prefill limit keeps small chunks within it
    replayed_step_seqs: int = 0
    replayed_step_tokens: int = 0


class StepResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Rank 0's answer to a StepPlan. Requests whose prompt is still being chunked get nothing."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[tuple[float, list[int], list[float]]] | None = None  # aligned with request_ids
    embeddings: dict[str, bytes] | None = None  # finished embedding requests: float32 raw
    model_time_s: float = 0.0
    # requests whose prompt (asking for prompt_logprobs) completed this step: every prompt position's entry
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    # speculative decoding, when some request verified drafts this step: aligned with request_ids, every request's
    # tokens in order (1 + its accepted drafts; sampled_token_ids holds each list's first token)
    accepted_token_ids: list[list[int]] | None = None
    # draft_model speculation: the draft model's proposals after each request's newest token, aligned with request_ids
    draft_token_ids: list[list[int]] | None = None


class WorkerError(msgspec.Struct, tag=True, array_like=True):
    rank: int
    message: str


WorkerMessage = WorkerReady | StepResult | WorkerError


# ---------------------------------------------------------------- codecs

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode


def decoder(kind: Any) -> msgspec.msgpack.Decoder[Any]:
    """A decoder for one socket's message union (e.g. `decoder(FrontendMessage)`)."""
    return msgspec.msgpack.Decoder(kind)
