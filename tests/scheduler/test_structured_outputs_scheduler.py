"""Structured outputs in the scheduler: real llguidance matchers over the default model's tokenizer, a fake worker
that samples at random among the tokens the plan's bitmask allows (as the real sampler does after masking)."""

from __future__ import annotations

import json
import random
import threading

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest
from llguidance.hf import from_tokenizer

from tests.helpers.sched_testing import FakeWorker, drive, make_config, make_request, run_to_completion, step
from tokenmill.messages import StepPlan, StepResult, StructuredOutputsParams
from tokenmill.scheduler import structured_outputs
from tokenmill.scheduler.scheduler import Scheduler
from tokenmill.scheduler.structured_outputs import COMPILED_ENTRY_BYTES, GrammarCompiler, entry_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}
UNCONSTRAINED_TOKEN = 7


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id)


class MaskingWorker(FakeWorker):
    """Samples each constrained row uniformly among its allowed tokens (end of sequence only when nothing else is
    allowed); unconstrained rows get UNCONSTRAINED_TOKEN, or the scripted tokens of `script`."""

    def __init__(self, block_size: int, eos: int, seed: int = 0, script: dict[str, list[int]] | None = None):
        super().__init__(block_size)
        self.eos = eos
        self.rng = random.Random(seed)
        self.script = script or {}
        self.constrained_steps: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        rows = {}
        if plan.grammar_request_ids:
            words = np.frombuffer(plan.grammar_bitmask, dtype=np.int32).reshape(len(plan.grammar_request_ids), -1)
            rows = dict(zip(plan.grammar_request_ids, words))
        tokens = []
        for request_id in result.request_ids:
            if request_id in rows:
                self.constrained_steps[request_id] = self.constrained_steps.get(request_id, 0) + 1
                bits = np.unpackbits(rows[request_id].view(np.uint8), bitorder="little")
                allowed = [t for t in np.flatnonzero(bits).tolist() if t != self.eos] or [self.eos]
                tokens.append(self.rng.choice(allowed))
            elif self.script.get(request_id):
                tokens.append(self.script[request_id].pop(0))
            else:
                tokens.append(UNCONSTRAINED_TOKEN)
        self.last_sampled = dict(zip(result.request_ids, tokens))  # what overlap scheduling's placeholders become
        return StepResult(result.step_id, result.request_ids, tokens)


