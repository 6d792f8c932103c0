"""Turn one step's logits into next tokens: one row per request, a handful of batched tensor ops per step.

The order follows vLLM V1:
1. logprobs (when any row asks) come from the raw logits' log_softmax;
2. logit_bias, then min_tokens (the ids that would end the request get -inf), then the repetition penalty
   (prompt + output tokens) and the frequency / presence penalties (output tokens);
3. greedy rows (temperature < 1e-5) take the argmax of those processed logits;
4. the other rows, sampled as one block: temperature; top-k, top-p and min-p on the rows that use any of them
   (one descending sort serves all three, or a cheaper `topk` when every such row has a top-k); softmax; and the
   exponential race `argmax(p / q)`, q ~ Exp(1). A seeded request draws the q of its i-th output token from its own
   generator re-seeded with (seed, i), so the same seed gives the same tokens whatever else shares the batch and
   however often the request is preempted and resumed; unseeded rows draw from torch's global generator. On the CPU
   the race runs natively (`row_ops.race_rows`: q from a hash of the row's key, (seed, i) or a draw from torch's
   generator, and the token id; no noise tensor, no softmax), ~3x cheaper a step for two sampled rows of a 49k
   vocabulary; a GPU keeps the torch ops.

Per-row parameters travel to the device as one packed tensor per stage, work no row needs is skipped, and the
only host sync is the single `.tolist()` at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.kernels import row_ops
from tokenmill.messages import SamplingParams

_UINT64_MASK = (1 << 64) - 1


class RequestSamplingState:
    """What the sampler keeps for one request across steps; the sample stage appends each sampled token."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: list[int],
        device: torch.device | str,
    ) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.device = torch.device(device)
        # re-seeded before each draw from (seed, output position): see `_exponential_noise`
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=self.device)
        # Ids blocked while fewer than min_tokens outputs exist: those that would end the request. With
        # ignore_eos the scheduler does not stop at EOS, so EOS needs no blocking (as vLLM does).
        ending_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.min_tokens_blocked_ids = sorted(ending_ids)
        self.needs_penalties = (
            params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        )
        # Penalty bookkeeping, made on first use (it needs the vocab size and device) and updated incrementally:
        # a [V] bool mask of prompt tokens and [V] float counts of the output tokens counted so far.
        self._prompt_mask: torch.Tensor | None = None
        self._output_counts: torch.Tensor | None = None
        self._num_counted_outputs = 0
        self._logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values), made on first use

    def logit_bias_tensors(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's logit_bias within the vocabulary as (ids, values) on its device, built once: a request may
        carry --max-logit-bias entries, and every step of it applies them."""
        if self._logit_bias is None:
            items = [(t, b) for t, b in (self.params.logit_bias or {}).items() if 0 <= t < vocab_size]
            ids = torch.tensor([t for t, _ in items], dtype=torch.long)
            values = torch.tensor([b for _, b in items], dtype=torch.float32)
            self._logit_bias = (_host_to_device(ids, self.device), _host_to_device(values, self.device))
        return self._logit_bias

    def _ensure_penalty_tensors(self, vocab_size: int, device: torch.device) -> None:
        if self._prompt_mask is not None:
            return
        prompt_ids = torch.tensor(self.prompt_token_ids, dtype=torch.long)
        prompt_ids = prompt_ids[(prompt_ids >= 0) & (prompt_ids < vocab_size)]  # filtered on the host: no sync
        self._prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self._prompt_mask[_host_to_device(prompt_ids, device)] = True
        self._output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self._num_counted_outputs = 0


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (logprob of the sampled token, top ids, top logprobs); rows that did not ask get empty top lists
    logprobs: list[tuple[float, list[int], list[float]]] | None


@dataclass
class SamplingInputs:
    """A step's per-row sampling parameters on the device, made from the states before the forward so that they
    travel in the step's one host-to-device copy (`workers/staging.py`)."""

    params: torch.Tensor  # [4, N] float32: temperature, top_k (0: off), top_p, min_p of every row
    random_rows: torch.Tensor  # [R] int64: the rows that sample (the others are greedy)
    filter_rows: torch.Tensor  # [F] int64: positions among the random rows of those top-k/top-p/min-p filter


def sampling_inputs(
    states: Sequence[RequestSamplingState], vocab_size: int, upload: Callable[[torch.Tensor], torch.Tensor]
) -> SamplingInputs:
    """The states' `SamplingInputs`, each host tensor sent to the device by `upload`."""
    params = [state.params for state in states]
    random_rows = [row for row, p in enumerate(params) if not p.greedy]
    filter_rows = [i for i, row in enumerate(random_rows) if _needs_filtering(params[row], vocab_size)]
    packed = [[p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params]]
    packed.append([p.min_p for p in params])
    return SamplingInputs(
        upload(torch.tensor(packed, dtype=torch.float32).view(4, len(params))),
        upload(torch.tensor(random_rows, dtype=torch.long)),
        upload(torch.tensor(filter_rows, dtype=torch.long)),
    )


def sample(
    logits: torch.Tensor, states: Sequence[RequestSamplingState], inputs: SamplingInputs | None = None
) -> SampleResult:
    """Sample one token per row of `logits` ([N, V], one row per state); `inputs`: the states' parameters already on
    the device (else sent here). The caller's tensor is left untouched."""
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling states")
    logits = logits.float()
    params = [state.params for state in states]
    raw_logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None

    logits = process_logits(logits, states)
    random_rows = [row for row, p in enumerate(params) if not p.greedy]
    if not random_rows:
        token_ids = greedy_tokens(logits)
        return _collect_result(token_ids, raw_logprobs, params)
    if inputs is None:
        inputs = sampling_inputs(states, logits.shape[1], lambda tensor: _host_to_device(tensor, logits.device))
    if len(random_rows) == len(states):
        token_ids = _sample_random(logits, states, inputs.params, inputs.filter_rows)
    else:  # greedy rows take the argmax; the others are sampled as one block
        rows_index = inputs.random_rows
        sampled = _sample_random(
            logits.index_select(0, rows_index),
            [states[row] for row in random_rows],
            inputs.params.index_select(1, rows_index),
            inputs.filter_rows,
        )
        token_ids = greedy_tokens(logits).index_copy_(0, rows_index, sampled)
    return _collect_result(token_ids, raw_logprobs, params)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: natively on the CPU (torch's took ~28 us over a 49k vocabulary, a batch-1 step's largest
    sampling cost), the same indices."""
    native = row_ops.argmax_rows(logits)
    return native if native is not None else logits.argmax(dim=-1)


# ---------------------------------------------------------------- logits processors (every row)


def process_logits(logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
    """logit_bias, min_tokens and penalties applied to a copy of `logits` (returned as is when no row needs any)."""
    vocab_size = logits.shape[1]
    bias_rows: list[int] = []
    blocked_rows: list[int] = []
    blocked_ids: list[int] = []
    penalty_rows: list[int] = []
    for row, state in enumerate(states):
        params = state.params
        if params.logit_bias:
            bias_rows.append(row)
        if len(state.output_token_ids) < params.min_tokens:
            ids = [token_id for token_id in state.min_tokens_blocked_ids if 0 <= token_id < vocab_size]
            blocked_rows.extend([row] * len(ids))
            blocked_ids.extend(ids)
        if state.needs_penalties:
            penalty_rows.append(row)
    if not (bias_rows or blocked_ids or penalty_rows):
        return logits

    logits = logits.clone()
    device = logits.device
    for row in bias_rows:  # each request's bias tensors are built once, not per step
        ids, values = states[row].logit_bias_tensors(vocab_size)
        logits[row].index_add_(0, ids, values.to(logits.dtype))
    if blocked_ids:
        index = _host_to_device(torch.tensor([blocked_rows, blocked_ids], dtype=torch.long), device)
        logits.index_put_((index[0], index[1]), torch.full((), float("-inf"), device=device))
    if penalty_rows:
        logits = _apply_penalties(logits, [states[row] for row in penalty_rows], penalty_rows)
    return logits


def _apply_penalties(logits: torch.Tensor, states: Sequence[RequestSamplingState], rows: list[int]) -> torch.Tensor:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties on `rows` of `logits`."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    counts = _updated_output_counts(states, vocab_size, device)  # [M, V]
    packed = torch.tensor(
        [[s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty] for s in states],
        dtype=torch.float32,
    )
    repetition, frequency, presence = _host_to_device(packed, device).unsqueeze(-1).unbind(dim=1)  # each [M, 1]

    all_rows = len(rows) == num_rows
    rows_index = None if all_rows else _host_to_device(torch.tensor(rows, dtype=torch.long), device)
    selected = logits if all_rows else logits.index_select(0, rows_index)
    in_output = counts > 0
    if any(s.params.repetition_penalty != 1.0 for s in states):
        seen = torch.stack([s._prompt_mask for s in states]) | in_output
        penalized = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(seen, penalized, selected)
    if any(s.params.frequency_penalty != 0.0 for s in states):
        selected = torch.addcmul(selected, counts, frequency, value=-1.0)
    if any(s.params.presence_penalty != 0.0 for s in states):
        selected = torch.addcmul(selected, in_output.float(), presence, value=-1.0)
    if all_rows:
        return selected
    return logits.index_copy_(0, rows_index, selected)


def _updated_output_counts(
    states: Sequence[RequestSamplingState], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Stack the states' output-token counts into [M, V], adding only the tokens appended since the last call."""
    new_rows: list[int] = []
    new_ids: list[int] = []
    for row, state in enumerate(states):
        state._ensure_penalty_tensors(vocab_size, device)
        new_tokens = state.output_token_ids[state._num_counted_outputs :]
        new_rows.extend([row] * len(new_tokens))
        new_ids.extend(new_tokens)
        state._num_counted_outputs = len(state.output_token_ids)
    counts = torch.stack([state._output_counts for state in states])
    if new_ids:
        index = _host_to_device(torch.tensor([new_rows, new_ids], dtype=torch.long), device)
        counts.index_put_((index[0], index[1]), torch.ones(len(new_ids), device=device), accumulate=True)
    # Each state keeps a view of its row, so next step's stack starts from the updated counts.
    for row, state in enumerate(states):
        state._output_counts = counts[row]
    return counts


# ---------------------------------------------------------------- sampling (the non-greedy rows)


def _sample_random(
    logits: torch.Tensor,
    states: Sequence[RequestSamplingState],
    row_params: torch.Tensor,
    filter_index: torch.Tensor,
) -> torch.Tensor:
    """Temperature, top-k/top-p/min-p, then the exponential race; every row here samples. `row_params` [4, R]:
    the rows' temperature, top_k, top_p, min_p on the device; `filter_index`: the rows top-k/top-p/min-p filter."""
    vocab_size = logits.shape[1]
    params = [state.params for state in states]
    scaled = logits / row_params[0].unsqueeze(1)
    filter_rows = [row for row, p in enumerate(params) if _needs_filtering(p, vocab_size)]
    if filter_rows:
        all_rows = len(filter_rows) == len(params)
        filter_params = row_params if all_rows else row_params.index_select(1, filter_index)
        scaled = _filter_rows(scaled, [params[row] for row in filter_rows], filter_params, filter_index)
    native = row_ops.race_rows(scaled, _race_keys(states)) if scaled.is_cpu else None
    if native is not None:
        return native
    probs = scaled.softmax(dim=-1)
    return probs.div_(_exponential_noise(probs, states)).argmax(dim=-1)


def _needs_filtering(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size or params.top_p < 1.0 or params.min_p > 0.0


def _filter_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], packed: torch.Tensor, rows_index: torch.Tensor
) -> torch.Tensor:
    """Apply top-k/top-p/min-p to the rows `rows_index` of `logits` only (the others need no sort); `packed` [4, F]:
    those rows' temperature, top_k, top_p, min_p on the device."""
    num_rows, vocab_size = logits.shape
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    _, raw_top_k, top_p, min_p = packed.unbind(0)
    top_k = torch.where((raw_top_k > 0) & (raw_top_k < vocab_size), raw_top_k, float(vocab_size))
    all_rows = len(params) == num_rows
    selected = logits if all_rows else logits.index_select(0, rows_index)
    filtered = filter_top_k_top_p_min_p(
        selected,
        top_k.long() if any(k < vocab_size for k in top_ks) else None,
        top_p if any(p.top_p < 1.0 for p in params) else None,
        min_p if any(p.min_p > 0.0 for p in params) else None,
        num_candidates=max(top_ks),
    )
    if all_rows:
        return filtered
    return logits.index_copy_(0, rows_index, filtered)


