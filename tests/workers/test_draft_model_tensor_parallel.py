"""Draft-model speculative decoding under tensor parallelism on CPU: two gloo ranks, the target and its draft both
sharded over them. Rank 0 runs the real Scheduler and hands each plan (through the msgpack codec) to rank 1 as the
worker process's PUB socket would; both ranks execute it, rank 0 verifies and broadcasts the accepted tokens, and
both ranks' sharded drafts propose. Greedy outputs are token-identical to one rank without speculation.

Pipeline parallelism with a draft model, and a draft whose heads or MLP do not split over the ranks, are refused with
errors naming speculative_config."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.draft_checkpoints import write_first_layers_checkpoint
from tests.helpers.server import free_port
from tests.helpers.spec_decode_runs import RUNNER_BLOCKS, generate, requests
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from tokenmill.messages import StepPlan, WorkerCommand, decoder, encode
from tokenmill.model_source import ModelSourceError, resolve_config
from tokenmill.speculative import parse_speculative_config
from tokenmill.workers.draft_proposer import DraftModel
from tokenmill.workers.worker import Worker

_plans = decoder(WorkerCommand)


class PlanPublisher:
    """Rank 0's runner as `generate` drives it: each plan goes to rank 1 (over gloo) before rank 0 executes it."""

    def __init__(self, runner: Worker) -> None:
        self.runner = runner
        self.eos_token_ids = runner.eos_token_ids

    def execute(self, plan: StepPlan):
        dist.broadcast_object_list([encode(plan)], src=0)
        return self.runner.execute(plan)

    def stop(self) -> None:
        dist.broadcast_object_list([None], src=0)


