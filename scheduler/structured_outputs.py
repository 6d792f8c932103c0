"""Structured outputs in the scheduler: grammars compiled off the step loop, a matcher per request, one token bitmask
for the whole batch per step.

`GrammarCompiler` builds llguidance matchers on a small thread pool (llguidance drops the GIL while it compiles), so
a request whose grammar is still compiling waits in the queue without holding up the others; compiled grammars are
cached by their text (n choices of a prompt, or many requests with one schema, compile once) and each request gets
its own deep copy. The tokenizer it needs is loaded on the same pool as soon as the compiler is made.

`RequestGrammar` is one request's matcher. It advances with every token the request samples; preemption keeps it
as it is (recompute preemption keeps the sampled tokens, so the matcher's state stays true), and the worker applies
the scheduler's bitmask before sampling, so a sampled token always fits the grammar.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import msgspec
import numpy as np

from tokenmill.config import ModelConfig
from tokenmill.grammars import GrammarError, grammar_text, parser_limits
from tokenmill.messages import StructuredOutputsParams

log = logging.getLogger("tokenmill.scheduler")

COMPILE_THREADS = 2
CACHE_SIZE = 256  # compiled grammars kept (a few hundred kB each at most)


def grammar_tokenizer(model: ModelConfig, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the served model's tokenizer (loaded as the frontend loads it), over the model's whole
    vocabulary (`vocab_size`, the logits' width: ids the tokenizer lacks are never allowed)."""
    from llguidance.hf import from_tokenizer

    from tokenmill.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    return from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                          eos_token=list(eos_token_ids) or None)


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], llguidance.LLTokenizer], *, threads: int = COMPILE_THREADS,
                 cache_size: int = CACHE_SIZE) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._tokenizer: Future[llguidance.LLTokenizer] = self._pool.submit(load_tokenizer)
        self._cache: OrderedDict[bytes, Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self._executor = llguidance.LLExecutor(threads)
        self.mask_time_s = 0.0  # spent filling bitmasks since the last `take_mask_time`

    @property
    def vocab_size(self) -> int:
        vocab_size: int = self._tokenizer.result().vocab_size
        return vocab_size

    def compile(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """A future of the compiled matcher for `params` (shared: callers deep-copy it); its exception is a
        GrammarError when the constraint does not compile."""
        key = msgspec.msgpack.encode(msgspec.structs.replace(params, begin_after_token_ids=None))
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._build, params)
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = grammar_text(params)
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def fill_bitmask(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), ceil(vocab / 32)] int32: bit t of row i set when matcher i allows token t next."""
        started = time.perf_counter()
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        self.mask_time_s += time.perf_counter() - started
        return bitmask

    def take_mask_time(self) -> float:
        spent, self.mask_time_s = self.mask_time_s, 0.0
        return spent

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's constraint: waiting for its compiled grammar, then a matcher that follows its output."""

    __slots__ = ("_compiled", "matcher", "_begin_after", "active")

    def __init__(self, compiled: Future[llguidance.LLMatcher], begin_after_token_ids: list[int] | None) -> None:
        self._compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None
        self._begin_after = list(begin_after_token_ids or [])
        self.active = not self._begin_after  # constraining now (else: once the output holds `begin_after`)

    @property
    def compiled(self) -> bool:
        return self._compiled.done()

    def start(self) -> None:
        """Take a private copy of the compiled matcher (once it is compiled). Raises GrammarError."""
        if self.matcher is None:
            self.matcher = self._compiled.result().deep_copy()

    def accept(self, token_id: int, output_token_ids: Sequence[int]) -> str | None:
        """Advance past a sampled token (already appended to `output_token_ids`); the error, if it does not fit."""
        if not self.active:
            n = len(self._begin_after)
            self.active = len(output_token_ids) >= n and list(output_token_ids[-n:]) == self._begin_after
            return None
        assert self.matcher is not None, "start() first"
        if not self.matcher.consume_token(token_id):
            return f"the sampled token {token_id} does not fit the structured-output grammar"
        return None

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (only end of sequence)."""
        return self.active and self.matcher is not None and self.matcher.is_stopped()