def filter_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    num_candidates: int | None = None,
) -> torch.Tensor:
    """Set to -inf the logits that top-k, then top-p, then min-p remove; per-row parameters, None = no row uses it.

    top_k [N] long (V disables it), top_p [N] float (1 disables it), min_p [N] float (0 disables it). The most
    likely token always survives. top-p keeps the smallest prefix of tokens (by descending probability, after
    top-k) whose mass reaches p; min-p removes tokens less likely than min_p times the top token.
    Each filter keeps a prefix of the sorted row, so the result is one cutoff logit per row: tokens tied with the
    cutoff all survive, whatever order the sort gave them, which keeps a seeded request's tokens independent of
    its batch. `num_candidates` (a host int, at least every row's top_k) lets a `topk` of that many columns stand
    in for the full sort, which costs far more on a large vocabulary; both give the same cutoffs.
    """
    if top_k is None and top_p is None and min_p is None:
        return logits
    vocab_size = logits.shape[1]
    if num_candidates is not None and num_candidates < vocab_size:
        cutoff = _cutoff_logits(logits.topk(num_candidates, dim=-1).values, top_k, top_p, min_p, logits)
    else:
        cutoff = None
        if logits.device.type == "cpu" and vocab_size > _CPU_SORT_CANDIDATES:
            cutoff = _cutoff_logits_from_candidates(logits, top_k, top_p, min_p)
        if cutoff is None:
            cutoff = _cutoff_logits(logits.sort(dim=-1, descending=True).values, top_k, top_p, min_p, logits)
    return logits.masked_fill(logits < cutoff, float("-inf"))


