"""The worker's malloc settings: a sampling step with logit_bias faults no pages in once warm."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys

import pytest

from tokenmill.workers import process

# Runs in a fresh interpreter: mallopt changes the whole process, and the faults counted must be the sampler's.
_FAULTS_PER_STEP = """
import resource, sys, torch
torch.set_num_threads(1)
from tokenmill.messages import SamplingParams
from tokenmill.workers.heap_tuning import keep_step_temporaries_on_heap
from tokenmill.workers.sampler import RequestSamplingState, sample

tuned = keep_step_temporaries_on_heap() if sys.argv[1] == "tuned" else False
bias = {1000 + i: 0.5 for i in range(1024)}
states = [RequestSamplingState(SamplingParams(temperature=0.0), [1, 2], [2], "cpu")] + [
    RequestSamplingState(SamplingParams(temperature=1.0, logit_bias=bias), [1, 2], [2], "cpu") for _ in range(2)
]
logits = torch.randn(3, 49152)
for _ in range(5):
    sample(logits, states)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    sample(logits, states)
print(tuned, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40)
"""


def faults_per_step(mode: str) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_STEP, mode], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_sampling_steps_reuse_heap_pages_once_tuned() -> None:
    # untuned, glibc trims the freed top of the heap after each step and the next step faults it in again
    tuned, faults = faults_per_step("tuned")
    assert tuned
    assert faults < 0.5, f"{faults} page faults per sampling step"


def test_the_worker_tunes_its_heap_before_loading() -> None:
    source = inspect.getsource(process.serve_worker)
    calls = [
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        if isinstance(node.func, ast.Name)
    ]
    assert "keep_step_temporaries_on_heap" in calls
    assert source.index("keep_step_temporaries_on_heap()") < source.index("make_worker(")
