"""Structured outputs in the scheduler: grammars compiled off the step loop, a matcher per request, one token bitmask
for the whole batch per step.

`GrammarCompiler` builds llguidance matchers on a small thread pool (llguidance drops the GIL while it compiles), so
a request whose grammar is still compiling waits in the queue without holding up the others; compiled grammars are
cached by their text (n choices of a prompt, or many requests with one schema, compile once) and each request gets
its own deep copy. The cache is bounded in bytes (--structured-outputs-cache-bytes): an entry is charged its key (the
constraint as the client sent it, descriptions and all) plus a fixed estimate of the compiled matcher, whose size
the parser limits bound. The tokenizer it needs is loaded on the same pool as soon as the compiler is made.

Nothing the grammar engine raises may end the scheduler: a failed compile or copy is a GrammarError for that request
alone, a matcher that raises while stepping finishes its request with an error, and a bitmask fill that raises is
redone row by row, a failing row allowing every token for that one step (its request then finishes with the error).
A matcher can also fail without raising: past the engine's limits (a regex `c{100000}` constructs too many lexer
expressions once it is walked) it goes into an error state whose mask allows only end of sequence. Such a request
ends with the engine's error once its mask is filled, never with a silent stop; and since llguidance's deep copies
share their lexer's expressions, the compiled grammar it was copied from is dropped from the cache (`forget`), so the
next request with that constraint starts from a fresh compile, not from a matcher someone else broke.

`RequestGrammar` is one request's matcher. It advances with every token the request samples; preemption keeps it
as it is (recompute preemption keeps the sampled tokens, so the matcher's state stays true), and the worker applies
the scheduler's bitmask before sampling, so a sampled token always fits the grammar.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import llguidance
import llguidance.numpy
import msgspec
import numpy as np

from tokenmill.config import ModelConfig
from tokenmill.grammars import GrammarError, grammar_text, parser_limits
from tokenmill.messages import StructuredOutputsParams

log = logging.getLogger("tokenmill.scheduler")

COMPILE_THREADS = 2
CACHE_BYTES = 512 << 20  # vLLM's default for its grammar cache
# what a compiled matcher is charged beyond its key: its grammar is bounded by PARSER_LIMITS' max_grammar_size, and
# a few hundred kB covers the largest measured
COMPILED_ENTRY_BYTES = 256 << 10
ALL_TOKENS = -1  # an int32 bitmask word with every bit set


def grammar_tokenizer(model: ModelConfig, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the served model's tokenizer (loaded as the frontend loads it), over the model's whole
    vocabulary (`vocab_size`, the logits' width: ids the tokenizer lacks are never allowed)."""
    from llguidance.hf import from_tokenizer

    from tokenmill.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    return from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=list(eos_token_ids) or None)