# On CPU a full sort of a large vocabulary dwarfs everything else in a step, while top-p / min-p usually stop
# within the first few hundred tokens: try this many candidates first (checking costs no sync on CPU).
_CPU_SORT_CANDIDATES = 1024


def _cutoff_logits_from_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor | None:
    """The cutoffs from the top candidates only, or None when some row's kept prefix may run past them."""
    vocab_size = logits.shape[1]
    if top_k is not None and bool(((top_k > _CPU_SORT_CANDIDATES) & (top_k < vocab_size)).any()):
        return None
    candidates = logits.topk(_CPU_SORT_CANDIDATES, dim=-1).values
    keep = _kept_prefix(candidates, top_k, top_p, min_p, logits)
    truncated_by_top_k = top_k < vocab_size if top_k is not None else torch.zeros_like(keep[:, 0])
    if not bool((truncated_by_top_k | ~keep[:, -1]).all()):
        return None
    return candidates.gather(1, keep.sum(dim=-1, keepdim=True) - 1)


def _cutoff_logits(
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    logits: torch.Tensor,
) -> torch.Tensor:
    keep = _kept_prefix(sorted_logits, top_k, top_p, min_p, logits)
    return sorted_logits.gather(1, keep.sum(dim=-1, keepdim=True) - 1)


