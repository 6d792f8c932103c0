"""tokenmill: an LLM serving engine in the vLLM mould."""

__version__ = "0.1.0"
