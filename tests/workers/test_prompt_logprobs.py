"""Prompt logprobs through the real Scheduler and Worker in one process (plans through the msgpack codec):
they equal transformers' float32 log_softmax over the same weights, whole or chunked, with prefix caching on, next to
other requests, and they come back once, with the request's first token."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.messages import (
    EngineRequest,
    NewRequestData,
    PromptLogprobs,
    RequestOutput,
    RunningRequestData,
    SamplingParams,
    StepPlan,
    WorkerCommand,
    decoder,
    encode,
)
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.workers.worker import Worker

TOLERANCE = 1e-4
_plan_decoder = decoder(WorkerCommand)


class Engine:
    """The scheduler and one CPU model runner, stepped in this process."""

    def __init__(
        self,
        model: ModelConfig,
        *,
        max_num_batched_tokens: int = 256,
        prefix_caching: bool = True,
        num_blocks: int = 256,
        block_size: int = 4,
    ) -> None:
        config = EngineConfig(
            model=model,
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8),
            parallel=ParallelConfig(device="cpu"),
        )
        self.runner = Worker(config)
        self.runner.load_model()
        self.runner.allocate_kv_cache(num_blocks)
        self.scheduler = Scheduler(config, num_blocks, eos_token_ids=[])
        self.num_blocks = num_blocks
        self.plans: list[StepPlan] = []

    def run(self, *requests: EngineRequest) -> dict[str, list[RequestOutput]]:
        """Add the requests and step until all are done; every request's outputs in order."""
        for request in requests:
            assert self.scheduler.add_request(request) is None
        outputs: dict[str, list[RequestOutput]] = {}
        while self.scheduler.has_unfinished_requests():
            plan = self.scheduler.schedule()
            assert plan is not None
            self.plans.append(plan)
            result = self.runner.execute(_plan_decoder.decode(encode(plan)))
            for out in self.scheduler.update(plan, result):
                outputs.setdefault(out.request_id, []).append(out)
        return outputs


def request(
    request_id: str, prompt: list[int], prompt_logprobs: int | None, max_tokens: int = 3, **sampling
) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=prompt_logprobs, **sampling)
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params)


