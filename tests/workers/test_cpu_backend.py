"""The compiled CPU kernels behind the model: the same logits as the torch path and as Hugging Face, for prompt
chunks (SDPA) followed by single-token steps (the decode kernel), on each architecture."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runner_driver import logits_in_chunks
from tests.helpers.triton_runner import BLOCK_SIZE, CHUNKS, make_runner


@pytest.mark.parametrize("kind", ["llama", "llama-tied-mha", "qwen2", "qwen3"])
def test_kernel_path_logits_match_torch_path_and_hf(tiny_checkpoint, use_cpu_backend, kind):
    path, hf_model = tiny_checkpoint(kind)
    runner = make_runner(path)
    input_ids = torch.randint(3, hf_model.config.vocab_size, (CHUNKS[-1],), generator=torch.Generator().manual_seed(7))
    use_cpu_backend("kernels")
    kernel_logits = logits_in_chunks(runner.model, input_ids, CHUNKS, BLOCK_SIZE)
    use_cpu_backend("torch")
    torch_logits = logits_in_chunks(runner.model, input_ids, CHUNKS, BLOCK_SIZE)
    with torch.no_grad():
        hf_logits = hf_model(input_ids[None]).logits[0]
    torch.testing.assert_close(kernel_logits, torch_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel_logits, hf_logits, atol=1e-4, rtol=1e-4)
