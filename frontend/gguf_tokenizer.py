"""`python -m tokenmill.frontend.gguf_tokenizer FILE.gguf OUT_DIR`: save a GGUF file's tokenizer as an HF directory.

Run by `frontend/tokenizer.py` in a child process: transformers' GGUF reader imports torch, which the frontend
process must not.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    gguf_path, out_dir = sys.argv[1], sys.argv[2]
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf_path))
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)


if __name__ == "__main__":
    main()
