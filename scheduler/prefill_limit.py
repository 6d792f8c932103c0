"""How many tokens of prefill a step may carry while other requests decode, so their inter-token gap stays within
`1 + MIXED_STEP_EXTRA` (1.5) times their decode-only gap (issue 28: no request can stall the others).

A step's time is roughly a decode step's plus a cost per prefill token (the forward of each, and for a prompt
position asking for logprobs its LM head and scoring: the scheduler counts both as budget tokens, `_budget_cost`).
Keeping a mixed step within 1.5 decode steps means a prefill chunk of at most `0.5 * decode step time / per-token
time` budget tokens. The target was two decode steps; but a bystander's p99 gap then sat at 2x its idle p99 by
design, and any noise on top (a busier step, a shared core) took it past the 2x issue 28 holds it to. At 1.6 the
prefill kinds of `scripts/bench_bystander.py` still touched 2.00 in one run of four on a 2-vCPU AVX2 host.

vLLM's `--long-prefill-token-threshold` and SGLang's `--chunked-prefill-size` are fixed numbers; the right number
differs a hundredfold between a small model on CPU (a few tokens: a decode step reads the weights once, a prefill token
computes through them) and a large one on a GPU (hundreds), so by default it is learnt from the workers' own step times
(`StepResult.model_time_s`): the median of the recent decode-only steps, and of the last few steps' per-token cost of
prefill, weighted by their tokens (a prefill-only step's whole time counts, overhead included, which errs toward smaller
chunks). Until both are known, nothing is limited; a fixed `--long-prefill-token-threshold` replaces the estimate, and 0
turns the limit off (vLLM's default). Medians follow a change of load while one slow step (a preempted core) moves
nothing. The prefill median is over `PREFILL_WINDOW` steps only: a prompt's later chunks cost more a token than its
first (each attends over the whole prefix: at 1,000 tokens of context about twice the first chunk's cost on a 2-vCPU
AVX2 host), and a median over 32 chunks lagged ~16 chunks behind, so a long prompt's last chunks took a bystander's step
to ~1.9x its decode-only one instead of the 1.6x then aimed at.

A CPU worker replays recorded steps of a few sequences and tokens (`workers/cpu_verify_graphs.py`: `WorkerReady.
replayed_step_seqs` / `replayed_step_tokens`); a step one token larger runs eagerly at ~2x the cost per token (a 9-token
step took 41 ms against 21 ms for 8 on the default model). The per-token time learnt from the replayed steps then
undercounts the eager ones, and a learnt limit past the replayed shape swings between the two. So while a step could
still replay (its decoders leave a sequence free), a learnt limit keeps the step within the replayed tokens.

The 0.5 is one prompt's share. When several clients wait for their prompts (a burst of arrivals under load),
each gets it: `P` clients prefilling make a step of up to `1 + 0.5 P` decode steps. One request (its n choices
count once) never takes more than one share, so it cannot stall the others; but a queue of new requests beside a
few decoders no longer crawls through its prompts a few tokens a step (concurrency 16 on a Qwen2.5-0.5B Q4_K_M lost
a third of its output tokens/s to that), and a decoder's gap grows with the number of users arriving, as load.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 32  # recent decode-only steps the decode step's median is taken over
PREFILL_WINDOW = 5  # recent steps with prefill the per-token median is taken over: an outlier moves it little
# the share of a decode step's time a step's prefill may add while others decode: the bystander's margin below 2x
# for the step-to-step noise, paid for with more, shorter prefill chunks (a prompt's first token comes later)
MIXED_STEP_EXTRA = 0.5


class PrefillLimit:
    """The prefill budget tokens a step may take while some request decodes; learnt from observed steps."""

    def __init__(
        self,
        threshold: int | None = None,
        window: int = WINDOW,
        replayed_seqs: int = 0,
        replayed_tokens: int = 0,
        prefill_window: int = PREFILL_WINDOW,
    ) -> None:
        self.threshold = threshold  # --long-prefill-token-threshold: > 0 fixed, 0 no limit (vLLM's), None learnt
        # the largest multi-token step the workers replay (0: none): sequences, and tokens over them all
        self.replayed_seqs = replayed_seqs
        self.replayed_tokens = replayed_tokens
        self._decode_step_s: deque[float] = deque(maxlen=window)
        # (time per budget token, budget tokens) of the recent steps with prefill
        self._prefill_token_s: deque[tuple[float, int]] = deque(maxlen=prefill_window)

    def observe(self, num_decodes: int, prefill_cost: int, model_time_s: float) -> None:
        """One finished step: how many requests decoded in it, the budget tokens its prefill chunks took, and the
        workers' time for it."""
        if model_time_s <= 0 or (num_decodes == 0 and prefill_cost == 0):
            return
        if prefill_cost == 0:
            self._decode_step_s.append(model_time_s)
            return
        decode_s = self.decode_step_s() if num_decodes else 0.0
        if num_decodes and decode_s is None:
            return  # the decodes' share of this step is unknown yet
        self._prefill_token_s.append((max(model_time_s - (decode_s or 0.0), 0.0) / prefill_cost, prefill_cost))

    def decode_step_s(self) -> float | None:
        """The median time of the recent decode-only steps; None before any."""
        return statistics.median(self._decode_step_s) if self._decode_step_s else None

    def prefill_token_s(self) -> float | None:
        """The time of one prefill budget token over the recent steps with prefill, their median weighted by their
        tokens; None before any. Weighted: a step of 1 or 2 prefill tokens (an n > 1 request's later choice
        recomputing its cached prompt's last token) adds time within the step's noise, often none, and a few such
        steps made the plain median 0, which lifted the limit altogether: a 1,022-token prompt could then go in
        256-token chunks beside a bystander (one bystander run saw gaps of 0.5-1.0 s, its window a third as long
        as usual)."""
        if not self._prefill_token_s:
            return None
        ordered = sorted(self._prefill_token_s)
        half, seen = sum(tokens for _, tokens in ordered) / 2, 0
        for token_s, tokens in ordered:
            seen += tokens
            if seen >= half:
                return token_s
        return ordered[-1][0]

    def tokens(self, num_decodes: int = 1, num_prefilling: int = 1) -> int | None:
        """The prefill budget tokens a step may take while `num_decodes` requests decode (at least 1) and
        `num_prefilling` client requests wait for prompt tokens (one share each); None: no limit."""
        if self.threshold is not None:
            return self.threshold or None
        decode_s, token_s = self.decode_step_s(), self.prefill_token_s()
        if decode_s is None or token_s is None:
            return None
        share = max(1, num_prefilling)
        if token_s == 0:  # prefill measured free: no learnt bound, but a chunk still keeps a replayed step's shape
            learnt = 1 << 62
        else:
            learnt = max(1, int(share * MIXED_STEP_EXTRA * decode_s / token_s + 1e-9))  # 0.6 * 5 is 2.999...
        if share == 1 and num_decodes < self.replayed_seqs:  # a prefill chunk still fits a replayed step's sequences
            return max(1, min(learnt, self.replayed_tokens - num_decodes))
        return learnt
