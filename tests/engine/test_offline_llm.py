"""The offline `LLM` under careless use: more prompts than the waiting queue holds, a script without a main guard,
seeded sampling under load and preemption, and the model's generation-config defaults."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.model_source import generation_defaults

SMALL = dict(max_model_len=256, kv_cache_memory_bytes=16 << 20)


@pytest.fixture
def tiny_llama(tiny_checkpoints) -> str:
    return str(tiny_checkpoints("llama"))


@pytest.mark.slow
def test_more_prompts_than_max_waiting_requests(tiny_llama):
    prompts = [f"Prompt number {i}:" for i in range(23)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=2)
    with LLM(tiny_llama, max_waiting_requests=4, max_num_seqs=2, **SMALL) as llm:
        results = llm.generate(prompts, params, use_tqdm=False)
        alone = llm.generate(prompts[17], params, use_tqdm=False)[0]
    assert [r.prompt for r in results] == prompts
    assert all(len(o.token_ids) == 3 for r in results for o in r.outputs)
    assert [o.token_ids for o in results[17].outputs] == [o.token_ids for o in alone.outputs]

    with LLM(tiny_llama, task="embed", max_waiting_requests=3, **SMALL) as llm:
        embedded = llm.embed(prompts, use_tqdm=False)
    assert [e.prompt for e in embedded] == prompts and all(len(e.outputs.embedding) == 64 for e in embedded)


@pytest.mark.slow
def test_a_script_without_a_main_guard_runs(tiny_llama, tmp_path):
    # multiprocessing's spawn would re-run this script in every engine process (which then dies starting its own)
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from tokenmill import LLM, SamplingParams

        print("script ran", flush=True)
        llm = LLM(sys.argv[1], max_model_len=256, kv_cache_memory_bytes=16 << 20)
        out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        print("tokens", len(out[0].outputs[0].token_ids))
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script), tiny_llama], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["script ran", "tokens 4"]


@pytest.mark.slow
def test_seeded_sampling_is_the_same_alone_and_when_preempted_under_load(tiny_llama):
    prompts = ["Once upon a time", "The weather today", "In a galaxy far away", "My favourite food is"]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, top_k=200, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    # each request needs 3 blocks of 16 at most: alone it fits the 6 blocks, four at once do not
    with LLM(tiny_llama, num_kv_blocks=6, block_size=16, enable_prefix_caching=False, **SMALL) as llm:
        preemptions = []
        llm.step_listener = lambda step: preemptions.append(step.stats.num_preemptions if step.stats else 0)
        alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        assert sum(preemptions) == 0
        loaded = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(preemptions) > 0, "the test must preempt"
    assert loaded == alone
    assert all(len(set(tokens)) > 10 for tokens in alone)  # they really sample


def test_generation_config_defaults_are_read_as_vllm_does(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 7,
                "do_sample": True,
                "bos_token_id": 1,
            }
        )
    )
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 7}
    assert generation_defaults(tmp_path, None, "auto") == expected
    assert generation_defaults(tmp_path / "elsewhere", None, str(tmp_path)) == expected  # a folder
    assert generation_defaults(tmp_path, None, "vllm") == {}
    assert generation_defaults(tmp_path, "model.gguf", "auto") == {}  # GGUF metadata has none
    assert generation_defaults(tmp_path / "none", None, "auto") == {}
    # values equal to transformers' own defaults are no defaults (vLLM reads the config's diff dict)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_k": 50, "top_p": 0.95}))
    assert generation_defaults(tmp_path, None, "auto") == {"top_p": 0.95}


@pytest.mark.slow
def test_llm_applies_the_generation_config_unless_told_vllm(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    prompt = "The generation config says"
    with LLM(str(model), **SMALL) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        defaulted = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
        greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert defaulted.token_ids == greedy.token_ids and len(defaulted.token_ids) == 5
    with LLM(str(model), generation_config="vllm", **SMALL) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