class GrammarCompiler:
    def __init__(
        self,
        load_tokenizer: Callable[[], llguidance.LLTokenizer],
        *,
        threads: int = COMPILE_THREADS,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._tokenizer: Future[llguidance.LLTokenizer] = self._pool.submit(load_tokenizer)
        self._cache: OrderedDict[bytes, Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0  # what the entries in the cache are charged
        self._executor = llguidance.LLExecutor(threads)
        self.mask_time_s = 0.0  # spent filling bitmasks since the last `take_mask_time`

    def wait_for_tokenizer(self) -> None:
        """Block until the tokenizer has loaded (or failed: each constraint then fails when compiled, as before). Its
        build holds the GIL in long stretches (the default model's 49k vocabulary: stalls of any other thread of up to
        0.58 s, 1.3 s in all, measured on a loaded machine), so the scheduler waits for it before it takes requests,
        rather than letting it stall every running request's steps."""
        wait([self._tokenizer])

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
        if entry_bytes(key) <= self._cache_bytes:  # one larger than the whole cache is compiled, never kept
            self._cache[key] = future
            self.cached_bytes += entry_bytes(key)
            while self.cached_bytes > self._cache_bytes:
                evicted, _ = self._cache.popitem(last=False)
                self.cached_bytes -= entry_bytes(evicted)
        return future

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(params)
            matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0, limits=parser_limits())
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            self._first_mask(matcher)
        except GrammarError:
            raise
        except Exception as exc:  # whatever the engine raises is this constraint's failure, not the scheduler's
            raise GrammarError(f"the grammar engine failed: {exc}") from None
        return matcher

    def _first_mask(self, matcher: llguidance.LLMatcher) -> None:
        """The compiled grammar's first mask, computed here on the compile thread: the lexer states it builds are
        shared by every copy, so the requests' first masks on the scheduler's loop become cheap (a schema of 200
        properties: ~35 ms here, ~0.1 ms there), and a grammar the engine fails on at once is refused before it
        runs (a GrammarError for the request, not an error after it started)."""
        scratch = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, scratch, 0)
        if matcher.is_error():
            raise GrammarError(engine_error(matcher))

    def fill_bitmask(self, grammars: Sequence[RequestGrammar]) -> np.ndarray:
        """[len(grammars), ceil(vocab / 32)] int32: bit t of row i set when grammar i allows token t next."""
        started = time.perf_counter()
        bitmask = llguidance.numpy.allocate_token_bitmask(len(grammars), self.vocab_size)
        try:
            if len(grammars) == 1:  # on this thread: the pool's hand-off costs more than one mask (~0.04 ms)
                llguidance.numpy.fill_next_token_bitmask(grammars[0].started_matcher, bitmask, 0)
            else:
                llguidance.numpy.fill_next_token_bitmask_par(
                    self._executor, [(g.started_matcher, i) for i, g in enumerate(grammars)], bitmask
                )
        except Exception:
            log.exception("filling the structured-output bitmask failed; filling it row by row")
            for i, grammar in enumerate(grammars):
                grammar.fill_row(bitmask, i)
        for grammar in grammars:
            grammar.check_engine_state()
        self.mask_time_s += time.perf_counter() - started
        return bitmask

    def forget(self, grammar: RequestGrammar) -> None:
        """Drop the cache entry `grammar` was copied from (its matcher failed: the shared state may be broken)."""
        for key, future in list(self._cache.items()):
            if future is grammar.compiled_future:
                del self._cache[key]
                self.cached_bytes -= entry_bytes(key)

    def take_mask_time(self) -> float:
        spent, self.mask_time_s = self.mask_time_s, 0.0
        return spent

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def engine_error(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error, without the marker llguidance appends when verbose errors are off."""
    return str(matcher.get_error()).replace("<non-verbose/>", "").strip()


def entry_bytes(key: bytes) -> int:
    """What one cached grammar is charged: its key and the compiled matcher's estimate."""
    return len(key) + COMPILED_ENTRY_BYTES


class RequestGrammar:
    """One request's constraint: waiting for its compiled grammar, then a matcher that follows its output."""

    __slots__ = ("_compiled", "matcher", "_begin_after", "active", "error", "_stopped")

    def __init__(self, compiled: Future[llguidance.LLMatcher], begin_after_token_ids: list[int] | None) -> None:
        self._compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None
        self._begin_after = list(begin_after_token_ids or [])
        self.active = not self._begin_after  # constraining now (else: once the output holds `begin_after`)
        self.error: str | None = None  # the grammar engine raised while masking: the request ends with this
        self._stopped = False  # the matcher allowed nothing more after the last accepted token

    @property
    def compiled(self) -> bool:
        return self._compiled.done()

    @property
    def compiled_future(self) -> Future[llguidance.LLMatcher]:
        return self._compiled

    def start(self) -> None:
        """Take a private copy of the compiled matcher (once it is compiled). Raises GrammarError."""
        if self.matcher is None:
            try:
                self.matcher = self._compiled.result().deep_copy()
            except GrammarError:
                raise
            except Exception as exc:
                raise GrammarError(f"the grammar engine failed: {exc}") from None

    @property
    def started_matcher(self) -> llguidance.LLMatcher:
        """The request's matcher; only a started grammar (`start`) is masked or advanced."""
        if self.matcher is None:
            raise RuntimeError("the grammar is used before start()")
        return self.matcher

    def fill_row(self, bitmask: np.ndarray, row: int) -> None:
        """Row `row` of the bitmask from this matcher alone; if the engine raises, every token for this step, and
        the request ends with the error when its token comes back."""
        try:
            llguidance.numpy.fill_next_token_bitmask(self.started_matcher, bitmask, row)
        except Exception as exc:
            self.error = f"the grammar engine failed: {exc}"
            bitmask[row] = ALL_TOKENS

    def check_engine_state(self) -> None:
        """After its mask is filled: a matcher the engine put into its error state (a limit hit while masking)
        allowed only end of sequence; the request ends with the engine's error when its token comes back."""
        if self.error is None and self.started_matcher.is_error():
            self.error = f"the grammar engine failed: {engine_error(self.started_matcher)}"

    def accept(self, token_id: int, output_token_ids: Sequence[int]) -> str | None:
        """Advance past a sampled token (already appended to `output_token_ids`); the error, if it does not fit or
        the grammar engine failed."""
        if self.error is not None:
            return self.error
        if not self.active:
            n = len(self._begin_after)
            self.active = len(output_token_ids) >= n and list(output_token_ids[-n:]) == self._begin_after
            return None
        try:
            if not self.started_matcher.consume_token(token_id):
                # the mask allowed it: the engine's own error says why (e.g. a limit hit while advancing)
                reason = engine_error(self.started_matcher)
                if reason:
                    return f"the structured-output grammar is beyond the grammar engine's limits: {reason}"
                return f"the sampled token {token_id} does not fit the structured-output grammar"
            self._stopped = self.started_matcher.is_stopped()
        except Exception as exc:
            self.error = f"the grammar engine failed: {exc}"
            return self.error
        return None

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (only end of sequence)."""
        return self.active and self._stopped
