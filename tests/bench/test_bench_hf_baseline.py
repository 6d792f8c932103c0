"""The transformers static-batch baseline: left padding, batch boundaries, and the useful-token count."""

from __future__ import annotations

import torch
from benchlib.hf_baseline import left_padded_batch, load_hf_model, run_static_batches
from benchlib.workload import BenchRequest


def test_left_padding_puts_every_prompt_flush_right():
    ids, mask = left_padded_batch([BenchRequest([5, 6, 7], 1), BenchRequest([8], 1)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_static_batches_count_only_each_requests_own_tokens_as_useful(tiny_checkpoints):
    model = load_hf_model(str(tiny_checkpoints("llama")), None, torch.float32)
    requests = [BenchRequest([10 + i] * (3 + i), out) for i, out in enumerate([2, 5, 3, 1, 4])]
    run = run_static_batches(model, requests, batch_size=2, pad_id=0)
    assert run.num_requests == 5
    assert run.input_tokens == sum(3 + i for i in range(5))
    assert run.useful_output_tokens == 2 + 5 + 3 + 1 + 4
    # batches [2, 5], [3, 1], [4]: every row runs to its batch's longest max_tokens
    assert run.generated_tokens == 2 * 5 + 2 * 3 + 1 * 4
    assert run.output_throughput == run.useful_output_tokens / run.elapsed_s
