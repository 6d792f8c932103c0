"""Our top-level `kernels` package shares its import name with Hugging Face's `kernels`; transformers must not care."""

from __future__ import annotations

import subprocess
import sys


def test_transformers_does_not_mistake_our_kernels_for_hub_kernels(tiny_checkpoints):
    path = tiny_checkpoints("llama")
    code = f"""
import kernels, torch
assert kernels.__file__.endswith("kernels/__init__.py"), kernels.__file__
from transformers.utils import import_utils
assert not import_utils.is_kernels_available()
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(path)!r}, dtype=torch.float32)
out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
assert out.shape == (1, 5)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
