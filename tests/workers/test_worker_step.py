"""The worker's step pieces on their own: engine settings reach the model through its constructor, the one
StepResult builder, and micro-batches joined back into the step's batch."""

from __future__ import annotations

import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.workers.attention import AttentionMetadata
from tokenmill.workers.request_state import CachedRequest
from tokenmill.workers.sample_stage import SampledTokens
from tokenmill.workers.step_inputs import StepBatch, join_step_batches
from tokenmill.workers.worker import Worker, step_result


def test_max_model_len_reaches_the_model_not_the_transformers_config(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    config = EngineConfig(
        model=ModelConfig(path=str(path), max_model_len=48),
        cache=CacheConfig(block_size=4, num_kv_blocks=16),
        parallel=ParallelConfig(device="cpu"),
    )
    worker = Worker(config)
    worker.load_model()
    assert worker.model.model.rotary.max_model_len == 48
    assert [name for name in vars(worker.hf_config) if name.startswith("tokenmill")] == []


def request(request_id: str) -> CachedRequest:
    return CachedRequest(request_id, [1, 2, 3], [1], "generate", None)


def test_step_result_of_sampled_verified_and_silent_steps():
    requests = [request("a"), request("b")]
    sampled = step_result(
        7, requests, SampledTokens([[5], [6]], verified_drafts=False, draft_token_ids=[[1], [2]]), {}, 0.5
    )
    assert (sampled.request_ids, sampled.sampled_token_ids, sampled.accepted_token_ids) == (["a", "b"], [5, 6], None)
    assert sampled.draft_token_ids == [[1], [2]] and sampled.prompt_logprobs is None and sampled.model_time_s == 0.5
    verified = step_result(8, requests, SampledTokens([[5, 9, 4], [6]], verified_drafts=True), None, 0.1)
    assert verified.sampled_token_ids == [5, 6] and verified.accepted_token_ids == [[5, 9, 4], [6]]
    silent = step_result(9, requests, None, None, 0.2)  # a rank that does not answer, or nothing to sample
    assert (silent.step_id, silent.request_ids, silent.sampled_token_ids) == (9, [], [])


def micro_batch(num_tokens: int, rows: list[int], ids: list[str], drafts: list[list[int]]) -> StepBatch:
    metadata = AttentionMetadata(
        torch.zeros(num_tokens, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        False,
        1,
        1,
        4,
        backend=None,
    )  # type: ignore[arg-type]  # never read by the join
    return StepBatch(
        torch.arange(num_tokens),
        torch.arange(num_tokens),
        metadata,
        torch.tensor(rows),
        [request(i) for i in ids],
        drafts,
    )


def test_micro_batches_join_with_rows_shifted_in_step_order():
    joined = join_step_batches([micro_batch(5, [4], ["a"], [[]]), micro_batch(3, [0, 1, 2], ["b"], [[7, 8]])])
    assert joined.sample_rows.tolist() == [4, 5, 6, 7]
    assert [r.request_id for r in joined.sampled_requests] == ["a", "b"] and joined.drafts == [[], [7, 8]]
    assert joined.input_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