def _kept_prefix(
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    logits: torch.Tensor,
) -> torch.Tensor:
    """[N, C] bool over the C leading sorted logits: True for the prefix that top-k, top-p and min-p keep.

    Probabilities are normalised over each row's top-k, or over the whole row of `logits` when it has no top-k,
    so the leading C columns are enough whenever they hold the row's top-k.
    """
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        positions = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)
        keep &= positions.unsqueeze(0) < top_k.unsqueeze(1)
    if top_p is not None or min_p is not None:
        masked = sorted_logits.masked_fill(~keep, float("-inf"))
        log_normalizer = logits.logsumexp(dim=-1, keepdim=True)
        if top_k is not None:
            top_k_normalizer = masked.logsumexp(dim=-1, keepdim=True)
            log_normalizer = torch.where((top_k < logits.shape[1]).unsqueeze(1), top_k_normalizer, log_normalizer)
        sorted_probs = (masked - log_normalizer).exp()
        if top_p is not None:
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            keep &= (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
        if min_p is not None:
            keep &= sorted_probs >= min_p.unsqueeze(1) * sorted_probs[:, :1]
    keep[:, 0] = True
    return keep


def _exponential_noise(probs: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
    """q ~ Exp(1) per (row, token): the rest from the global generator, and a seeded row from its own generator
    seeded with (seed, number of outputs so far), so a request's draws depend on nothing but its seed and position:
    a preempted request, resumed with its outputs, draws the same q as if it had run alone."""
    uniform = torch.empty_like(probs)
    seeded = [(row, state) for row, state in enumerate(states) if state.generator is not None]
    if len(seeded) < len(states):
        uniform.uniform_()
    for row, state in seeded:
        state.generator.manual_seed(position_seed(state.params.seed, len(state.output_token_ids)))
        uniform[row].uniform_(generator=state.generator)
    # q = -log(1 - u), u ~ U[0, 1): Exp(1) by inversion. torch's CPU exponential_ takes ~5x as long (2 rows of a 49k
    # vocabulary: ~5.6 ms against ~1.1 ms, one thread), which every sampled request paid each step.
    noise = uniform.neg_().log1p_().neg_()
    # u = 0 gives exactly 0; 0 / 0 would be NaN, which argmax picks.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _race_keys(states: Sequence[RequestSamplingState]) -> torch.Tensor:
    """The CPU race's noise key of each row (`row_ops.race_rows` hashes it with each token id): a seeded row's from
    (seed, number of outputs so far), as its generator's seed on the torch path; the others' drawn from torch's global
    generator, so `torch.manual_seed` still fixes an unseeded run."""
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (len(states),), dtype=torch.int64)
    for row, state in enumerate(states):
        if state.params.seed is not None:
            key = position_seed(state.params.seed, len(state.output_token_ids))
            keys[row] = key - (1 << 64) if key >= 1 << 63 else key
    return keys


def position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for output `position` of a request seeded with `seed` (splitmix64 of each in turn)."""
    return _splitmix64(_splitmix64(seed & _UINT64_MASK) ^ position)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _UINT64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return x ^ (x >> 31)


# ---------------------------------------------------------------- results


def _collect_result(
    token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, params: Sequence[SamplingParams]
) -> SampleResult:
    if raw_logprobs is None:
        return SampleResult(token_ids.tolist(), None)
    num_top = min(max(p.logprobs or 0 for p in params), raw_logprobs.shape[1])
    columns = [token_ids.unsqueeze(1).double(), raw_logprobs.gather(1, token_ids.unsqueeze(1)).double()]
    if num_top > 0:
        top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)
        columns += [top_ids.double(), top_logprobs.double()]
    # One device-to-host copy for everything: token ids are exact in float64.
    rows = torch.cat(columns, dim=1).tolist()
    sampled_ids: list[int] = []
    logprobs: list[tuple[float, list[int], list[float]]] = []
    for row, p in zip(rows, params):
        k = min(p.logprobs or 0, num_top)
        sampled_ids.append(int(row[0]))
        logprobs.append((row[1], [int(i) for i in row[2 : 2 + k]], row[2 + num_top : 2 + num_top + k]))
    return SampleResult(sampled_ids, logprobs)


def _host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device` without waiting for the device (pinned + non_blocking on CUDA)."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
