"""The scheduler's side of speculative decoding: who may speculate, how many drafts, back-off, and the counters.

A decoding request (one token to compute, already on the workers) gets up to k draft tokens scheduled after its
token; the worker verifies them in the same forward (workers/rejection_sampler.py) and returns 1 + the accepted
drafts. Only requests whose sampling the verification reproduces exactly speculate: structured outputs,
presence/frequency/repetition penalties, logprobs and prompt logprobs run without drafts, in the same batch.

Back-off, per request: after a step that accepted every draft the allowance grows again (up to k), after one that
rejected some it shrinks to what was accepted + 1, and a step that accepted none makes the request skip proposing
for 1, 2, 4, ... up to MAX_SKIP_STEPS steps. Requests whose history never repeats propose nothing and cost nothing.

Per step, all requests together: drafts stop where the step would hold more than STEP_TOKEN_BUDGET tokens (one per
running request plus the drafts), and no request speculates while more than MAX_SPECULATING_BATCH requests run (as
vLLM's `disable_by_batch_size`). Measured on the 2-vCPU CPU with the default model (docs/benchmarks.md): with
float32 weights one request's forward costs about the same for 1 to ~8 query tokens (reading the weights dominates),
but 4 requests x 2 tokens already cost 1.5x 4 x 1 (the batch's tokens share the weight reads the drafts would ride
on), so speculation pays alone or in pairs only. With the GGUF weights kept quantized (the default model) the
integer work grows with the query tokens: since the repacked GGUF kernels, 8 tokens of one request cost ~1.85x one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenmill.config import SpeculativeConfig
from tokenmill.messages import SchedulerStats
from tokenmill.scheduler.ngram_proposer import NgramProposer, TokenBuffer
from tokenmill.scheduler.request import Request

MAX_SKIP_STEPS = 32
STEP_TOKEN_BUDGET = 8
MAX_SPECULATING_BATCH = 2


class SpecDecodeState:
    """One request's speculation state (`Request.spec`)."""

    __slots__ = ("tokens", "max_drafts", "skip_steps", "misses")

    def __init__(self, k: int) -> None:
        self.tokens = TokenBuffer()
        self.max_drafts = k  # the allowance for the next proposal
        self.skip_steps = 0  # steps left without proposing (back-off after a step that accepted nothing)
        self.misses = 0  # consecutive steps that accepted nothing


class Speculator:
    """What the scheduler asks of a speculation method: drafts for a decoding request (`propose`), the KV slots the
    workers write past a request's tokens while proposing (`lookahead_slots`), the workers' proposals (`receive`);
    and vLLM's spec_decode counters until `take_stats`. Subclasses: `NgramSpeculator`, `DraftModelSpeculator`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.step_draft_budget = STEP_TOKEN_BUDGET - 1  # draft tokens the step being planned may still take
        self.max_speculating_batch = config.disable_by_batch_size or MAX_SPECULATING_BATCH

    def begin_step(self, num_running: int) -> None:
        """A new step is being planned with `num_running` running requests: reset the step's draft-token budget."""
        self.step_draft_budget = (
            max(0, STEP_TOKEN_BUDGET - num_running) if num_running <= self.max_speculating_batch else 0
        )

    @staticmethod
    def allowed(req: Request) -> bool:
        """Whether verification reproduces this request's sampling exactly (else it runs without drafts)."""
        s = req.sampling
        return (
            req.grammar is None
            and s.structured_outputs is None
            and s.logprobs is None
            and s.prompt_logprobs is None
            and s.presence_penalty == 0.0
            and s.frequency_penalty == 0.0
            and s.repetition_penalty == 1.0
            and not req.is_embedding
        )

    @property
    def lookahead_slots(self) -> int:
        """KV slots past a request's scheduled tokens the workers write while proposing after them (0: none)."""
        return 0

    def propose(self, req: Request, limit: int) -> list[int]:
        """Drafts for a decoding request: at most `limit` (what the budget, max_tokens and the context allow)."""
        raise NotImplementedError

    def receive(self, req: Request, proposal: list[int]) -> None:
        """The workers' proposal after the request's newest token (`StepResult.draft_token_ids`); by default the
        method proposes in the scheduler and there is none."""

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: the counters, and the request's allowance for next time."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        state = req.spec
        if state is None:
            return
        if num_accepted == num_drafts:
            state.max_drafts = min(self.k, 2 * state.max_drafts)
        else:
            state.max_drafts = max(1, num_accepted + 1)
        if num_accepted == 0:
            state.misses += 1
            state.skip_steps = min(MAX_SKIP_STEPS, 1 << (state.misses - 1))
        else:
            state.misses = 0

    def take_stats(self) -> tuple[int, int, int, list[int]]:
        """(drafts, draft tokens, accepted tokens, accepted per position) since the last call."""
        stats = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.accepted_per_pos)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        return stats


class NgramSpeculator(Speculator):
    """Prompt lookup (scheduler/ngram_proposer.py) with per-request back-off and the per-step draft budget."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, req: Request, limit: int) -> list[int]:
        if not self.allowed(req):
            return []
        state = req.spec
        if state is None:
            state = req.spec = SpecDecodeState(self.k)
        if state.skip_steps > 0:
            state.skip_steps -= 1
            return []
        limit = min(limit, state.max_drafts, self.step_draft_budget)
        if limit <= 0:
            return []
        drafts = self.proposer.propose(state.tokens.sync(req.all_token_ids), limit)
        self.step_draft_budget -= len(drafts)
        return drafts


class SpecDecodeLogger:
    """The periodic speculative-decoding log line (as vLLM's SpecDecodingLogging), from the stats reports."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0, clock: Callable[[], float] | None = None) -> None:
        self.log = log
        self.interval_s = interval_s
        self.clock = clock or time.monotonic
        self.last_log_time = self.clock()
        self._reset()

    def _reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, stats: SchedulerStats) -> str | None:
        """Add a SchedulerStats report; log (and return) the line when the interval has passed and drafts ran."""
        self.num_drafts += stats.spec_num_drafts
        self.num_draft_tokens += stats.spec_num_draft_tokens
        self.num_accepted_tokens += stats.spec_num_accepted_tokens
        per_pos = stats.spec_accepted_per_pos
        if len(per_pos) > len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for i, count in enumerate(per_pos):
            self.accepted_per_pos[i] += count
        now = self.clock()
        if now - self.last_log_time < self.interval_s or not self.num_drafts:
            return None
        elapsed = now - self.last_log_time
        rates = ", ".join(f"{count / self.num_drafts:.3f}" for count in self.accepted_per_pos)
        line = (
            f"SpecDecoding metrics: Mean acceptance length: {1 + self.num_accepted_tokens / self.num_drafts:.2f}, "
            f"Accepted throughput: {self.num_accepted_tokens / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {self.num_draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100 * self.num_accepted_tokens / self.num_draft_tokens:.1f}%"
        )
        self.log.info("%s", line)
        self.last_log_time = now
        self._reset()
        return line
