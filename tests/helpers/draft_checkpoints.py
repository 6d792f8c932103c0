"""Draft models for draft-model speculative decoding: a checkpoint made of another checkpoint's first layers.

`write_first_layers_checkpoint` keeps the embeddings, the first N decoder layers, the final norm and the LM head of
any checkpoint tokenmill loads (the default model's GGUF weights dequantized to float32), and saves them as a float32
safetensors checkpoint with the source's tokenizer: a draft with the target's vocabulary by construction.
    python -m tests.helpers.draft_checkpoints OUT_DIR [--layers N]   (the default model's first N layers)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def write_first_layers_checkpoint(model_cfg, num_layers: int, out_dir: Path, tokenizer=None) -> Path:
    """Save the first `num_layers` layers of `model_cfg`'s checkpoint (a tokenmill ModelConfig) into out_dir."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.config import replace
    from tokenmill.workers.model_loader import iter_weights, load_hf_config

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    hf_config = load_hf_config(model_cfg)
    if not 1 <= num_layers <= hf_config.num_hidden_layers:
        raise ValueError(f"num_layers must be from 1 to {hf_config.num_hidden_layers}, got {num_layers}")
    tensors = {}
    for name, tensor in iter_weights(replace(model_cfg, quantization="none"), "cpu"):
        layer = _LAYER.search(name)
        if layer is None or int(layer.group(1)) < num_layers:
            tensors[name] = tensor.to(torch.float32).contiguous()
    hf_config.num_hidden_layers = num_layers
    hf_config.dtype = "float32"
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_cfg.path, gguf_file=model_cfg.gguf_file)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir
    from tokenmill.config import ModelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    source = ModelConfig(path=str(smollm2_dir()), gguf_file=SMOLLM2_GGUF, quantization="none")
    print(write_first_layers_checkpoint(source, args.layers, args.out_dir))


if __name__ == "__main__":
    main()
