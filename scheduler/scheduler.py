"""The scheduler core: admits requests, plans each step under the token and sequence budgets, applies results.

One scheduling model, no phases (as vLLM V1): every request has `num_computed_tokens` catching up to `num_tokens`
(prompt + outputs). Each step serves running requests first, in policy order, then admits waiting ones; a prompt
longer than the remaining token budget gets a chunk. When a running request cannot get blocks for its next tokens,
the request with the worst policy key is preempted (recompute: its blocks are freed and it starts over, usually
helped by the prefix cache). Plans carry diffs: workers get a request in full once, then only new tokens and blocks.

Sliding window: when the workers report that every attention layer of the model has one (`WorkerReady.sliding_window`,
the largest), a running request's leading blocks whose every token is older than what its next query can see are
freed before its next tokens get blocks, so a long generation holds about window / block_size + 1 blocks. The workers
keep those table entries (no plan mentions them again); no attention path reads a block before the window.

This class does no I/O; `scheduler/process.py` drives it: `add_request`/`abort_requests` as messages arrive, then
`schedule()` -> workers -> `update()` for each step.

Overlap scheduling (vLLM's async scheduling): when `can_plan_ahead()`, the next `schedule()` may run before the step
in flight's `update()` (never more than one step ahead). A request that step samples is then scheduled one more token,
a placeholder (`Request.num_output_placeholders`): its computed tokens and blocks count it, the plan tells the worker
to append the token it sampled (`RunningRequestData.append_last_sampled`), and `update()` appends the real token and
checks the stop rules. A request that finished on that token leaves a wasted slot in the next step, whose token is
dropped. A request whose next token could be its last (max_tokens, the context) waits for the result instead.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

from tokenmill.config import EngineConfig, SpeculativeConfig, is_pooling_task
from tokenmill.grammars import GrammarError
from tokenmill.messages import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    NewRequestData,
    RequestOutput,
    RunningRequestData,
    SchedulerStats,
    StepPlan,
    StepResult,
    choice_requests,
)
from tokenmill.scheduler.draft_speculator import DraftModelSpeculator
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.lora_admission import LoRAAdmission, adapter_names
from tokenmill.scheduler.policy import SchedulingPolicy, make_policy
from tokenmill.scheduler.prefill_limit import WINDOW, PrefillLimit
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.scheduler.spec_decode import NgramSpeculator, Speculator
from tokenmill.scheduler.structured_outputs import GrammarCompiler, RequestGrammar

if TYPE_CHECKING:
    pass


def make_speculator(config: SpeculativeConfig) -> Speculator | None:
    """The scheduler's side of the configured speculation method; None when speculation is off."""
    if config.method == "ngram":
        return NgramSpeculator(config)
    if config.method == "draft_model":
        return DraftModelSpeculator(config)
    return None


