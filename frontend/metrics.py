"""Prometheus metrics under vLLM's names, in a registry of the app's own (two apps in one process never clash).

Scheduler gauges and counters are read from the `EngineClient`'s `latest_stats` when scraped (its counter fields are
running totals); token counters and latency histograms are fed by the request handlers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.frontend.engine_protocol import EngineClient, ReplicaStats
from tokenmill.messages import SchedulerStats

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

PROMPT_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class SchedulerStatsCollector(Collector):
    """Reads the engine's latest SchedulerStats at scrape time."""

    def __init__(self, engine: EngineClient, model_name: str, max_loras: int | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_loras = max_loras  # None: LoRA is off (no lora_requests_info)

    def collect(self) -> Iterator[Any]:
        replicas = self.engine.replica_stats()
        yield from lora_requests_info(self.engine.latest_stats, self.max_loras)
        if replicas is not None:  # data parallel: one sample per replica, labelled engine="i" as in vLLM
            yield from per_engine_metrics(self.engine, replicas, self.model_name)
            return
        stats = self.engine.latest_stats
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running if stats else 0)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting if stats else 0)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = 100%).",
            stats.kv_cache_usage if stats else 0.0,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries if stats else 0,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits if stats else 0,
        )
        yield counter(
            "vllm:num_preemptions",
            "Requests preempted (their KV blocks freed for recompute).",
            stats.num_preemptions if stats else 0,
        )
        yield from spec_decode_metrics(stats, self.model_name)
        ready = self.engine.ready  # EngineReady, once the engine is up
        if ready is not None:  # as vLLM: the KV cache's shape in the labels, value 1
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the KV cache configuration.",
                labels=["block_size", "num_gpu_blocks"],
            )
            info.add_metric([str(ready.block_size), str(ready.num_kv_blocks)], 1.0)
            yield info


def per_engine_metrics(engine: EngineClient, replicas: list[ReplicaStats], model_name: str) -> Iterator[Any]:
    """The scheduler metrics of data-parallel replicas, `(index, alive, SchedulerStats | None)` each: gauges read 0
    once a replica has died (counters keep their totals), and `tokenmill:engine_alive` says which are serving."""
    labels = ["model_name", "engine"]

    def family(kind: type, name: str, doc: str, value: Callable[[Any], float], dead_value: bool = False):
        metric = kind(name, doc, labels=labels)
        for rank, alive, stats in replicas:
            keep = alive or dead_value
            metric.add_metric([model_name, str(rank)], value(stats) if stats is not None and keep else 0)
        return metric

    yield family(
        GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", lambda s: s.num_running
    )
    yield family(
        GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting
    )
    yield family(
        GaugeMetricFamily,
        "vllm:kv_cache_usage_perc",
        "Fraction of KV-cache blocks in use (1 = 100%).",
        lambda s: s.kv_cache_usage,
    )
    yield family(
        CounterMetricFamily,
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.prefix_cache_queries,
        dead_value=True,
    )
    yield family(
        CounterMetricFamily,
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        lambda s: s.prefix_cache_hits,
        dead_value=True,
    )
    yield family(
        CounterMetricFamily,
        "vllm:num_preemptions",
        "Requests preempted (their KV blocks freed for recompute).",
        lambda s: s.num_preemptions,
        dead_value=True,
    )
    alive = GaugeMetricFamily(
        "tokenmill:engine_alive", "1 while the data-parallel replica serves, 0 once it died.", labels=labels
    )
    for rank, is_alive, _ in replicas:
        alive.add_metric([model_name, str(rank)], 1.0 if is_alive else 0.0)
    yield alive
    decisions = engine.routing_decisions()
    if decisions:
        routed = CounterMetricFamily(
            "tokenmill:data_parallel_routed_requests",
            "Requests sent to each replica, by why the router chose it (prefix: longest "
            "cached prefix; new-prefix: smallest prefix index; load: least loaded; balance: "
            "loads too uneven; round-robin).",
            labels=[*labels, "reason"],
        )
        for reason, counts in sorted(decisions.items()):
            for rank, count in enumerate(counts):
                routed.add_metric([model_name, str(rank), reason], count)
        yield routed
    yield from spec_decode_metrics(engine.latest_stats, model_name)  # the replicas' summed
    ready = engine.ready
    if ready is not None:
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(ready.block_size), str(ready.num_kv_blocks)], 1.0)
        yield info


def lora_requests_info(stats: SchedulerStats | None, max_loras: int | None) -> Iterator[GaugeMetricFamily]:
    """vLLM's vllm:lora_requests_info: the adapters of the running and waiting requests (comma-separated names) and
    --max-loras in the labels, the scrape's wall-clock time as the value (vLLM's: when the labels were last set)."""
    if max_loras is None:
        return
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    running = ",".join(stats.running_lora_adapters) if stats is not None else ""
    waiting = ",".join(stats.waiting_lora_adapters) if stats is not None else ""
    info.add_metric([str(max_loras), waiting, running], time.time())
    yield info


def spec_decode_metrics(stats: SchedulerStats | None, model_name: str) -> Iterator[CounterMetricFamily]:
    """vLLM's speculative-decoding counters (running totals), when the engine speculates."""
    if stats is None or not stats.spec_accepted_per_pos:
        return
    for name, doc, value in (
        (
            "vllm:spec_decode_num_drafts",
            "Requests that verified draft tokens, summed over steps.",
            stats.spec_num_drafts,
        ),
        ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens),
    ):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(stats.spec_accepted_per_pos):
        per_pos.add_metric([model_name, str(position)], value)
    yield per_pos


class FrontendMetrics:
    """The app's registry and the per-request instruments the handlers feed."""

    def __init__(self, engine: EngineClient, model_name: str, max_loras: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(SchedulerStatsCollector(engine, model_name, max_loras))
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=self.registry
        ).labels(model_name)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request.",
            labels,
            buckets=PROMPT_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced.", labels, registry=self.registry
        ).labels(model_name)
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to the first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output steps.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def record_finished(self, finish_reason: str) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