@torch.no_grad()
def reference_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[P, V] float32 log_softmax of transformers' logits at every prompt position."""
    logits = hf_model(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(dim=-1)


def assert_prompt_logprobs_match(packed: PromptLogprobs, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    """Entry p - 1 scores prompt token p from position p - 1: its logprob, rank and top k as transformers has them
    (ids compared through their reference logprobs, so near ties may come in either order)."""
    assert packed.num_top == k
    entries = packed.entries()
    assert len(entries) == len(prompt) - 1
    for position, (logprob, rank, top_ids, top_logprobs) in enumerate(entries, start=1):
        row = reference[position - 1]
        expected = float(row[prompt[position]])
        assert abs(logprob - expected) < TOLERANCE, (position, logprob, expected)
        assert int((row > expected + TOLERANCE).sum()) + 1 <= rank <= int((row >= expected - TOLERANCE).sum())
        assert len(top_ids) == len(top_logprobs) == k
        expected_top = row.topk(k).values.tolist() if k else []
        assert top_logprobs == pytest.approx(expected_top, abs=TOLERANCE)
        assert [float(row[i]) for i in top_ids] == pytest.approx(top_logprobs, abs=TOLERANCE)
        assert len(set(top_ids)) == k


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoints):
    """(model config, float32 transformers model) of the tiny random llama with SmolLM2's 49152-token vocabulary."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints("llama")
    return ModelConfig(path=str(path)), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("max_num_batched_tokens", [256, 7], ids=["whole-prompt", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_llama, max_num_batched_tokens):
    model, hf_model = tiny_llama
    vocab = hf_model.config.vocab_size
    long_prompt, short_prompt = random_prompt(vocab, 29, 1), random_prompt(vocab, 6, 2)
    engine = Engine(model, max_num_batched_tokens=max_num_batched_tokens)
    outputs = engine.run(
        request("long", long_prompt, 5),
        request("plain", random_prompt(vocab, 9, 3), None),
        request("short", short_prompt, 0),
        request("one-token", long_prompt[:1], 2),
    )
    if max_num_batched_tokens == 7:  # the long prompt really was split, next to the others
        chunks = [n.num_scheduled_tokens for plan in engine.plans for n in plan.new_requests if n.request_id == "long"]
        chunks += [
            r.num_scheduled_tokens
            for plan in engine.plans
            for r in plan.running
            if r.request_id == "long" and r.num_computed_tokens < len(long_prompt)
        ]
        assert len(chunks) >= 4 and sum(chunks) == len(long_prompt)
    for request_id, prompt, k in [("long", long_prompt, 5), ("short", short_prompt, 0)]:
        first, *rest = outputs[request_id]
        assert_prompt_logprobs_match(first.prompt_logprobs, prompt, reference_logprobs(hf_model, prompt), k)
        assert all(out.prompt_logprobs is None for out in rest)  # delivered once, with the first token
        assert sum(len(out.new_token_ids) for out in outputs[request_id]) == 3
    assert outputs["one-token"][0].prompt_logprobs.num_positions == 0  # nothing before the first token to score it from
    assert all(out.prompt_logprobs is None for out in outputs["plain"])
    assert engine.scheduler.kv.pool.num_free_blocks == engine.num_blocks


def test_prompt_logprobs_recompute_a_cached_prefix(tiny_llama):
    model, hf_model = tiny_llama
    prompt = random_prompt(hf_model.config.vocab_size, 26, 4)
    engine = Engine(model, max_num_batched_tokens=10)
    engine.run(request("warm", prompt, None))  # its blocks are now in the prefix cache
    plain = engine.run(request("plain", prompt, None))
    assert plain["plain"][0].num_cached_tokens == 24  # an ordinary request reads them
    outputs = engine.run(request("scored", prompt, 3))
    assert outputs["scored"][0].num_cached_tokens == 0
    scored = [n for plan in engine.plans for n in plan.new_requests if n.request_id == "scored"]
    assert [n.num_computed_tokens for n in scored] == [0]
    assert_prompt_logprobs_match(outputs["scored"][0].prompt_logprobs, prompt, reference_logprobs(hf_model, prompt), 3)
    assert engine.scheduler.kv.pool.num_free_blocks == engine.num_blocks


def test_n_choices_each_carry_the_prompt_logprobs(tiny_llama):
    model, hf_model = tiny_llama
    prompt = random_prompt(hf_model.config.vocab_size, 12, 5)
    engine = Engine(model, max_num_batched_tokens=16)
    group = EngineRequest(
        request_id="g", prompt_token_ids=prompt, sampling=SamplingParams(n=2, max_tokens=2, seed=3, prompt_logprobs=1)
    )
    outputs = engine.run(group)
    reference = reference_logprobs(hf_model, prompt)
    for choice in ("g-0", "g-1"):
        assert_prompt_logprobs_match(outputs[choice][0].prompt_logprobs, prompt, reference, 1)


def test_resumed_request_with_outputs_computes_no_prompt_logprobs_again(tiny_llama):
    model, hf_model = tiny_llama
    prompt = random_prompt(hf_model.config.vocab_size, 10, 6)
    engine = Engine(model)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    first = engine.runner.execute(
        StepPlan(0, [NewRequestData("r", prompt, len(prompt), params, list(range(1, 4)), 0, len(prompt))], [], [])
    )
    assert first.prompt_logprobs["r"].num_positions == len(prompt) - 1
    # preempted after its first token, then sent again in full (prompt + output) and recomputed
    resumed = engine.runner.execute(
        StepPlan(
            1,
            [
                NewRequestData(
                    "r", prompt + first.sampled_token_ids, len(prompt), params, list(range(1, 4)), 0, len(prompt) + 1
                )
            ],
            [],
            ["r"],
        )
    )
    assert resumed.request_ids == ["r"] and resumed.prompt_logprobs is None


def test_a_cached_prefix_with_prompt_logprobs_is_refused_by_the_worker(tiny_llama):
    model, hf_model = tiny_llama
    engine = Engine(model)
    params = SamplingParams(max_tokens=4, prompt_logprobs=2)
    with pytest.raises(ValueError, match="prefix cache"):
        engine.runner.execute(
            StepPlan(0, [NewRequestData("r", list(range(3, 15)), 12, params, [1, 2, 3], 8, 4)], [], [])
        )


def packed(prompt_logprobs: dict[str, PromptLogprobs] | None) -> dict[str, bytes] | None:
    """A step's prompt logprobs as torch.load takes them back (plain bytes)."""
    return None if prompt_logprobs is None else {rid: encode(p) for rid, p in prompt_logprobs.items()}


def run_tp_rank(rank: int, path: str, port: int, prompt: list[int], out_dir: str) -> None:
    """One of two gloo ranks: a prompt with prompt_logprobs in two chunks, next to a plain request."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    config = EngineConfig(
        model=ModelConfig(path=path),
        cache=CacheConfig(block_size=4, num_kv_blocks=32),
        parallel=ParallelConfig(device="cpu", tensor_parallel_size=2, dist_port=port),
    )
    runner = Worker(config, rank=rank)
    try:
        runner.load_model()
        runner.allocate_kv_cache(32)
        scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
        plain = SamplingParams(max_tokens=2, temperature=0.0)
        first = runner.execute(
            StepPlan(
                0,
                [
                    NewRequestData("scored", prompt, len(prompt), scored, [1, 2, 3], 0, 10),
                    NewRequestData("plain", prompt[:6], 6, plain, [10, 11], 0, 6),
                ],
                [],
                [],
            )
        )
        second = runner.execute(
            StepPlan(
                1,
                [],
                [
                    RunningRequestData("scored", [], [4, 5], 10, len(prompt) - 10),
                    RunningRequestData("plain", [5], [], 6, 1),
                ],
                [],
            )
        )  # the same token on both ranks, as the scheduler sends
        torch.save(
            {
                "first": packed(first.prompt_logprobs),
                "second": packed(second.prompt_logprobs),
                "sampled": second.request_ids,
            },
            f"{out_dir}/rank{rank}.pt",
        )
        dist.barrier()  # rank 0 hosts the store: neither rank tears down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_rank_0_returns_the_prompt_logprobs(tiny_checkpoint, tmp_path):
    import torch.multiprocessing as mp

    from tests.helpers.server import free_port

    path, hf_model = tiny_checkpoint("llama-uneven-tp")  # a vocabulary of 321 split 161 + 160 over the ranks
    prompt = random_prompt(hf_model.config.vocab_size, 17, 7)
    mp.start_processes(
        run_tp_rank, args=(str(path), free_port(), prompt, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    rank0, rank1 = (torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2))
    assert rank0["first"] is None and rank0["sampled"] == ["plain", "scored"]  # decode-first
    scored = msgspec.msgpack.decode(rank0["second"]["scored"], type=PromptLogprobs)
    assert_prompt_logprobs_match(scored, prompt, reference_logprobs(hf_model, prompt), 3)
    assert set(rank0["second"]) == {"scored"}
    assert rank1["first"] is None and rank1["second"] is None  # the other rank only joins the LM head's gather


@pytest.mark.slow
def test_smollm2_prompt_logprobs_equal_transformers_chunked():
    """The shipped default model (the GGUF, dequantized), in float32, with its prompt split in chunks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(smollm2_dir())
    hf_model = AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF)
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. Paris is the capital of")["input_ids"]
    engine = Engine(
        ModelConfig(path=path, gguf_file=SMOLLM2_GGUF, dtype="float32", quantization="none"),
        max_num_batched_tokens=6,
        num_blocks=64,
        block_size=16,
    )
    outputs = engine.run(request("r", prompt, 4, max_tokens=2))
    assert_prompt_logprobs_match(outputs["r"][0].prompt_logprobs, prompt, reference_logprobs(hf_model, prompt), 4)
