"""An offline `LLM` lets its engine processes go when it is deleted or goes out of scope, not at interpreter exit."""

from __future__ import annotations

import gc
import time

import pytest

from tests.helpers.server import alive
from tokenmill import LLM, SamplingParams

SMALL = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def engine_pids(llm: LLM) -> list[int]:
    return [child.pid for _, child in llm.processes.children]


def left_alive(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The pids still alive after waiting up to `within_s` for them to go."""
    deadline = time.monotonic() + within_s
    while (living := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return living


def generate_in_a_function(model: str, pids: list[int]) -> list[int]:
    """Use an LLM that goes out of scope when this returns (its pids reported through `pids`)."""
    llm = LLM(model, **SMALL)
    pids.extend(engine_pids(llm))
    return llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
def test_deleted_or_out_of_scope_llm_leaves_no_process(tiny_checkpoints):
    model = str(tiny_checkpoints("llama"))
    llm = LLM(model, **SMALL)
    pids = engine_pids(llm)
    assert len(pids) >= 2 and all(alive(pid) for pid in pids)  # a scheduler and a worker
    first = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    del llm
    gc.collect()
    assert left_alive(pids) == []

    scoped: list[int] = []
    assert generate_in_a_function(model, scoped) == first
    gc.collect()
    assert len(scoped) >= 2 and left_alive(scoped) == []


@pytest.mark.slow
def test_with_block_and_explicit_shutdown_stop_the_processes(tiny_checkpoints):
    with LLM(str(tiny_checkpoints("llama")), **SMALL) as llm:
        pids = engine_pids(llm)
        llm.generate("Hello", GREEDY, use_tqdm=False)
    assert left_alive(pids) == []
    llm.shutdown()  # idempotent after the with block