class Rejection(NamedTuple):
    """Why a request was refused: one sentence for the client, and whether retrying later can help."""

    message: str
    kind: ErrorKind = "invalid"


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        eos_token_ids: list[int],
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulingPolicy | None = None,
        grammars: GrammarCompiler | None = None,
        sliding_window: int | None = None,
        prompt_logprobs_row_cost: float = 0.0,
        replayed_step: tuple[int, int] = (0, 0),
    ) -> None:
        self.config = config
        # every layer's window is at most this (None: some layer attends to everything): blocks older are freed,
        # so a request is no longer bounded by the pool's size
        self.sliding_window = sliding_window
        self.block_size = config.cache.block_size
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        # a prompt token that asks for its logprob also runs the LM head over the whole vocabulary and a top-k: it
        # takes 1 + this many tokens of the step's budget (WorkerReady.prompt_logprobs_row_cost; ~85 on a 2-layer
        # test model, ~0.1 on an 8B one), and such a prompt is chunked to fit, so no step grows long for the others
        self.prompt_logprobs_row_cost = prompt_logprobs_row_cost
        # 0 means "not resolved from a model" (unit tests): then the pool's capacity is the only limit
        self.max_model_len = config.model.max_model_len or num_kv_blocks * self.block_size
        # the most tokens one request can ever hold; below max_model_len only with an explicit block count
        # (--num-gpu-blocks-override): a budget-sized cache that small refuses to start (launcher.kv_capacity_error)
        self.max_seq_len = min(self.max_model_len, num_kv_blocks * self.block_size)
        if sliding_window is not None:  # blocks are freed as they leave the window: the pool bounds no request
            self.max_seq_len = self.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.policy = policy or make_policy(config.scheduler.scheduling_policy)
        # an embedding instance has no KV cache (0 blocks): its requests never take blocks, so a one-block pool
        # that is never used keeps the manager free of special cases
        self.kv = KVCacheManager(max(num_kv_blocks, 1), self.block_size, config.cache.enable_prefix_caching)

        self.grammars = grammars  # compiles structured-output constraints; None: such requests are refused
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._finished_on_workers: list[str] = []  # ids the workers must forget, sent with the next plan
        self._arrival_seq = itertools.count()
        self._next_step_id = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_preemptions = 0
        self._reported_counters = (0, 0, 0)  # the three counters above, summed over every stats() report
        self._pending_outputs: list[RequestOutput] = []  # outputs found while planning (grammars that failed)
        # speculative decoding (scheduler/spec_decode.py): None when off; the drafts scheduled by the step being planned
        self.speculator = make_speculator(config.speculative)
        self._step_drafts: dict[str, list[int]] = {}
        self._step_decodes: dict[str, bool] = {}  # request id -> whether it decodes in the step being planned
        # deadlines: the requests that have one, soonest first (deadline, request id); 0 turns the queue limit off
        self._deadlines: list[tuple[float, str]] = []
        # while some request decodes, a step's prefill chunks take at most this many budget tokens (learnt from
        # the workers' step times unless --long-prefill-token-threshold fixes it): the decoders' steps stay short
        # (replayed_step: the largest multi-token step the workers replay, sequences and tokens; (0, 0) none)
        self.prefill_limit = PrefillLimit(config.scheduler.long_prefill_token_threshold, WINDOW, *replayed_step)
        self._prefill_room: int | None = None  # what the step being planned may still give prefills (None: all)
        self._step_shapes: dict[int, tuple[int, int]] = {}  # step id -> (decoding requests, prefill budget tokens)
        self.max_queue_time = config.scheduler.max_queue_time_s
        # distinct LoRA adapters the running batch may hold (the workers' slots); None: LoRA is off
        self.max_loras = config.lora.max_loras if config.lora.enable_lora else None
        # overlap scheduling: one rank only (other ranks never see the sampled tokens a plan would ask them to append);
        # the loop resolves None (auto) from the workers' device, a Scheduler given None plans ahead
        self.async_scheduling = config.scheduler.async_scheduling is not False and config.parallel.world_size == 1
        self._reaching_end: dict[int, list[Request]] = {}  # step id -> its requests that sample (or embed) in it

    # ------------------------------------------------------------------ admission and aborts

    def add_request(self, request: EngineRequest) -> Rejection | None:
        """Queue a request's n choices (`choice_requests`), all or none. Returns None when admitted, else why it was
        refused: "overloaded" when the waiting queue is full, "invalid" when it can never run."""
        choices = choice_requests(request)
        if len(self.waiting) + len(choices) > self.config.scheduler.max_waiting_requests:
            return Rejection(
                f"The server is overloaded: {len(self.waiting)} requests are already waiting; retry later.",
                "overloaded",
            )
        for choice in choices:
            reason = self._admission_error(choice)
            if reason is not None:
                return Rejection(reason)
        max_tokens = request.sampling.max_tokens
        if is_pooling_task(request.task):
            max_tokens = 0
        elif max_tokens is None:
            max_tokens = self.max_model_len - len(request.prompt_token_ids)
        constraint = request.sampling.structured_outputs
        # _admission_error refused a constraint without a compiler
        compiled = self.grammars.compile(constraint) if constraint is not None and self.grammars is not None else None
        for choice in choices:
            req = Request(choice, next(self._arrival_seq), self.clock(), max_tokens, request.request_id)
            if compiled is not None and constraint is not None:
                req.grammar = RequestGrammar(compiled, constraint.begin_after_token_ids)
            self.requests[req.request_id] = req
            self.waiting.append(req)
            if req.deadline:
                heapq.heappush(self._deadlines, (req.deadline, req.request_id))
        return None

    def _admission_error(self, request: EngineRequest) -> str | None:
        num_prompt = len(request.prompt_token_ids)
        if request.request_id in self.requests:
            return f"Request id {request.request_id!r} is already in use."
        if num_prompt == 0:
            return "The prompt is empty."
        if request.sampling.structured_outputs is not None and (self.grammars is None or is_pooling_task(request.task)):
            return "Structured outputs are not available on this engine."
        if request.lora_request is not None and (self.max_loras is None or is_pooling_task(request.task)):
            return "LoRA adapters are not served by this engine (start it with --enable-lora)."
        if is_pooling_task(request.task):
            if num_prompt > self.max_model_len:
                return (
                    f"The input has {num_prompt} tokens, more than the model's maximum context length "
                    f"of {self.max_model_len}."
                )
            if num_prompt > self.max_num_batched_tokens:
                return (
                    f"The input has {num_prompt} tokens, more than max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}); embedding inputs are never split."
                )
            return None
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}."
        total = num_prompt + (max_tokens if max_tokens is not None else 1)
        if total > self.max_model_len:
            return (
                f"This model's maximum context length is {self.max_model_len} tokens, but the request needs "
                f"{total} ({num_prompt} in the prompt + {total - num_prompt} to generate)."
            )
        # only the prompt must fit: blocks are taken as tokens are scheduled, and preemption handles pressure
        if self.kv.num_blocks_for(num_prompt) > self.kv.num_blocks:
            return (
                f"The prompt has {num_prompt} tokens, more than the whole KV cache holds "
                f"({self.kv.num_blocks} blocks of {self.block_size} tokens)."
            )
        if not self.chunked_prefill and num_prompt > self.max_num_batched_tokens:
            return (
                f"The prompt has {num_prompt} tokens, more than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with chunked prefill disabled."
            )
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish the given requests with "abort" and free their blocks now. Unknown or finished ids are ignored."""
        outputs = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            self._finish(req, "abort")
            outputs.append(
                RequestOutput(
                    request_id,
                    [],
                    "abort",
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    queue_time_s=self._queue_time(req),
                )
            )
        if outputs:
            self._drop_finished_from_queues()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def can_plan_ahead(self) -> bool:
        """Overlap scheduling: whether the next step may be planned before the result of the step in flight is
        applied. Not with speculative decoding (n-gram drafts follow the newest tokens, a draft model's come with the
        result), nor while the step in flight samples a structured-output request (its next bitmask follows from the
        token): such steps run synchronously."""
        if not self.async_scheduling or self.speculator is not None:
            return False
        return not any(req.grammar is not None and req.num_output_placeholders for req in self.running)

    # ------------------------------------------------------------------ planning a step

    def schedule(self) -> StepPlan | None:
        """Pick every request's tokens for the next step. None when nothing can run."""
        now = self.clock()
        self._end_expired(now)
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request id -> tokens this step, in scheduling order
        self._step_drafts = {}
        # whether each running request decodes, worked out once: planning reads it several times per request, and
        # nothing it depends on changes before the plan is built
        self._step_decodes = {r.request_id: self._decodes(r) for r in self.running}
        num_decodes = sum(self._step_decodes.values())
        self._prefill_room = None
        if num_decodes:
            self._prefill_room = self.prefill_limit.tokens(num_decodes, self._num_prefilling_clients())
        if self.speculator is not None:
            self.speculator.begin_step(len(self.running))
        preempted_any = False

        # running requests first; when blocks run out, preempt from the back of the policy order
        order = self.policy.order(self.running, now)
        for req in order:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.is_embedding:
                continue
            decodes = self._step_decodes[req.request_id]
            num_new = self._chunk(req, min(self._num_unscheduled_tokens(req), budget), budget, decodes)
            if num_new <= 0:
                continue
            self._free_slid_out_blocks(req)
            drafts = self._propose_drafts(req, budget) if num_new == 1 else []
            lookahead = self._lookahead_slots(req, num_new)
            while self.kv.allocate_slots(req, num_new + len(drafts), num_lookahead_tokens=lookahead) is None:
                # the pool is short: speculation gives way first (the lookahead, then the drafts; with fewer
                # lookahead slots the draft model proposes fewer tokens), never causing a preemption
                if lookahead:
                    lookahead = 0
                    continue
                if drafts:
                    drafts = []
                    continue
                victim = next(r for r in reversed(order) if r.status is RequestStatus.RUNNING and not r.is_embedding)
                budget += self._preempt(victim, scheduled)
                preempted_any = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: everything after it in the order is preempted too
            if drafts:
                self._step_drafts[req.request_id] = drafts
                num_new += len(drafts)
            scheduled[req.request_id] = num_new
            budget -= self._charge(req, num_new, decodes)

        # then waiting requests, unless this step had to preempt (they would only take the freed blocks back)
        if not preempted_any:
            budget = self._admit_waiting(now, budget, scheduled)

        if not scheduled:
            return None
        shape = self._step_shape(scheduled)  # before the plan advances the requests' computed tokens
        plan = self._build_plan(scheduled)
        self._step_shapes[plan.step_id] = shape
        return plan

    def _num_prefilling_clients(self) -> int:
        """How many client requests have prompt tokens left to compute (a request's n choices count once)."""
        prefilling = [
            r for r in self.running if r.status is RequestStatus.RUNNING and not self._step_decodes[r.request_id]
        ]
        return len({r.client_request_id for r in prefilling + self.waiting})

    def _decodes(self, req: Request) -> bool:
        """Whether a running request is generating: its prompt (and any output it resumes with) computed, one token
        a step."""
        return (
            req.status is RequestStatus.RUNNING
            and req.num_output_tokens + req.num_output_placeholders > 0
            and req.num_tokens + req.num_output_placeholders - req.num_computed_tokens <= 1
        )

    def _charge(self, req: Request, num_new: int, decodes: bool) -> int:
        """The budget tokens `num_new` of the request's tokens take; a prefill's also spend the step's prefill room."""
        cost = self._budget_cost(req, num_new)
        if self._prefill_room is not None and not decodes:
            self._prefill_room -= cost
        return cost

    def _step_shape(self, scheduled: dict[str, int]) -> tuple[int, int]:
        """(requests decoding, budget tokens of prefill) in a planned step: what its time is learnt against."""
        decoding = [self._step_decodes[request_id] for request_id in scheduled]
        prefill_cost = sum(
            self._budget_cost(self.requests[request_id], num_new)
            for (request_id, num_new), decodes in zip(scheduled.items(), decoding)
            if not decodes
        )
        return sum(decoding), prefill_cost

    def _num_unscheduled_tokens(self, req: Request) -> int:
        """A running request's tokens not scheduled yet: its known tokens past the computed ones, and under overlap
        scheduling the token the step in flight samples for it, unless that token could be its last (max_tokens,
        the context) or must be seen before planning (a grammar's bitmask, drafts): then it waits for the result."""
        pending = req.num_output_placeholders
        if pending and (
            not self.async_scheduling
            or req.grammar is not None
            or self.speculator is not None
            or req.num_output_tokens + pending >= req.max_tokens
            or req.num_tokens + pending >= self.max_seq_len
        ):
            return 0
        return req.num_tokens + pending - req.num_computed_tokens

    def _end_expired(self, now: float) -> None:
        """Deadlines, checked once per step (a running request's tokens of the step in flight are already out):
        a request past its deadline ends with what it has ("length", stop_reason "timeout"); one that has waited
        longer than max_queue_time without ever starting is refused (it holds no blocks). Their outputs go out with
        the step's (`take_pending_outputs`)."""
        ended = False
        while self._deadlines and self._deadlines[0][0] <= now:
            req = self.requests.get(heapq.heappop(self._deadlines)[1])
            if req is not None and 0 < req.deadline <= now:  # not a later request that reused a finished one's id
                self._finish(req, "length")
                self._pending_outputs.append(
                    RequestOutput(
                        req.request_id,
                        [],
                        "length",
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        stop_reason="timeout",
                        queue_time_s=self._queue_time(req),
                    )
                )
                ended = True
        if self.max_queue_time > 0:
            for req in self.waiting:
                waited = now - req.enqueue_time
                if req.num_cached_tokens < 0 and waited > self.max_queue_time and req.status is RequestStatus.WAITING:
                    self._finish(req, "error")
                    self._pending_outputs.append(
                        RequestOutput(
                            req.request_id,
                            [],
                            "error",
                            num_prompt_tokens=req.num_prompt_tokens,
                            error_kind="queue_timeout",
                            error=f"The request waited {waited:.1f} s to start, longer than the server's "
                            f"--max-queue-time of {self.max_queue_time:g} s; retry later.",
                        )
                    )
                    ended = True
        if ended:
            self._drop_finished_from_queues()

    def _queue_time(self, req: Request) -> float:
        """Seconds the request waited before it was first scheduled (until now when it never was)."""
        return max((req.first_scheduled_time or self.clock()) - req.enqueue_time, 0.0)

    def _propose_drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens to verify after a decoding request's next token: none when speculation is off or the request
        is not on the workers yet; never more than the budget after its token, than could still become outputs
        under max_tokens, or than fit in the context with the token sampled after them."""
        if self.speculator is None or not req.on_worker:
            return []
        limit = min(budget - 1, req.max_tokens - req.num_output_tokens - 1, self.max_seq_len - req.num_tokens - 1)
        return self.speculator.propose(req, limit)

    def _lookahead_slots(self, req: Request, num_new: int) -> int:
        """KV slots past a request's scheduled tokens that the workers' draft model writes while proposing after
        them (scheduler/draft_speculator.py): only when the step reaches the request's end."""
        if self.speculator is None or req.num_computed_tokens + num_new < req.num_tokens:
            return 0
        lookahead = self.speculator.lookahead_slots
        return lookahead if lookahead and self.speculator.allowed(req) else 0

    def _admit_waiting(self, now: float, budget: int, scheduled: dict[str, int]) -> int:
        """Admit waiting requests in policy order until one does not fit; returns the budget left."""
        admitted_any = False
        loras = LoRAAdmission(self.max_loras, self.running)
        for req in self.policy.order(self.waiting, now):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.grammar is not None and not self._grammar_ready(req, req.grammar):
                continue  # still compiling (or failed): the others go ahead
            if req.num_output_placeholders:
                continue  # preempted while the step in flight samples its token: resumed once it is known
            if not loras.admits(req):
                continue  # its adapter would be one too many: it waits, and the adapter requests after it too
            if req.is_embedding:
                if req.num_tokens > budget:
                    break  # never chunked: wait for a step with room
                num_cached, num_new = 0, req.num_tokens
            else:
                hits = self.kv.find_cached_prefix(req)
                num_cached = len(hits) * self.block_size
                num_new = req.num_tokens - num_cached
                if num_new > budget:
                    # with chunked prefill off only a resumed request (prompt + outputs) may be split
                    if not self.chunked_prefill and req.num_preemptions == 0:
                        break
                    num_new = budget
                num_new = self._chunk(req, num_new, budget, decodes=False)
                if num_new <= 0:
                    break  # the step's prefill room is spent: it starts next step, in policy order
                lookahead = self._lookahead_slots(req, num_cached + num_new)  # it has computed none yet
                while (new_block_ids := self.kv.allocate_slots(req, num_new, hits, lookahead)) is None:
                    if lookahead:  # best effort, as for running requests
                        lookahead = 0
                        continue
                    victim = self._victim_for_waiting(req, now)
                    if victim is None:
                        break
                    budget += self._preempt(victim, scheduled)
                if new_block_ids is None:
                    break  # the pool is short: keep the policy order strict, try again next step
                self._prefix_queries += req.num_tokens
                self._prefix_hits += num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.first_scheduled_time = now
            self.running.append(req)
            loras.add(req)
            scheduled[req.request_id] = num_new
            # admitted now, it decodes only when resumed with all but its last token cached
            self._step_decodes[req.request_id] = self._decodes(req)
            budget -= self._charge(req, num_new, self._step_decodes[req.request_id])
            admitted_any = True
        if admitted_any:
            self.waiting = [r for r in self.waiting if r.status is RequestStatus.WAITING]
        return budget

    def _scores_prompt(self, req: Request) -> bool:
        """Whether the request's next tokens are prompt positions whose logprobs the workers compute (it asks for
        them and has none delivered yet)."""
        return (
            req.sampling.prompt_logprobs is not None
            and req.num_output_tokens == 0
            and req.num_computed_tokens < req.num_prompt_tokens
        )

    def _budget_cost(self, req: Request, num_new: int) -> int:
        """The tokens of the step's budget that `num_new` of the request's tokens take: their forward, and for prompt
        positions that ask for logprobs the LM head and scoring over the vocabulary too."""
        if not self._scores_prompt(req):
            return num_new
        return math.ceil(num_new * (1.0 + self.prompt_logprobs_row_cost))

    def _chunk(self, req: Request, num_new: int, budget: int, decodes: bool) -> int:
        """`num_new`, cut (with chunked prefill on) to what fits in `budget` and, for a prefill while others decode,
        in the step's prefill room (0 once a prefill spent it); prompt positions that ask for logprobs cost more
        (`_budget_cost`), but never fewer than one is scheduled, so such a prompt always advances (a step can then
        exceed its budget by at most one position's LM head: the budget is spent and nothing is scheduled after it)."""
        if not self.chunked_prefill or decodes:
            return num_new
        if self._prefill_room is not None:
            if self._prefill_room <= 0:
                return 0
            budget = min(budget, self._prefill_room)
            num_new = min(num_new, budget)
        if not self._scores_prompt(req):
            return num_new
        return min(num_new, max(1, int(budget / (1.0 + self.prompt_logprobs_row_cost))))

    def _grammar_ready(self, req: Request, grammar: RequestGrammar) -> bool:
        """Whether a waiting request's grammar is compiled; a grammar that failed finishes the request with why."""
        if not grammar.compiled:
            return False
        try:
            grammar.start()
            return True
        except GrammarError as exc:
            self._finish(req, "error")
            self._pending_outputs.append(
                RequestOutput(
                    req.request_id,
                    [],
                    "error",
                    num_prompt_tokens=req.num_prompt_tokens,
                    error=f"The structured-output constraint cannot be used: {exc}",
                    error_kind="invalid",
                )
            )
            return False

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs that planning produced (requests it had to fail), for the caller to publish."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if outputs:
            self._drop_finished_from_queues()
        return outputs

    def _victim_for_waiting(self, waiting_req: Request, now: float) -> Request | None:
        """Under a policy that allows it, the running request with the worst key if that key is worse than the
        waiting request's; else None."""
        if not self.policy.preempts_for_waiting:
            return None
        candidates = [r for r in self.running if not r.is_embedding]
        if not candidates:
            return None
        victim = max(candidates, key=lambda r: self.policy.sort_key(r, now))
        if self.policy.sort_key(victim, now) <= self.policy.sort_key(waiting_req, now):
            return None
        return victim

    def _free_slid_out_blocks(self, req: Request) -> None:
        """With an all-sliding-window model, free the running request's leading blocks that its next query (at
        position num_computed_tokens, seeing keys from there - window + 1 on) and every later one cannot see. Only
        blocks the workers already have: a plan never has to name a freed one."""
        if self.sliding_window is None or not req.on_worker:
            return
        first_visible = req.num_computed_tokens - self.sliding_window + 1
        if first_visible >= self.block_size:
            self.kv.free_leading_blocks(req, min(first_visible // self.block_size, req.num_blocks_on_worker))

    def _preempt(self, req: Request, scheduled: dict[str, int]) -> int:
        """Recompute-preempt a running request: free its blocks, send it back to waiting (at the front).
        Returns the tokens it had been given this step, now back in the budget."""
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)
        self._step_drafts.pop(req.request_id, None)
        if req.on_worker:
            self._finished_on_workers.append(req.request_id)
            req.forget_worker_state()
        self._num_preemptions += 1
        return scheduled.pop(req.request_id, 0)

    def _build_plan(self, scheduled: dict[str, int]) -> StepPlan:
        """Turn this step's token counts into worker diffs, then advance each request's computed tokens."""
        new_requests: list[NewRequestData] = []
        running: list[RunningRequestData] = []
        reaching_end: list[Request] = []
        for request_id, num_scheduled in scheduled.items():
            req = self.requests[request_id]
            blocks = self.kv.req_blocks.get(request_id, ())
            num_freed = self.kv.num_freed_blocks.get(request_id, 0)  # sliding window: freed leading blocks
            if not req.on_worker:
                new_requests.append(
                    NewRequestData(
                        request_id,
                        list(req.all_token_ids),
                        req.num_prompt_tokens,
                        req.sampling,
                        [b.block_id for b in blocks],
                        req.num_computed_tokens,
                        num_scheduled,
                        req.task,
                        req.lora_request,
                        req.second_segment_start,
                    )
                )
                req.on_worker = True
            else:
                running.append(
                    RunningRequestData(
                        request_id,
                        req.all_token_ids[req.num_tokens_on_worker :],
                        [b.block_id for b in blocks[req.num_blocks_on_worker - num_freed :]],
                        req.num_computed_tokens,
                        num_scheduled,
                        self._step_drafts.get(request_id, []),
                        append_last_sampled=req.num_output_placeholders > 0,
                    )
                )
            # a placeholder scheduled here is the token the worker appends itself: no later plan sends it
            req.num_tokens_on_worker = req.num_tokens + req.num_output_placeholders
            req.num_blocks_on_worker = num_freed + len(blocks)
            # drafts are not computed tokens until update() knows how many were accepted
            req.num_computed_tokens += num_scheduled - len(self._step_drafts.get(request_id, ()))
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:  # samples (or embeds)
                reaching_end.append(req)
                req.num_output_placeholders += 0 if req.is_embedding else 1
        plan = StepPlan(self._next_step_id, new_requests, running, self._finished_on_workers)
        self._add_grammar_bitmask(plan, reaching_end)
        self._reaching_end[plan.step_id] = reaching_end
        self._next_step_id += 1
        self._finished_on_workers = []
        return plan

    def _add_grammar_bitmask(self, plan: StepPlan, sampled: list[Request]) -> None:
        """The allowed-token bitmask of every constrained request that samples this step, one row each."""
        grammars = [(r.request_id, r.grammar) for r in sampled if r.grammar is not None and r.grammar.active]
        if grammars and self.grammars is not None:
            bitmask = self.grammars.fill_bitmask([grammar for _, grammar in grammars])
            plan.grammar_request_ids = [request_id for request_id, _ in grammars]
            plan.grammar_bitmask = bitmask.tobytes()

    # ------------------------------------------------------------------ applying a step's result

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append sampled tokens, check stop conditions, finish requests. Results for requests that finished since the
        plan was made (aborted, or stopped by the step before it under overlap scheduling) are dropped."""
        awaiting = self._awaiting_results(plan.step_id)
        shape = self._step_shapes.pop(plan.step_id, None)
        if shape is not None:
            self.prefill_limit.observe(*shape, result.model_time_s)
        planned = [self.requests.get(n.request_id) for n in plan.new_requests]
        planned += [self.requests.get(r.request_id) for r in plan.running]
        planned_alive = [r for r in planned if r is not None and r.status is RequestStatus.RUNNING]
        for alive in planned_alive:
            self.kv.cache_computed_blocks(alive)  # their KV is written now: shareable

        outputs: list[RequestOutput] = self.take_pending_outputs()
        logprobs = result.logprobs
        prompt_logprobs = result.prompt_logprobs or {}
        accepted = result.accepted_token_ids
        drafts = {r.request_id: r.spec_token_ids for r in plan.running if r.spec_token_ids}
        for i, (request_id, token_id) in enumerate(zip(result.request_ids, result.sampled_token_ids)):
            # only a request whose scheduled tokens reached its end samples; anything else is stale
            req = awaiting.get(request_id)
            if req is None or req.is_embedding:
                continue
            del awaiting[request_id]
            # speculative decoding: the accepted drafts then the token sampled after them; stop conditions are checked
            # after each, and the tokens after a stop are dropped
            token_ids = accepted[i] if accepted is not None else [token_id]
            if request_id in drafts and self.speculator is not None:
                self.speculator.record(req, len(drafts[request_id]), len(token_ids) - 1)
            new_token_ids: list[int] = []
            for token_id in token_ids:
                req.all_token_ids.append(token_id)
                new_token_ids.append(token_id)
                finish_reason, stop_token_id, stop_reason = self._stop_reason(req, token_id)
                error = None
                if req.grammar is not None and finish_reason is None:
                    error = req.grammar.accept(token_id, req.output_token_ids)
                    if error is not None:
                        finish_reason = "error"
                        if self.grammars is not None:  # the compiled grammar its matcher shares state with
                            self.grammars.forget(req.grammar)
                    elif req.grammar.finished:
                        finish_reason = "stop"  # the grammar is complete: nothing but end of sequence could follow
                if finish_reason is not None:
                    break
            if len(new_token_ids) > 1:
                # the accepted drafts' KV was written in the verification: computed; the rejected drafts' slots
                # are overwritten when their positions are computed again
                req.num_computed_tokens = req.num_tokens - 1
                self.kv.cache_computed_blocks(req)
            if finish_reason is None and result.draft_token_ids is not None and self.speculator is not None:
                self.speculator.receive(req, result.draft_token_ids[i])
            outputs.append(
                RequestOutput(
                    request_id,
                    new_token_ids,
                    finish_reason,
                    stop_token_id,
                    req.num_prompt_tokens,
                    max(req.num_cached_tokens, 0),
                    [logprobs[i]] if logprobs and len(new_token_ids) == 1 else None,
                    error=error,
                    stop_reason=stop_reason,
                    prompt_logprobs=prompt_logprobs.get(request_id),
                    queue_time_s=self._queue_time(req) if finish_reason is not None else 0.0,
                )
            )
            if finish_reason is not None:
                self._finish(req, finish_reason)

        for request_id, embedding in (result.embeddings or {}).items():
            req = awaiting.pop(request_id, None)
            if req is None or not req.is_embedding or req.status is not RequestStatus.RUNNING:
                continue
            outputs.append(
                RequestOutput(request_id, [], "stop", num_prompt_tokens=req.num_prompt_tokens, embedding=embedding)
            )
            self._finish(req, "stop")

        # a request that reached its end but got nothing back would otherwise wait forever
        for req in awaiting.values():
            if req.status is RequestStatus.RUNNING:
                outputs.append(
                    RequestOutput(
                        req.request_id,
                        [],
                        "error",
                        num_prompt_tokens=req.num_prompt_tokens,
                        error="The worker returned no result for this request.",
                    )
                )
                self._finish(req, "error")

        self._drop_finished_from_queues()
        return outputs

    def _awaiting_results(self, step_id: int) -> dict[str, Request]:
        """The requests that step `step_id` samples or embeds and that are still unfinished (one preempted since
        the plan still takes its token), by id; their placeholders for that step resolved."""
        awaiting = {}
        for req in self._reaching_end.pop(step_id, []):
            if not req.is_embedding:
                req.num_output_placeholders -= 1
            if self.requests.get(req.request_id) is req:  # not finished (an id may be reused once it is)
                awaiting[req.request_id] = req
        return awaiting

    def _stop_reason(self, req: Request, token_id: int) -> tuple[FinishReason | None, int | None, int | None]:
        """(finish reason, the token that stopped it, stop_reason) after `token_id` was appended: EOS, then stop
        ids (stop_reason names a stop id, never EOS, as vLLM), then max_tokens, then max_model_len (or the whole
        KV cache, when that holds less)."""
        sampling = req.sampling
        num_output_tokens = req.num_output_tokens
        if num_output_tokens >= sampling.min_tokens:
            if not sampling.ignore_eos and token_id in self.eos_token_ids:
                return "stop", token_id, None
            if token_id in req.stop_token_ids:
                return "stop", token_id, token_id
        if num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_seq_len:
            return "length", None, None
        return None, None, None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished, free its blocks now, tell the workers to forget it. The caller drops it from the queues."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.grammar = None
        self.kv.free(req)
        del self.requests[req.request_id]
        if req.on_worker:
            self._finished_on_workers.append(req.request_id)

    def _drop_finished_from_queues(self) -> None:
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self.waiting = [r for r in self.waiting if r.status is RequestStatus.WAITING]

    # ------------------------------------------------------------------ metrics

    def stats(self) -> SchedulerStats:
        """Queue sizes and KV usage now; prefix-cache and preemption counters since the last call."""
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            num_preemptions=self._num_preemptions,
            grammar_mask_time_s=self.grammars.take_mask_time() if self.grammars is not None else 0.0,
        )
        if self.max_loras is not None:
            stats.running_lora_adapters = adapter_names(self.running)
            stats.waiting_lora_adapters = adapter_names(self.waiting)
        if self.speculator is not None:
            (
                stats.spec_num_drafts,
                stats.spec_num_draft_tokens,
                stats.spec_num_accepted_tokens,
                stats.spec_accepted_per_pos,
            ) = self.speculator.take_stats()
        self._reported_counters = self.counter_totals()
        self._prefix_queries = self._prefix_hits = self._num_preemptions = 0
        return stats

    def counter_totals(self) -> tuple[int, int, int]:
        """(prefix-cache query tokens, hit tokens, preemptions) since start-up, whatever stats() has reported."""
        queries, hits, preemptions = self._reported_counters
        return queries + self._prefix_queries, hits + self._prefix_hits, preemptions + self._num_preemptions
