"""Helpers for the API tests against a real server: strict parsing with the `openai` types, /metrics samples, and a
runner that sends many requests at once (one batch of engine steps instead of one per request: CPU steps are slow)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import openai
import requests
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "sk-tokenmill-test"

Model = TypeVar("Model", bound=openai.BaseModel)


def strictly_valid(response: Model) -> Model:
    """The response validated by its `openai` type in full. The client itself builds its models leniently (a missing
    required field or a wrong type passes unnoticed), so every test runs what it got through this."""
    return type(response).model_validate(response.to_dict())


def auth(api_key: str = API_KEY) -> dict[str, str]:
    """The header every path but /health and /ping needs when the server has an API key (ignored without one)."""
    return {"Authorization": f"Bearer {api_key}"}


def metric_samples(url: str, api_key: str = API_KEY) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (sample name, sorted labels without model_name) -> value."""
    text = requests.get(f"{url}/metrics", headers=auth(api_key), timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(url: str, name: str, **labels: str) -> float:
    return metric_samples(url).get((name, tuple(sorted(labels.items()))), 0.0)


def run_concurrently(base_url: str, build: Callable[[openai.AsyncOpenAI], dict[str, Awaitable[Any]]]) -> dict[str, Any]:
    """Run the named requests `build(client)` makes, all at once; each name maps to its result or its exception."""

    async def main() -> dict[str, Any]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
            jobs = build(client)
            results = await asyncio.gather(*jobs.values(), return_exceptions=True)
        return dict(zip(jobs, results))

    return asyncio.run(main())


async def collect_stream(stream: Awaitable[openai.AsyncStream]) -> list[Any]:
    """Every chunk of a streamed response."""
    return [chunk async for chunk in await stream]


def result(results: dict[str, Any], name: str) -> Any:
    """One named result of `run_concurrently`, re-raising the exception the request ended with."""
    value = results[name]
    if isinstance(value, BaseException):
        raise value
    return value