def follow_plans(runner: Worker) -> None:
    """Rank 1: execute rank 0's plans until it stops; its results are dropped, as the worker process drops them."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return
        plan = _plans.decode(message[0])
        assert isinstance(plan, StepPlan)
        assert runner.execute(plan).request_ids == []


def tp_draft_runner(rank: int, target: str, draft: str, k: int, port: int) -> tuple[Worker, SpeculativeConfig]:
    speculative = parse_speculative_config({"method": "draft_model", "model": draft, "num_speculative_tokens": k})
    runner = Worker(
        EngineConfig(
            model=ModelConfig(path=target, dtype="float32"),
            speculative=speculative,
            cache=CacheConfig(block_size=16, num_kv_blocks=RUNNER_BLOCKS),
            parallel=ParallelConfig(device="cpu", tensor_parallel_size=2, dist_port=port),
        ),
        rank=rank,
    )
    runner.load_model()
    runner.allocate_kv_cache(runner.num_kv_blocks_for_budget())
    return runner, speculative


# (draft, k, requests' max_tokens, seeded third request, blocks the scheduler hands out, token budget per step)
RUNS = {"self": ("target", 4, 30, False, 32, 24), "first-layer": ("first_layer", 3, 40, True, 9, 32)}


def run_rank(rank: int, checkpoints: dict[str, str], port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    results = {}
    try:
        for name, (draft, k, max_tokens, seeded, num_blocks, budget) in RUNS.items():
            runner, speculative = tp_draft_runner(rank, checkpoints["target"], checkpoints[draft], k, port)
            results[name] = {"kv_block_bytes": (runner._target_kv_block_bytes(), runner.draft.kv_block_bytes())}
            if rank != 0:
                follow_plans(runner)
                continue
            publisher = PlanPublisher(runner)
            for tag, config in (("plain", SpeculativeConfig()), ("spec", speculative)):
                outputs, scheduler = generate(
                    publisher, config, requests(max_tokens, seeded), num_blocks=num_blocks, budget=budget, tag=tag
                )
                stats = scheduler.stats()
                results[name][tag] = (
                    outputs,
                    scheduler._next_step_id,
                    stats.spec_num_draft_tokens,
                    stats.spec_num_accepted_tokens,
                    list(stats.spec_accepted_per_pos),
                    stats.num_preemptions,
                )
            publisher.stop()
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # rank 0 hosts the store: neither rank tears down while the other still uses it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from tests.helpers.checkpoints import build_tiny_checkpoint, smollm2_tokenizer

    root = tmp_path_factory.mktemp("draft-tp")
    tokenizer = smollm2_tokenizer()
    target = build_tiny_checkpoint("llama", root, tokenizer)  # 4 query heads over 2 KV heads: one KV head per rank
    first_layer = write_first_layers_checkpoint(ModelConfig(path=str(target)), 1, root / "llama-first-layer", tokenizer)
    return {"target": str(target), "first_layer": str(first_layer)}


def single_rank_plain(target: str, max_tokens: int, seeded: bool, num_blocks: int, budget: int) -> dict:
    runner = Worker(
        EngineConfig(
            model=ModelConfig(path=target, dtype="float32"),
            cache=CacheConfig(block_size=16, num_kv_blocks=RUNNER_BLOCKS),
            parallel=ParallelConfig(device="cpu"),
        )
    )
    runner.load_model()
    runner.allocate_kv_cache(RUNNER_BLOCKS)
    outputs, _ = generate(
        runner, SpeculativeConfig(), requests(max_tokens, seeded), num_blocks=num_blocks, budget=budget, tag="tp1"
    )
    return outputs


def test_sharded_draft_on_two_ranks_matches_one_rank_without_speculation(checkpoints, tmp_path):
    mp.start_processes(run_rank, args=(checkpoints, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]

    # per rank one of the 2 KV heads (16 dims), K and V, float32, 16-token blocks: the target's 2 layers, the draft's
    per_layer = 2 * 16 * 1 * 16 * 4
    for result in ranks:
        assert result["self"]["kv_block_bytes"] == (2 * per_layer, 2 * per_layer)
        assert result["first-layer"]["kv_block_bytes"] == (2 * per_layer, per_layer)

    for name, (_, k, max_tokens, seeded, num_blocks, budget) in RUNS.items():
        plain, plain_steps, *_ = ranks[0][name]["plain"]
        spec, spec_steps, draft_tokens, accepted, accepted_per_pos, preemptions = ranks[0][name]["spec"]
        assert spec == plain, name  # the seeded request too: verification keeps the distribution exactly
        assert all(len(tokens) == max_tokens for tokens in spec.values())
        one_rank = single_rank_plain(checkpoints["target"], max_tokens, seeded, num_blocks, budget)
        greedy = ["a", "b"] if seeded else ["a", "b", "c"]
        assert {r: spec[r] for r in greedy} == {r: one_rank[r] for r in greedy}, name
        if name == "self":  # every rank proposed what the target then computed: whole drafts accepted
            assert draft_tokens > 0 and accepted >= 0.9 * draft_tokens  # rounding may flip a near tie
            assert accepted_per_pos[k - 1] > 0
            assert spec_steps < plain_steps
        else:
            assert 0 < accepted < draft_tokens
            assert preemptions > 0


@pytest.mark.slow
def test_llm_with_two_ranks_and_a_draft_model_matches_one_rank(checkpoints):
    """Through the real processes (scheduler, two worker ranks): the target as its own draft, every draft accepted."""
    from tokenmill import LLM
    from tokenmill.messages import SamplingParams

    prompts = [request.prompt_token_ids for _, request in requests(24, False)]
    speculative = {"method": "draft_model", "model": checkpoints["target"], "num_speculative_tokens": 4}
    with LLM(
        checkpoints["target"],
        dtype="float32",
        tensor_parallel_size=2,
        kv_cache_memory_bytes=16 << 20,
        speculative_config=speculative,
    ) as llm:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine_stats()
    one_rank = single_rank_plain(checkpoints["target"], 24, False, RUNNER_BLOCKS, 512)
    assert outputs == [one_rank[name] for name in ("a", "b", "c")]
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens


def test_pipeline_parallel_draft_model_is_refused(checkpoints):
    """Refused before anything loads (the vocabulary given, 0, is never compared)."""
    speculative = parse_speculative_config(
        {"method": "draft_model", "model": checkpoints["first_layer"], "num_speculative_tokens": 2}
    )
    config = EngineConfig(
        model=ModelConfig(path=checkpoints["target"], dtype="float32"),
        speculative=speculative,
        parallel=ParallelConfig(device="cpu", pipeline_parallel_size=2),
    )
    with pytest.raises(
        ValueError, match="speculative_config: method 'draft_model' does not support pipeline parallelism"
    ):
        DraftModel(config, torch.device("cpu"), torch.float32, torch.float32, 1024, 0, checkpoints["target"])
    # and before any process starts, when the config is resolved (what `tokenmill serve` and LLM() do first)
    with pytest.raises(ModelSourceError, match="does not support pipeline parallelism"):
        resolve_config(config)


def test_draft_that_does_not_split_over_the_ranks_is_refused(checkpoints, tmp_path):
    from tokenmill.workers.models.layers import TensorParallel

    odd = tmp_path / "odd-mlp"
    shutil.copytree(checkpoints["first_layer"], odd)
    config_file = odd / "config.json"
    hf_config = json.loads(config_file.read_text())
    hf_config["intermediate_size"] = 127
    config_file.write_text(json.dumps(hf_config))
    speculative = parse_speculative_config({"method": "draft_model", "model": str(odd), "num_speculative_tokens": 2})
    config = EngineConfig(
        model=ModelConfig(path=checkpoints["target"], dtype="float32"),
        speculative=speculative,
        parallel=ParallelConfig(device="cpu", tensor_parallel_size=2),
    )
    with pytest.raises(
        ValueError,
        match="speculative_config: the draft model .* cannot be split over "
        "tensor_parallel_size=2: intermediate_size=127 is not divisible",
    ):
        DraftModel(
            config,
            torch.device("cpu"),
            torch.float32,
            torch.float32,
            1024,
            hf_config["vocab_size"],
            checkpoints["target"],
            TensorParallel(0, 2),
        )
