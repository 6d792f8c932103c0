"""A request's state inside the scheduler: its tokens, how many have KV computed, and what the workers already know.

There are no prefill or decode phases: `num_computed_tokens` catches up to `num_tokens` (prompt + outputs), a
chunk at a time for a long prompt and one token at a time once it is generating.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tokenmill.config import is_pooling_task
from tokenmill.messages import EngineRequest, FinishReason, SamplingParams
from tokenmill.scheduler.structured_outputs import RequestGrammar

if TYPE_CHECKING:  # spec_decode imports this module
    from tokenmill.scheduler.spec_decode import SpecDecodeState


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Mutable per-request state, owned by the Scheduler."""

    __slots__ = (
        "request_id",
        "client_request_id",
        "prompt_token_ids",
        "sampling",
        "stop_token_ids",
        "task",
        "priority",
        "cache_salt",
        "lora_request",
        "second_segment_start",
        "arrival_seq",
        "enqueue_time",
        "max_tokens",
        "all_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "status",
        "finish_reason",
        "block_hashes",
        "num_preemptions",
        "on_worker",
        "num_tokens_on_worker",
        "num_blocks_on_worker",
        "grammar",
        "spec",
        "deadline",
        "first_scheduled_time",
        "num_output_placeholders",
        "is_embedding",
    )

    def __init__(
        self,
        engine_request: EngineRequest,
        arrival_seq: int,
        enqueue_time: float,
        max_tokens: int,
        client_request_id: str | None = None,
    ) -> None:
        self.request_id = engine_request.request_id
        # the client's request, which its n choices share: the prefill limit counts users, not choices
        self.client_request_id = client_request_id or engine_request.request_id
        self.prompt_token_ids = list(engine_request.prompt_token_ids)
        self.sampling: SamplingParams = engine_request.sampling
        # checked after every sampled token; a request may carry --max-stop-token-ids of them
        self.stop_token_ids = frozenset(engine_request.sampling.stop_token_ids)
        self.task = engine_request.task
        self.is_embedding = is_pooling_task(self.task)  # read several times per request and step: kept, not derived
        self.priority = engine_request.priority
        self.cache_salt = engine_request.cache_salt
        self.lora_request = engine_request.lora_request
        self.second_segment_start = engine_request.second_segment_start
        self.arrival_seq = arrival_seq  # order of admission into the scheduler; FCFS ties break on it
        self.enqueue_time = enqueue_time  # scheduler clock at admission, for ageing
        self.max_tokens = max_tokens  # resolved: never None, never past max_model_len
        # prompt + outputs (a request resumed after its engine failed brings the outputs it had already streamed)
        self.all_token_ids = self.prompt_token_ids + list(engine_request.resumed_output_token_ids)
        self.deadline = engine_request.deadline  # time.monotonic() when it ends with what it has; 0: none
        self.first_scheduled_time = 0.0  # scheduler clock when it was first scheduled (0: not yet): its queue time
        self.num_computed_tokens = 0
        # tokens that planned steps sample for it and whose results are not applied yet (vLLM's placeholders): under
        # overlap scheduling the next step is planned with the in-flight one's token as a placeholder
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_hashes: list[bytes] = []  # prefix-cache keys of this request's full blocks, in order
        self.num_preemptions = 0
        # what the workers hold, so a plan sends only the difference
        self.on_worker = False
        self.num_tokens_on_worker = 0
        self.num_blocks_on_worker = 0
        self.grammar: RequestGrammar | None = None  # its structured-output matcher, when it has a constraint
        # speculative decoding's state (scheduler/spec_decode.py), once it proposes
        self.spec: SpecDecodeState | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def remaining_work(self) -> int:
        """Expected tokens still to process: KV not yet computed plus outputs not yet generated."""
        to_compute = self.num_tokens - self.num_computed_tokens
        if self.is_embedding:
            return to_compute
        return to_compute + self.max_tokens - self.num_output_tokens

    def forget_worker_state(self) -> None:
        """The workers dropped this request (preempted): next time it goes out in full."""
        self.on_worker = False
        self.num_tokens_on_worker = 0
        self.num_blocks_on_worker = 0

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, outputs={self.num_output_tokens}/{self.max_tokens})"
        )
