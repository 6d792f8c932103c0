"""The transformers baseline: `model.generate` over static, left-padded batches of the benchmark's requests.

Requests are taken in workload order in batches of up to `batch_size`; each batch is padded on the left to its
longest prompt and runs until its longest `max_tokens` (EOS is suppressed with `min_new_tokens`, as `ignore_eos`
does in the engine). Only each request's own `max_tokens` count as useful output; the rest is the padding waste of
static batching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from benchlib.workload import BenchRequest


@dataclass
class BaselineRun:
    elapsed_s: float
    num_requests: int
    input_tokens: int
    useful_output_tokens: int  # the sum of every request's own max_tokens
    generated_tokens: int  # everything the batches generated, padding rows included

    @property
    def output_throughput(self) -> float:
        return self.useful_output_tokens / self.elapsed_s

    @property
    def total_token_throughput(self) -> float:
        return (self.input_tokens + self.useful_output_tokens) / self.elapsed_s

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.elapsed_s


def load_hf_model(path: str, gguf_file: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()


def left_padded_batch(requests: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [len(requests), longest prompt], padded on the left."""
    width = max(r.input_len for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        input_ids[row, width - request.input_len :] = torch.tensor(request.prompt_ids)
        attention_mask[row, width - request.input_len :] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def generate_batch(model, requests: list[BenchRequest], pad_id: int) -> int:
    """Run one static batch to its longest max_tokens; returns the tokens generated per row."""
    input_ids, attention_mask = (t.to(model.device) for t in left_padded_batch(requests, pad_id))
    new_tokens = max(r.output_len for r in requests)
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
    )
    generated = out.shape[1] - input_ids.shape[1]
    if generated != new_tokens:
        raise RuntimeError(f"transformers generated {generated} tokens where {new_tokens} were asked for")
    return generated


def run_static_batches(model, requests: list[BenchRequest], batch_size: int, pad_id: int) -> BaselineRun:
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    generate_batch(model, [BenchRequest(requests[0].prompt_ids[:16], 2)], pad_id)  # warm-up
    generated = 0
    started = time.perf_counter()
    for batch in tqdm(batches, desc="transformers batches", dynamic_ncols=True):
        generated += generate_batch(model, batch, pad_id) * len(batch)
    elapsed = time.perf_counter() - started
    return BaselineRun(
        elapsed, len(requests), sum(r.input_len for r in requests), sum(r.output_len for r in requests), generated
    )
