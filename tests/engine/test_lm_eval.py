"""The lm-evaluation-harness against a live server: `local-completions` scores multiple-choice answers through
`/v1/completions` with `echo` and `logprobs` (prompt logprobs), and runs a `generate_until` task. Each choice's
loglikelihood must equal transformers' on the same weights (float32), with prompts split by chunked prefill and the
prefix cache on. The tasks and their data are local files; nothing reaches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
from tests.helpers.reference import NEAR_TIE_MARGIN, hf_greedy_reference
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3
MAX_GEN_TOKS = 8
MULTIPLE_CHOICE = [
    {
        "question": "Question: Which city is the capital of France, famous for the Eiffel Tower?\nAnswer:",
        "choices": ["Paris", "London", "Berlin"],
        "answer": 0,
    },
    {
        "question": "Question: How many legs does a spider have? Count them carefully, one by one.\nAnswer:",
        "choices": ["eight", "six", "four"],
        "answer": 0,
    },
    {
        "question": "Question: Snow and ice are the opposite of fire, because fire is hot and snow is\nAnswer:",
        "choices": ["cold", "warm and sunny"],
        "answer": 0,
    },
]
GENERATION = [
    {"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
    {"question": "Q: What colour is the sky on a clear day?\nA:", "answer": " Blue"},
]


def task_yaml(name: str, data: Path, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f'test_split: test\ndoc_to_text: "{{{{question}}}}"\n{body}'
    )


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, docs in [("mc", MULTIPLE_CHOICE), ("gen", GENERATION)]:
        (root / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (root / "tm_mc.yaml").write_text(
        task_yaml(
            "tm_mc",
            root / "mc.jsonl",
            (
                'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
                "metric_list:\n  - metric: acc\n"
            ),
        )
    )
    (root / "tm_gen.yaml").write_text(
        task_yaml(
            "tm_gen",
            root / "gen.jsonl",
            (
                'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
                f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n'
                "metric_list:\n  - metric: exact_match\n"
            ),
        )
    )
    return root


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The GGUF's tokenizer as a local HF directory, for lm-eval's huggingface tokenizer backend."""
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    subprocess.run(
        [sys.executable, "-m", "tokenmill.frontend.gguf_tokenizer", str(smollm2_dir() / SMOLLM2_GGUF), str(out)],
        check=True,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def samples(tasks_dir, tokenizer_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """lm-eval's logged samples per task, from one run against a live float32 server (prompts chunked by 16)."""
    out = tmp_path_factory.mktemp("lm-eval-out")
    with Server(
        str(smollm2_dir() / SMOLLM2_GGUF),
        "--served-model-name",
        "m",
        "--dtype",
        "float32",
        "-q",
        "none",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "16",
        "--kv-cache-memory-bytes",
        "64MiB",
        log_path=out / "server.log",
    ) as server:
        model_args = (
            f"model=m,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1,max_length=512"
        )
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "lm_eval",
                "run",
                "--model",
                "local-completions",
                "--model_args",
                model_args,
                "--tasks",
                "tm_mc",
                "tm_gen",
                "--include_path",
                str(tasks_dir),
                "--output_path",
                str(out / "results"),
                "--log_samples",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {}
    for task in ("tm_mc", "tm_gen"):
        (path,) = (out / "results").rglob(f"samples_{task}_*.jsonl")
        found[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


@pytest.fixture(scope="module")
def reference(tokenizer_dir):
    """transformers' float32 SmolLM2 from the same GGUF, and the tokenizer lm-eval loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tokenizer_dir)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal `_encode_pair`: trailing spaces move to the continuation; the whole is encoded, then split."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids) :]


@torch.no_grad()
def reference_loglikelihood(model, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool | None]:
    """The continuation's summed logprob, and whether greedy decoding would produce it (None on a near tie)."""
    ids = context_ids + continuation_ids
    logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    total, greedy = 0.0, True
    for position in range(len(context_ids), len(ids)):
        row = logprobs[position - 1]
        token_logprob = float(row[ids[position]])
        total += token_logprob
        best, second = row.topk(2).values.tolist()
        if abs(token_logprob - best) < NEAR_TIE_MARGIN and best - second < NEAR_TIE_MARGIN:
            greedy = None if greedy is not False else False
        elif token_logprob < best:
            greedy = False
    return total, greedy


def test_multiple_choice_loglikelihoods_equal_transformers(samples, reference):
    model, tokenizer = reference
    docs = samples["tm_mc"]
    assert sorted(doc["doc_id"] for doc in docs) == list(range(len(MULTIPLE_CHOICE)))
    compared = 0
    for doc in docs:
        arguments = doc["arguments"]
        assert len(arguments) == len(MULTIPLE_CHOICE[doc["doc_id"]]["choices"]) == len(doc["resps"])
        for i, ((loglikelihood, is_greedy),) in enumerate(doc["resps"]):
            args = arguments[f"gen_args_{i}"]
            context_ids, continuation_ids = encode_pair(tokenizer, args["arg_0"], args["arg_1"])
            assert len(context_ids) > 16  # the server's 16-token budget split these prompts
            expected, expected_greedy = reference_loglikelihood(model, context_ids, continuation_ids)
            assert abs(float(loglikelihood) - expected) < TOLERANCE, (doc["doc_id"], i, loglikelihood, expected)
            if expected_greedy is not None:
                assert (is_greedy in (True, "True")) == expected_greedy, (doc["doc_id"], i)
            compared += 1
    assert compared == sum(len(doc["choices"]) for doc in MULTIPLE_CHOICE)


def test_generate_until_matches_transformers_greedy(samples, reference):
    model, tokenizer = reference
    docs = samples["tm_gen"]
    assert sorted(doc["doc_id"] for doc in docs) == list(range(len(GENERATION)))
    for doc in docs:
        (response,) = doc["resps"][0]
        prompt_ids = tokenizer(GENERATION[doc["doc_id"]]["question"], add_special_tokens=False).input_ids
        steps = hf_greedy_reference(model, prompt_ids, MAX_GEN_TOKS)
        ties = [i for i, (_, margin) in enumerate(steps) if margin < NEAR_TIE_MARGIN]
        trusted = [token for token, _ in steps[: ties[0] if ties else len(steps)]]
        expected = tokenizer.decode(trusted, skip_special_tokens=True)
        cut = [expected.index(stop) for stop in ("\n", tokenizer.eos_token) if stop in expected]
        if cut:  # lm-eval stops at "\n" (and the EOS text)
            assert response == expected[: min(cut)]
        else:
            assert response.startswith(expected) and expected, (response, expected)
