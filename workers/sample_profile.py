"""The sampler's part of the worst-case step that the memory profile runs (`Worker._profile_peak_memory`).

After the profile's forward, the real code of a step's tail runs on dummy requests that take every costly path at
once, so the profiled peak holds the sampler's working memory as it is, not a formula of it:

- one prompt-logprobs chunk (`prompt_logprobs.py`): the most rows a step scores at once, `--max-logprobs`
  alternatives each, before the sampler as in `Worker.execute`;
- the sample stage (`sample_stage.py`, `sampler.py`) over `--max-num-seqs` rows, every one with top-k just under
  the vocabulary (a near-full sort), top-p and min-p; repetition, frequency and presence penalties over a full
  history of max_model_len tokens (half prompt, half output, all counted in this step as after a resume: the [V]
  masks and counts, and the index of every output token); `--max-logit-bias` biases; min_tokens; `--max-logprobs`
  logprobs; and an all-allowed grammar bitmask (`grammar_mask.py`).

The draft model's proposals are not part of it (they need the draft's KV; their tensors are a decode step's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.messages import SamplingParams, StepPlan
from tokenmill.workers.attention import AttentionMetadata
from tokenmill.workers.models.layers import TensorParallel
from tokenmill.workers.prompt_logprobs import (
    PromptLogprobsState,
    PromptRows,
    compute_prompt_logprobs,
    prompt_logprobs_chunk_rows,
)
from tokenmill.workers.request_state import CachedRequest
from tokenmill.workers.sample_stage import SampleStage
from tokenmill.workers.sampler import RequestSamplingState
from tokenmill.workers.step_inputs import StepBatch


@dataclass(frozen=True)
class WorstCaseSampling:
    """The sizes of the costliest sample stage the engine's limits allow."""

    num_seqs: int  # --max-num-seqs rows sampled
    vocab_size: int
    history_len: int  # every row's prompt + output tokens (max_model_len)
    num_logprobs: int  # --max-logprobs: sampled-token and prompt logprobs alternatives
    num_logit_bias: int  # --max-logit-bias entries per row
    prompt_logprobs_rows: int  # rows of one prompt-logprobs chunk

    @classmethod
    def from_config(cls, config: EngineConfig, vocab_size: int, max_model_len: int) -> WorstCaseSampling:
        max_num_seqs = config.scheduler.max_num_seqs
        return cls(
            num_seqs=max_num_seqs,
            vocab_size=vocab_size,
            history_len=max_model_len,
            num_logprobs=config.server.max_logprobs,
            num_logit_bias=config.server.max_logit_bias,
            prompt_logprobs_rows=min(prompt_logprobs_chunk_rows(max_num_seqs), config.scheduler.max_num_batched_tokens),
        )

    def sampling_params(self) -> SamplingParams:
        """Every filter, penalty and extra the sampler implements, on at once."""
        vocab = self.vocab_size
        return SamplingParams(
            temperature=1.0,
            top_k=max(1, vocab - 1),
            top_p=0.9,
            min_p=0.01,
            repetition_penalty=1.1,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            logit_bias={token_id % vocab: 1.0 for token_id in range(min(self.num_logit_bias, vocab))},
            min_tokens=self.history_len + 1,  # the ending ids stay blocked
            logprobs=self.num_logprobs,
            prompt_logprobs=self.num_logprobs,
        )

    def requests(self, eos_token_ids: list[int], device: torch.device) -> list[CachedRequest]:
        """`num_seqs` requests, each with its full history and its own sampling state."""
        params = self.sampling_params()
        history = [position % self.vocab_size for position in range(self.history_len)]
        num_prompt = max(1, self.history_len // 2)
        requests = []
        for index in range(self.num_seqs):
            state = RequestSamplingState(params, history[:num_prompt], eos_token_ids, device)
            state.output_token_ids = history[num_prompt:]
            requests.append(CachedRequest(f"profile-{index}", history, [], "generate", state))
        return requests

    def grammar_plan(self, requests: list[CachedRequest]) -> StepPlan:
        """A plan whose every sampled row is under a grammar that allows every token."""
        words = -(-self.vocab_size // 32)
        bitmask = np.full((len(requests), words), -1, dtype=np.int32).tobytes()
        return StepPlan(0, [], [], [], [request.request_id for request in requests], bitmask)


def profile_sample_stage(
    worst: WorstCaseSampling,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    attn: AttentionMetadata,
    rank: int,
    tp: TensorParallel,
    eos_token_ids: list[int],
) -> None:
    """Run one prompt-logprobs chunk, then the sample stage over `worst.num_seqs` rows of `hidden` (rows reused when
    the step has fewer tokens). Every tensor-parallel rank calls this: the LM head gathers across them."""
    device = hidden.device
    num_tokens = hidden.shape[0]
    chunk = min(worst.prompt_logprobs_rows, num_tokens)
    state = PromptLogprobsState(worst.num_logprobs, chunk + 1)
    rows = PromptRows(list(range(chunk)), [row % worst.vocab_size for row in range(chunk)], [state] * chunk)
    compute_prompt_logprobs(compute_logits, hidden, rows, tp.rank, chunk)

    requests = worst.requests(eos_token_ids, device)
    sample_rows = torch.arange(worst.num_seqs, device=device) % num_tokens
    not_read = torch.empty(0, dtype=torch.long, device=device)  # the sample stage reads no token ids or positions
    batch = StepBatch(not_read, not_read, attn, sample_rows, requests)
    SampleStage(compute_logits, rank, tp, device, None).run(worst.grammar_plan(requests), batch, hidden)
