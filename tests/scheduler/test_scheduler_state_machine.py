"""A hypothesis state machine that drives the Scheduler with random arrivals (shared prefixes, salts, embeddings),
aborts and fake worker steps on tiny pools, and checks the block and request invariants after every rule:

- every block is either free (in the free queue, ref count 0) or referenced, and free + used = total;
- a block's ref count equals the number of block tables that hold it; a table holds a block at most once;
  a block in several tables is a hashed, full (prefix-cache) block;
- only running generation requests own blocks, enough for their computed tokens; finished ones own nothing;
- the fake worker's mirror of each request (built only from plan diffs) equals the scheduler's state, and every
  request attends only to KV slots holding its own tokens (so a stale prefix-cache hit fails);
- no deadlock: whenever requests are unfinished, the next schedule() plans at least one token;
- outputs obey max_tokens, min_tokens and the stop rules; admission accepts exactly the requests that can run;
- at teardown, after finishing or aborting everything, the pool is whole again.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.helpers.sched_testing import EOS, FakeWorker, make_config, make_request, scheduled_tokens
from tokenmill.scheduler.kv_cache_manager import cdiv
from tokenmill.scheduler.request import RequestStatus
from tokenmill.scheduler.scheduler import Scheduler

SHARED_PREFIXES = [list(range(10, 30)), list(range(40, 60)), [5] * 20]
STOP_TOKEN = 3
SAMPLED_TOKENS = [EOS, STOP_TOKEN] + list(range(7, 25))  # the fake worker stops a request about one time in ten

# one arrival: a prompt made of a shared prefix and a unique (maybe empty) suffix, plus its sampling and scheduling
# options
request_shapes = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, len(SHARED_PREFIXES) - 1),
        "prefix_len": st.integers(1, 12),
        "suffix_len": st.integers(0, 4),
        "max_tokens": st.integers(1, 7).map(lambda n: None if n == 7 else n),
        "priority": st.integers(0, 3),
        "salt": st.sampled_from([None, None, "tenant"]),
        "min_tokens": st.integers(0, 2),
        "ignore_eos": st.booleans(),
        "embed": st.integers(0, 9).map(lambda x: x == 0),
    }
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        spare_blocks=st.integers(0, 4),
        budget=st.integers(2, 20),
        max_num_seqs=st.integers(1, 4),
        chunked=st.booleans(),
        caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority", "sjf"]),
        max_model_len=st.integers(6, 24),
        finish_by_abort=st.booleans(),
        initial=st.lists(request_shapes, min_size=1, max_size=4),
    )
    def setup(
        self,
        block_size,
        spare_blocks,
        budget,
        max_num_seqs,
        chunked,
        caching,
        policy,
        max_model_len,
        finish_by_abort,
        initial,
    ):
        # a pool that holds one request of max_model_len and a little more: enough to admit, tight enough to preempt
        num_blocks = cdiv(max_model_len, block_size) + spare_blocks
        self.config = make_config(
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            chunked_prefill=chunked,
            prefix_caching=caching,
            policy=policy,
        )
        self.num_blocks = num_blocks
        self.sched = Scheduler(self.config, num_blocks, [EOS], clock=self.tick)
        self.rng = random.Random(0)
        self.worker = FakeWorker(block_size, sample=lambda rid, state: self.rng.choice(SAMPLED_TOKENS))
        self.now = 0.0
        self.finish_by_abort = finish_by_abort
        self.next_id = 0
        self.next_unique_token = 1000
        self.specs: dict[str, object] = {}  # request id -> EngineRequest
        self.num_outputs: dict[str, int] = {}
        self.finished: set[str] = set()
        self.num_preemptions = 0
        self.add_requests(initial)

    def tick(self) -> float:
        self.now += 0.25
        return self.now

    # ------------------------------------------------------------------ rules

    @rule(shapes=st.lists(request_shapes, min_size=1, max_size=3))
    def add_requests(self, shapes):
        for shape in shapes:
            self.add_request(**shape)

    def add_request(self, prefix, prefix_len, suffix_len, max_tokens, priority, salt, min_tokens, ignore_eos, embed):
        prompt = SHARED_PREFIXES[prefix][:prefix_len] + list(
            range(self.next_unique_token, self.next_unique_token + suffix_len)
        )
        self.next_unique_token += suffix_len
        request_id = f"r{self.next_id}"
        self.next_id += 1
        request = make_request(
            request_id,
            prompt,
            max_tokens,
            priority=priority,
            cache_salt=salt,
            task="embed" if embed else "generate",
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=[STOP_TOKEN],
        )
        reason = self.sched.add_request(request)
        assert (reason is None) == self.admissible(request), reason
        event("admitted" if reason is None else "rejected")
        if reason is None:
            self.specs[request_id] = request
            self.num_outputs[request_id] = 0
        else:
            assert reason.kind == "invalid" and isinstance(reason.message, str) and reason.message

    def admissible(self, request) -> bool:
        """The admission rules, restated independently."""
        cfg = self.config
        n = len(request.prompt_token_ids)
        mml = cfg.model.max_model_len
        if n == 0:
            return False
        if request.task == "embed":
            return n <= mml and n <= cfg.scheduler.max_num_batched_tokens
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and (max_tokens < 1 or n + max_tokens > mml):
            return False
        if max_tokens is None and n >= mml:
            return False
        total = mml if max_tokens is None else n + max_tokens
        if cdiv(total, cfg.cache.block_size) > self.num_blocks:
            return False
        return cfg.scheduler.enable_chunked_prefill or n <= cfg.scheduler.max_num_batched_tokens

    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.specs) + ["never-added"]))
        was_unfinished = request_id in self.specs and request_id not in self.finished
        outputs = self.sched.abort_requests([request_id, request_id])
        if was_unfinished:
            assert [(o.request_id, o.finish_reason) for o in outputs] == [(request_id, "abort")]
            self.finished.add(request_id)
        else:
            assert outputs == []
        assert request_id not in self.sched.kv.req_blocks

    @rule(seed=st.integers(0, 2**16), num_steps=st.integers(1, 4))
    def steps(self, seed, num_steps):
        self.rng.seed(seed)
        for _ in range(num_steps):
            self.run_one_step()

    def run_one_step(self) -> None:
        had_work = self.sched.has_unfinished_requests()
        plan = self.sched.schedule()
        if not had_work:
            assert plan is None
            return
        assert plan is not None, "deadlock: unfinished requests but nothing scheduled"
        counts = scheduled_tokens(plan)
        assert 0 < sum(counts.values()) <= self.config.scheduler.max_num_batched_tokens
        assert len(counts) <= self.config.scheduler.max_num_seqs
        for request_id in counts:
            assert request_id not in self.finished
        stats = self.sched.stats()
        self.num_preemptions += stats.num_preemptions
        if stats.num_preemptions:
            event("a step preempted")
        if stats.prefix_cache_hits:
            event("a prefix-cache hit")
        if any(n.num_scheduled_tokens < len(n.token_ids) - n.num_computed_tokens for n in plan.new_requests):
            event("a prompt was chunked")
        outputs = self.sched.update(plan, self.worker.execute(plan))
        for out in outputs:
            self.check_output(out)

    def check_output(self, out) -> None:
        request = self.specs[out.request_id]
        assert out.request_id not in self.finished, "output after the request finished"
        assert out.num_prompt_tokens == len(request.prompt_token_ids)
        if request.task == "embed":
            assert out.finish_reason == "stop" and out.embedding is not None and out.new_token_ids == []
            self.finished.add(out.request_id)
            return
        assert len(out.new_token_ids) == 1
        self.num_outputs[out.request_id] += 1
        count = self.num_outputs[out.request_id]
        sampling = request.sampling
        mml = self.config.model.max_model_len
        limit = sampling.max_tokens if sampling.max_tokens is not None else mml - len(request.prompt_token_ids)
        assert count <= limit
        token = out.new_token_ids[0]
        stops = token == STOP_TOKEN or (token == EOS and not sampling.ignore_eos)
        if stops and count >= sampling.min_tokens:
            assert (out.finish_reason, out.stop_token_id) == ("stop", token)
        elif count == limit:
            assert (out.finish_reason, out.stop_token_id) == ("length", None)
        else:
            assert out.finish_reason is None
        if out.finish_reason is not None:
            self.finished.add(out.request_id)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "sched"):
            return
        kv = self.sched.kv
        pool = kv.pool
        owners: dict[int, int] = {}
        for request_id, blocks in kv.req_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice"
            for block_id in ids:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), "ref count differs from owners"
            assert (block.ref_count == 0) == (block.block_id in pool.free_queue)
            if block.ref_count > 1:
                assert block.hash is not None, "a shared block must be a cached full block"
        used = sum(1 for b in pool.blocks if b.ref_count > 0)
        assert used + pool.num_free_blocks == self.num_blocks
        for block_hash, block in pool.cached.items():
            assert block.hash == block_hash

    @invariant()
    def only_running_requests_own_blocks(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        block_size = self.config.cache.block_size
        assert {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting} == set(sched.requests)
        assert len(sched.running) + len(sched.waiting) == len(sched.requests)
        assert len(sched.running) <= self.config.scheduler.max_num_seqs
        assert all(r.status is RequestStatus.RUNNING for r in sched.running)
        assert all(r.status is RequestStatus.WAITING for r in sched.waiting)
        for request_id in sched.kv.req_blocks:
            req = sched.requests.get(request_id)
            assert req is not None and req.status is RequestStatus.RUNNING and not req.is_embedding
        for req in sched.running:
            if not req.is_embedding:
                assert len(sched.kv.req_blocks[req.request_id]) * block_size >= req.num_computed_tokens
        for request_id in self.finished:
            assert request_id not in sched.requests and request_id not in sched.kv.req_blocks

    @invariant()
    def worker_mirror_matches_the_scheduler(self):
        if not hasattr(self, "sched"):
            return
        for req in self.sched.requests.values():
            if not req.on_worker:
                continue
            state = self.worker.state[req.request_id]
            assert state.token_ids == req.all_token_ids[: req.num_tokens_on_worker]
            assert state.block_ids == self.sched.kv.block_ids(req.request_id)[: req.num_blocks_on_worker]
            assert state.num_computed_tokens == req.num_computed_tokens

    # ------------------------------------------------------------------ teardown

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # finish by stepping (at most 2000 steps: more would be a livelock), or step a little and abort the rest
        for _ in range(3 if self.finish_by_abort else 2000):
            if not self.sched.has_unfinished_requests():
                break
            self.run_one_step()
        if self.finish_by_abort:
            self.sched.abort_requests(list(self.sched.requests))
        assert not self.sched.has_unfinished_requests(), "requests never finished (livelock)"
        pool = self.sched.kv.pool
        assert pool.num_free_blocks == self.num_blocks
        assert all(b.ref_count == 0 for b in pool.blocks)
        assert self.sched.kv.req_blocks == {}
        assert self.sched.stats().kv_cache_usage == 0.0


SchedulerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerStateMachine = SchedulerMachine.TestCase