def make_scheduler(tokenizer, compiler, *, num_blocks=256, **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    return Scheduler(make_config(**config), num_blocks, [tokenizer.eos_token_id], grammars=compiler)


def constrained(request_id, prompt, max_tokens=120, **params):
    constraint = StructuredOutputsParams(**(params or {"json": json.dumps(SCHEMA)}))
    return make_request(request_id, prompt, max_tokens, structured_outputs=constraint)


def compiled(scheduler: Scheduler) -> Scheduler:
    """Wait until every queued grammar has compiled (or failed), so the first step can schedule them."""
    for req in scheduler.requests.values():
        if req.grammar is not None:
            req.grammar._compiled.exception(timeout=60)
    return scheduler


def texts(tokenizer, outputs) -> dict[str, str]:
    return {rid: tokenizer.decode([t for o in outs for t in o.new_token_ids]) for rid, outs in outputs.items()}


def test_constrained_requests_write_valid_json_and_free_everything(tokenizer, ll_tokenizer):
    compiler = GrammarCompiler(lambda: ll_tokenizer)
    scheduler = make_scheduler(tokenizer, compiler)
    for i in range(3):
        assert scheduler.add_request(constrained(f"r{i}", 10 + i)) is None
    group = constrained("pair", 9)
    group.sampling.n = 2
    assert scheduler.add_request(group) is None
    assert len(compiler._cache) == 1  # one schema, compiled once for all five choices
    outputs = run_to_completion(compiled(scheduler), MaskingWorker(4, tokenizer.eos_token_id, seed=1))
    assert sorted(outputs) == ["pair-0", "pair-1", "r0", "r1", "r2"]
    for request_id, text in texts(tokenizer, outputs).items():
        jsonschema.validate(json.loads(text), SCHEMA)
        assert outputs[request_id][-1].finish_reason == "stop", request_id
    assert scheduler.kv.usage == 0 and not scheduler.requests


def test_a_request_waiting_for_its_grammar_holds_up_no_one(tokenizer, ll_tokenizer):
    tokenizer_ready = threading.Event()
    compiler = GrammarCompiler(lambda: (tokenizer_ready.wait(30), ll_tokenizer)[1])
    scheduler = make_scheduler(tokenizer, compiler)
    scheduler.add_request(constrained("slow", 8))
    scheduler.add_request(make_request("plain", 8, max_tokens=3))
    worker = MaskingWorker(4, tokenizer.eos_token_id)
    finished = []
    for _ in range(10):
        _, outs = step(scheduler, worker)
        finished += [o.request_id for o in outs if o.finish_reason]
    assert finished == ["plain"]
    assert [r.request_id for r in scheduler.waiting] == ["slow"] and not worker.state.get("slow")
    tokenizer_ready.set()
    outputs = run_to_completion(compiled(scheduler), worker)
    jsonschema.validate(json.loads(texts(tokenizer, outputs)["slow"]), SCHEMA)


def test_a_grammar_that_does_not_compile_fails_its_request_alone(tokenizer, ll_tokenizer):
    scheduler = make_scheduler(tokenizer, GrammarCompiler(lambda: ll_tokenizer))
    scheduler.add_request(constrained("bad", 8, regex="(unclosed"))
    scheduler.add_request(make_request("good", 8, max_tokens=2))
    outputs = run_to_completion(compiled(scheduler), MaskingWorker(4, tokenizer.eos_token_id))
    [failure] = outputs["bad"]
    assert failure.finish_reason == "error" and failure.error_kind == "invalid"
    assert "unclosed" in failure.error
    assert outputs["good"][-1].finish_reason == "length"
    assert scheduler.kv.usage == 0 and not scheduler.requests


def test_preempted_requests_keep_their_matchers(tokenizer, ll_tokenizer):
    scheduler = make_scheduler(
        tokenizer, GrammarCompiler(lambda: ll_tokenizer), num_blocks=14, block_size=4, prefix_caching=False
    )
    for i in range(4):
        scheduler.add_request(constrained(f"r{i}", 8))
    compiled(scheduler)
    preemptions = 0
    outputs: dict = {}
    worker = MaskingWorker(4, tokenizer.eos_token_id, seed=2)
    while scheduler.has_unfinished_requests():
        _, outs = step(scheduler, worker)
        preemptions += scheduler.stats().num_preemptions
        for out in outs:
            outputs.setdefault(out.request_id, []).append(out)
    assert preemptions > 0
    for text in texts(tokenizer, outputs).values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_the_constraint_begins_after_the_end_of_thinking(tokenizer, ll_tokenizer):
    end_think = tokenizer.encode("</think>", add_special_tokens=False)
    scheduler = make_scheduler(tokenizer, GrammarCompiler(lambda: ll_tokenizer))
    scheduler.add_request(constrained("r", 8, json=json.dumps(SCHEMA), begin_after_token_ids=end_think))
    thinking = [UNCONSTRAINED_TOKEN] * 3 + end_think
    worker = MaskingWorker(4, tokenizer.eos_token_id, script={"r": list(thinking)})
    outputs = run_to_completion(compiled(scheduler), worker)
    tokens = [t for o in outputs["r"] for t in o.new_token_ids]
    assert tokens[: len(thinking)] == thinking
    jsonschema.validate(json.loads(tokenizer.decode(tokens[len(thinking) :])), SCHEMA)
    assert worker.constrained_steps["r"] == len(tokens) - len(thinking)


def padded_schema(description_chars: int, index: int) -> StructuredOutputsParams:
    """A small schema padded with a long description: cheap to compile, large to keep."""
    return StructuredOutputsParams(json={"type": "integer", "description": f"{index}" + "x" * description_chars})


def test_the_grammar_cache_is_bounded_in_bytes(ll_tokenizer):
    limit = 4 * COMPILED_ENTRY_BYTES + (1 << 20)
    compiler = GrammarCompiler(lambda: ll_tokenizer, cache_bytes=limit)
    futures = [compiler.compile(padded_schema(400_000, i)) for i in range(12)]
    assert compiler.cached_bytes <= limit and 1 <= len(compiler._cache) <= 3
    assert compiler.cached_bytes == sum(entry_bytes(key) for key in compiler._cache)
    assert all(future.result(timeout=60) is not None for future in futures)  # evicted ones still compile
    huge = compiler.compile(padded_schema(limit, 99))  # larger than the whole cache: compiled, never kept
    assert huge.result(timeout=60) is not None and compiler.cached_bytes <= limit
    assert compiler.compile(padded_schema(400_000, 11)) is futures[-1]  # the newest entries stay


def test_any_exception_from_the_grammar_engine_fails_its_request_alone(tokenizer, ll_tokenizer, monkeypatch):
    real_matcher = llguidance.LLMatcher

    class FailingMatcher:  # LLMatcher (its static grammar builders included) that raises on one grammar
        grammar_from_regex = staticmethod(real_matcher.grammar_from_regex)
        grammar_from_json_schema = staticmethod(real_matcher.grammar_from_json_schema)

        def __new__(cls, ll_tok: object, grammar: str, **kwargs: object) -> llguidance.LLMatcher:
            if "unlucky" in grammar:
                raise RuntimeError("engine bug")
            return real_matcher(ll_tok, grammar, **kwargs)

    monkeypatch.setattr(structured_outputs.llguidance, "LLMatcher", FailingMatcher)
    scheduler = make_scheduler(tokenizer, GrammarCompiler(lambda: ll_tokenizer))
    scheduler.add_request(constrained("bad", 8, regex="(unlucky)"))
    scheduler.add_request(constrained("good", 8))
    outputs = run_to_completion(compiled(scheduler), MaskingWorker(4, tokenizer.eos_token_id))
    [failure] = outputs["bad"]
    assert failure.finish_reason == "error" and failure.error_kind == "invalid" and "engine bug" in failure.error
    jsonschema.validate(json.loads(texts(tokenizer, outputs)["good"]), SCHEMA)
    assert scheduler.kv.usage == 0 and not scheduler.requests


def test_a_mask_the_grammar_engine_fails_to_fill_ends_that_request_alone(tokenizer, ll_tokenizer, monkeypatch):
    scheduler = make_scheduler(tokenizer, GrammarCompiler(lambda: ll_tokenizer))
    scheduler.add_request(constrained("bad", 8))
    scheduler.add_request(constrained("good", 8))
    real_fill_row = llguidance.numpy.fill_next_token_bitmask

    def fail_the_batch(*args):
        raise RuntimeError("batch fill bug")

    bad = scheduler.requests["bad"]

    def fail_bad_row(matcher, bitmask, row):
        if bad.grammar is not None and matcher is bad.grammar.matcher:
            raise RuntimeError("row fill bug")
        real_fill_row(matcher, bitmask, row)

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", fail_the_batch)
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", fail_bad_row)
    outputs = run_to_completion(compiled(scheduler), MaskingWorker(4, tokenizer.eos_token_id))
    assert outputs["bad"][-1].finish_reason == "error" and "row fill bug" in outputs["bad"][-1].error
    assert len(outputs["bad"]) == 1  # ended on the token sampled from the failed mask
    jsonschema.validate(json.loads(texts(tokenizer, outputs)["good"]), SCHEMA)
    assert scheduler.kv.usage == 0 and not scheduler.requests


def test_a_grammar_past_the_engines_limits_ends_each_request_with_the_error_never_a_silent_stop(
    tokenizer, ll_tokenizer
):
    """`c{100000}` compiles, but walking it constructs more lexer expressions than llguidance allows: the matcher
    goes into an error state whose mask allows only end of sequence, a state llguidance's deep copies share with the
    cached grammar. Every request with that constraint must end with the engine's error (a 400 for its client),
    never finish "stop" with text the regex does not match, and leave the cache without the broken grammar."""
    compiler = GrammarCompiler(lambda: ll_tokenizer)
    scheduler = make_scheduler(tokenizer, compiler)
    worker = MaskingWorker(4, tokenizer.eos_token_id)
    for i in range(3):
        scheduler.add_request(constrained(f"r{i}", 8, max_tokens=64, regex="(a|b)*c{100000}"))
        outputs = run_to_completion(compiled(scheduler), worker)
        last = outputs[f"r{i}"][-1]
        assert last.finish_reason == "error", (last, texts(tokenizer, outputs))
        assert "too many expressions" in last.error
        assert not compiler._cache and compiler.cached_bytes == 0


def test_overlap_scheduling_plans_a_constrained_requests_steps_after_their_results(tokenizer, ll_tokenizer):
    scheduler = make_scheduler(tokenizer, GrammarCompiler(lambda: ll_tokenizer))
    scheduler.add_request(constrained("json", 8))
    scheduler.add_request(make_request("plain", 8, max_tokens=150, ignore_eos=True))
    worker = MaskingWorker(4, tokenizer.eos_token_id, seed=3)
    placeholders: list[str] = []
    json_steps: list[int] = []
    execute = worker.execute

    def execute_noting_placeholders(plan: StepPlan) -> StepResult:
        placeholders.extend(r.request_id for r in plan.running if r.append_last_sampled)
        json_steps.extend(plan.step_id for r in [*plan.new_requests, *plan.running] if r.request_id == "json")
        return execute(plan)

    worker.execute = execute_noting_placeholders  # type: ignore[method-assign]
    outputs = drive(compiled(scheduler), worker, overlap=True)
    jsonschema.validate(json.loads(texts(tokenizer, outputs)["json"]), SCHEMA)
    assert "json" not in placeholders, "a constrained request's step was planned before its token was known"
    assert json_steps == list(range(json_steps[0], json_steps[-1] + 1)), "its steps ran synchronously, none skipped"
    assert "plain" in placeholders, "the plain request overlaps once the constrained one is done"
    assert [t for o in outputs["plain"] for t in o.new_token_ids] == [UNCONSTRAINED_TOKEN] * 150
    assert scheduler.kv.usage == 0 and not scheduler.requests


def test_the_first_mask_is_computed_on_the_compile_thread_and_its_failure_refuses_the_request_before_it_runs(
    tokenizer, ll_tokenizer, monkeypatch
):
    """The compiled grammar's first mask builds the lexer states every copy shares (tens of ms for a schema of many
    properties): on a compile thread, not on the scheduler's loop; an engine failure there refuses the request
    before it runs a step."""
    real_fill_row = llguidance.numpy.fill_next_token_bitmask
    threads: list[str] = []
    failing = threading.Event()

    def recording_fill(matcher, bitmask, row):
        threads.append(threading.current_thread().name)
        if failing.is_set():
            raise RuntimeError("first mask bug")
        real_fill_row(matcher, bitmask, row)

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", recording_fill)
    compiler = GrammarCompiler(lambda: ll_tokenizer)
    compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))).result(timeout=60)
    assert threads and all(name.startswith("grammar") for name in threads)

    failing.set()
    scheduler = make_scheduler(tokenizer, GrammarCompiler(lambda: ll_tokenizer))
    scheduler.add_request(constrained("bad", 8, regex="[a-z]+"))
    scheduler.add_request(make_request("plain", 8, 4))
    worker = MaskingWorker(4, tokenizer.eos_token_id)
    outputs = run_to_completion(compiled(scheduler), worker)
    [failure] = outputs["bad"]
    assert failure.finish_reason == "error" and failure.error_kind == "invalid" and "first mask bug" in failure.error
    assert failure.new_token_ids == []  # refused before its first step
    assert [new.request_id for new in worker.new_requests_seen] == ["plain"]
    assert scheduler.kv.usage == 0 and not scheduler.requests
