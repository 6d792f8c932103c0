"""tokenmill: an LLM serving engine in the vLLM mould."""

from pathlib import Path as _Path

from tokenmill._source_tree import install_if_source_checkout as _install_if_source_checkout

_install_if_source_checkout(_Path(__file__).resolve().parent)

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import tokenmill.messages` in every process does not pull in the offline API's dependencies.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams", "LoRARequest"):
        import tokenmill.messages

        return getattr(tokenmill.messages, name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
