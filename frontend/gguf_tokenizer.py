"""`python -m tokenmill.frontend.gguf_tokenizer FILE.gguf OUT_DIR`: save a GGUF file's tokenizer as an HF directory,
and its model config in OUT_DIR/config.

Run by `frontend/tokenizer.py` in a child process: transformers' GGUF reader imports torch, which the frontend
process must not.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    gguf_path, out_dir = sys.argv[1], sys.argv[2]
    from transformers import AutoConfig, AutoTokenizer

    from tokenmill.gguf_conversion import CONFIG_FOLDER

    directory, name = os.path.split(os.path.abspath(gguf_path))
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)
    AutoConfig.from_pretrained(directory, gguf_file=name).save_pretrained(os.path.join(out_dir, CONFIG_FOLDER))


if __name__ == "__main__":
    main()
