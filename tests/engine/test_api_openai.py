"""The OpenAI-compatible API through the official `openai` client, against a real server (SmolLM2 on CPU).

One server, started with an API key that the clients send, serves the whole module. CPU steps are slow, so requests
that do not depend on each other go out at once in two rounds (`first_round`; then `second_round`, whose stop strings,
stop ids and biases come from the first round's greedy tokens) and share their engine steps; each test then checks
properties of its responses. Every response is validated in full against its `openai` type.
"""

from __future__ import annotations

import asyncio
import functools
import time

import openai
import pytest
import requests

import tokenmill
from tests.helpers.api_helpers import (
    API_KEY,
    auth,
    collect_stream,
    metric,
    metric_samples,
    result,
    run_concurrently,
    strictly_valid,
)
from tests.helpers.server import Server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
NEW_TOKENS = 6
FACT = "The capital of France is"
STORY = "Once upon a time, in a land far away,"
REPEATS = " ".join(["the"] * 12)
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the tallest mountain in the world?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
CHAT_WITH_PARTS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
]
TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25C"},
]
TOOL_TOKENS = 10
TOOL_MIN_TOKENS = 9  # more than the model's natural answer (the test checks it)
RETURN_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("api-openai") / "server.log"
    with Server(
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "128MiB",
        log_path=log_path,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def tokenize(server: Server, **body) -> list[int]:
    response = requests.post(f"{server.url}/tokenize", json=body, headers=auth(), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(server: Server, tokens: list[int]) -> str:
    response = requests.post(f"{server.url}/detokenize", json={"tokens": tokens}, headers=auth(), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


@pytest.fixture(scope="module")
def prompt_ids(server) -> dict[str, list[int]]:
    return {
        "fact": tokenize(server, prompt=FACT),
        "story": tokenize(server, prompt=STORY),
        "repeats": tokenize(server, prompt=REPEATS),
        "banana": tokenize(server, prompt=" banana", add_special_tokens=False),
    }


@pytest.fixture(scope="module")
def first_round(server, model, prompt_ids) -> dict:
    fact_ids, story_ids, (banana,) = prompt_ids["fact"], prompt_ids["story"], prompt_ids["banana"]

    def build(c: openai.AsyncOpenAI) -> dict:
        complete = functools.partial(c.completions.create, model=model, max_tokens=NEW_TOKENS)
        greedy = functools.partial(complete, temperature=0)
        chat = functools.partial(c.chat.completions.create, model=model, temperature=0)
        return {
            "greedy": greedy(prompt=FACT, user="api-test", extra_body=RETURN_IDS),
            "greedy_from_ids": greedy(prompt=fact_ids),
            "texts": greedy(prompt=[FACT, STORY]),
            "id_lists": greedy(prompt=[fact_ids, story_ids]),
            "echo": greedy(prompt=STORY, echo=True, max_tokens=4),
            "echo_ids": greedy(prompt=story_ids, echo=True, max_tokens=4),
            "logprobs": greedy(prompt=FACT, logprobs=3),
            "n3": complete(prompt=STORY, n=3, temperature=1.0, seed=11, extra_body={"ignore_eos": True}),
            "seeded": complete(prompt=STORY, temperature=1.0, seed=11, extra_body={"ignore_eos": True}),
            "stream": collect_stream(greedy(prompt=FACT, stream=True, stream_options={"include_usage": True})),
            "repeats": greedy(prompt=REPEATS, extra_body=RETURN_IDS),
            "repeats_penalized": greedy(
                prompt=REPEATS, presence_penalty=2.0, frequency_penalty=2.0, extra_body=RETURN_IDS
            ),
            "repeats_repetition_penalty": greedy(prompt=REPEATS, extra_body={**RETURN_IDS, "repetition_penalty": 2.0}),
            "banana_bias": greedy(prompt=FACT, max_tokens=3, logit_bias={str(banana): 100}, extra_body=RETURN_IDS),
            "top_k_1": complete(prompt=FACT, temperature=1.0, seed=5, extra_body={"top_k": 1}),
            "min_p_1": complete(prompt=FACT, temperature=1.0, seed=5, extra_body={"min_p": 1.0}),
            "top_p_tiny": complete(prompt=FACT, temperature=1.0, seed=5, top_p=1e-6),
            "priority": greedy(prompt=FACT, extra_body={"priority": 3}),
            "chat": chat(messages=CHAT, max_completion_tokens=NEW_TOKENS, logprobs=True, top_logprobs=2),
            "chat_parts": chat(messages=CHAT_WITH_PARTS, max_completion_tokens=NEW_TOKENS),
            "chat_stream": collect_stream(
                chat(
                    messages=CHAT, max_completion_tokens=NEW_TOKENS, stream=True, stream_options={"include_usage": True}
                )
            ),
            "tool": chat(messages=TOOL_CHAT, max_tokens=TOOL_TOKENS, logprobs=True),
            "tool_ignore_eos": chat(messages=TOOL_CHAT, max_tokens=TOOL_TOKENS, extra_body={"ignore_eos": True}),
            "tool_special_tokens": chat(
                messages=TOOL_CHAT,
                max_tokens=TOOL_TOKENS,
                extra_body={"ignore_eos": True, "skip_special_tokens": False},
            ),
            "tool_min_tokens": chat(
                messages=TOOL_CHAT, max_tokens=TOOL_TOKENS, extra_body={"min_tokens": TOOL_MIN_TOKENS}
            ),
        }

    return run_concurrently(server.url, build)


def first_new_token_index(token_ids: list[int]) -> int:
    """The first position from 1 on whose token did not occur before it (a stop id there stops exactly there)."""
    return next(k for k in range(1, len(token_ids)) if token_ids[k] not in token_ids[:k])


@pytest.fixture(scope="module")
def second_round(server, model, first_round) -> dict:
    greedy_choice = result(first_round, "greedy").choices[0]
    stop = greedy_choice.text[len(greedy_choice.text) // 2 :][:3]
    stop_id = greedy_choice.token_ids[first_new_token_index(greedy_choice.token_ids)]

    def build(c: openai.AsyncOpenAI) -> dict:
        greedy = functools.partial(c.completions.create, model=model, prompt=FACT, max_tokens=NEW_TOKENS, temperature=0)
        return {
            "stop": greedy(stop=[stop, "never appears"]),
            "stop_included": greedy(stop=stop, extra_body={"include_stop_str_in_output": True}),
            "stop_token": greedy(extra_body={**RETURN_IDS, "stop_token_ids": [stop_id]}),
            "first_token_banned": greedy(
                max_tokens=2, logit_bias={str(greedy_choice.token_ids[0]): -100}, extra_body=RETURN_IDS
            ),
        }

    return {"stop_string": stop, "stop_id": stop_id, **run_concurrently(server.url, build)}


# ---------------------------------------------------------------------------------------------- completions


def test_models_list(client, model):
    models = strictly_valid(client.models.list())
    assert [m.id for m in models.data] == [model] and models.data[0].object == "model"
    assert models.data[0].max_model_len == MAX_MODEL_LEN


def test_completion_of_a_string_prompt(server, model, first_round, prompt_ids):
    response = strictly_valid(result(first_round, "greedy"))
    choice = response.choices[0]
    assert response.object == "text_completion" and response.model == model and response.id.startswith("cmpl-")
    assert [c.index for c in response.choices] == [0] and choice.finish_reason == "length"
    assert len(choice.token_ids) == NEW_TOKENS and choice.text == detokenize(server, choice.token_ids)
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids["fact"]), NEW_TOKENS)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_token_id_prompts_and_prompt_lists_match_text_prompts(first_round, prompt_ids):
    greedy_text = result(first_round, "greedy").choices[0].text
    assert strictly_valid(result(first_round, "greedy_from_ids")).choices[0].text == greedy_text
    texts, id_lists = strictly_valid(result(first_round, "texts")), strictly_valid(result(first_round, "id_lists"))
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[0].text == greedy_text
    assert [c.text for c in id_lists.choices] == [c.text for c in texts.choices]
    assert texts.choices[0].text != texts.choices[1].text
    for response in (texts, id_lists):
        assert response.usage.prompt_tokens == len(prompt_ids["fact"]) + len(prompt_ids["story"])
        assert response.usage.completion_tokens == 2 * NEW_TOKENS


def test_echo_prepends_the_prompt(server, first_round, prompt_ids):
    echoed = strictly_valid(result(first_round, "echo")).choices[0].text
    assert echoed.startswith(STORY) and len(echoed) > len(STORY)
    # greedy: 4 tokens continue the prompt as the first 4 of the longer run do
    assert result(first_round, "texts").choices[1].text.startswith(echoed[len(STORY) :])
    echoed_ids = strictly_valid(result(first_round, "echo_ids")).choices[0].text
    assert echoed_ids == echoed and detokenize(server, prompt_ids["story"]) == STORY


def test_completion_logprobs(first_round):
    choice = strictly_valid(result(first_round, "logprobs")).choices[0]
    assert choice.text == result(first_round, "greedy").choices[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == NEW_TOKENS
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(NEW_TOKENS)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and all(lp <= 0 for lp in top.values())
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is the likeliest


def test_n_choices_and_seeds(first_round, prompt_ids):
    response = strictly_valid(result(first_round, "n3"))
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.text for c in response.choices}) > 1  # each choice samples with its own seed
    assert response.usage.prompt_tokens == len(prompt_ids["story"])  # the prompt counts once
    assert response.usage.completion_tokens == 3 * NEW_TOKENS
    # same seed, same sample: choice i of n samples with seed + i, so choice 0 repeats the n=1 request's sample
    assert strictly_valid(result(first_round, "seeded")).choices[0].text == response.choices[0].text


def token_counts(usage: openai.types.CompletionUsage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_stream_with_usage_matches_the_whole_response(first_round):
    greedy = result(first_round, "greedy")
    chunks = result(first_round, "stream")
    *text_chunks, usage_chunk = chunks
    assert all(len(c.choices) == 1 and c.choices[0].index == 0 and c.usage is None for c in text_chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == greedy.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert len({c.id for c in chunks}) == 1
    # OpenAI's Completion type has no null finish_reason, so only the last text chunk and the usage chunk validate
    strictly_valid(text_chunks[-1])
    assert strictly_valid(usage_chunk).choices == [] and token_counts(usage_chunk.usage) == token_counts(greedy.usage)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def test_penalties_change_only_repeated_tokens(first_round, prompt_ids):
    plain = strictly_valid(result(first_round, "repeats")).choices[0].token_ids
    # presence/frequency penalties count output tokens: the run follows greedy until greedy repeats an output token
    penalized = strictly_valid(result(first_round, "repeats_penalized")).choices[0].token_ids
    assert penalized != plain
    i = first_divergence(plain, penalized)
    assert plain[i] in plain[:i]
    # the repetition penalty counts prompt tokens too
    repetition = strictly_valid(result(first_round, "repeats_repetition_penalty")).choices[0].token_ids
    assert repetition != plain
    i = first_divergence(plain, repetition)
    assert plain[i] in plain[:i] or plain[i] in prompt_ids["repeats"]


def test_logit_bias_forces_and_bans_tokens(first_round, second_round, prompt_ids):
    forced = strictly_valid(result(first_round, "banana_bias")).choices[0]
    assert forced.token_ids == prompt_ids["banana"] * 3 and forced.text == " banana" * 3
    greedy_ids = result(first_round, "greedy").choices[0].token_ids
    banned = strictly_valid(result(second_round, "first_token_banned")).choices[0]
    assert banned.token_ids[0] != greedy_ids[0]


def test_sampling_extras_that_reduce_to_greedy(first_round):
    greedy_text = result(first_round, "greedy").choices[0].text
    # at temperature 1, top_k=1, min_p=1 and a tiny top_p each leave only the likeliest token
    for name in ("top_k_1", "min_p_1", "top_p_tiny", "priority"):
        assert strictly_valid(result(first_round, name)).choices[0].text == greedy_text, name


def test_stop_strings(first_round, second_round):
    greedy_text = result(first_round, "greedy").choices[0].text
    stop = second_round["stop_string"]
    cut = greedy_text.index(stop)
    stopped = strictly_valid(result(second_round, "stop")).choices[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == (greedy_text[:cut], "stop", stop)
    included = strictly_valid(result(second_round, "stop_included")).choices[0]
    assert (included.text, included.finish_reason) == (greedy_text[: cut + len(stop)], "stop")


def test_stop_token_ids(server, first_round, second_round):
    greedy_ids = result(first_round, "greedy").choices[0].token_ids
    stop_id = second_round["stop_id"]
    response = strictly_valid(result(second_round, "stop_token"))
    choice = response.choices[0]
    k = greedy_ids.index(stop_id)
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop_id)
    assert choice.token_ids == greedy_ids[: k + 1] and response.usage.completion_tokens == k + 1
    assert choice.text == detokenize(server, greedy_ids[:k])  # the stop token itself is not rendered


# ---------------------------------------------------------------------------------------------- chat


def test_chat_completion_with_logprobs(server, model, first_round):
    response = strictly_valid(result(first_round, "chat"))
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == model and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenize(server, messages=CHAT))
    assert response.usage.completion_tokens == NEW_TOKENS
    entries = choice.logprobs.content
    assert len(entries) == NEW_TOKENS and "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token
    # content given as a list of text parts renders the same prompt
    assert strictly_valid(result(first_round, "chat_parts")).choices[0].message.content == choice.message.content


def test_chat_stream_with_usage(first_round):
    whole = result(first_round, "chat")
    chunks = [strictly_valid(c) for c in result(first_round, "chat_stream")]
    *content_chunks, usage_chunk = chunks
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == whole.choices[0].message.content
    finish_reasons = [c.choices[0].finish_reason for c in content_chunks]
    assert finish_reasons == [None] * (len(content_chunks) - 1) + ["length"]
    # (cached_tokens may differ: a prompt block computed by one request of the round can serve a later one)
    assert usage_chunk.choices == [] and token_counts(usage_chunk.usage) == token_counts(whole.usage)
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1


def test_tool_role_eos_ignore_eos_and_special_tokens(server, first_round):
    natural = strictly_valid(result(first_round, "tool")).choices[0]
    assert natural.finish_reason == "stop" and natural.message.content  # the model ended with EOS
    usage = result(first_round, "tool").usage
    assert usage.prompt_tokens == len(tokenize(server, messages=TOOL_CHAT)) and usage.completion_tokens < TOOL_TOKENS
    assert len(natural.logprobs.content) == usage.completion_tokens  # the EOS token is listed last, not rendered
    eos = natural.logprobs.content[-1].token
    assert eos and eos not in natural.message.content
    ignored = strictly_valid(result(first_round, "tool_ignore_eos"))
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == TOOL_TOKENS
    assert ignored.choices[0].message.content.startswith(natural.message.content)
    assert eos not in ignored.choices[0].message.content
    special = strictly_valid(result(first_round, "tool_special_tokens")).choices[0].message.content
    assert special.startswith(natural.message.content + eos)


def test_min_tokens_holds_eos_back(first_round):
    natural = result(first_round, "tool")
    assert natural.usage.completion_tokens < TOOL_MIN_TOKENS
    longer = strictly_valid(result(first_round, "tool_min_tokens"))
    assert longer.usage.completion_tokens >= TOOL_MIN_TOKENS
    assert longer.choices[0].message.content.startswith(natural.choices[0].message.content)
    assert len(longer.choices[0].message.content) > len(natural.choices[0].message.content)


# ---------------------------------------------------------------------------------------------- other endpoints


def test_tokenize_and_detokenize(server, prompt_ids):
    response = requests.post(
        f"{server.url}/tokenize", json={"prompt": FACT, "return_token_strs": True}, headers=auth(), timeout=30
    )
    body = response.json()
    assert body["tokens"] == prompt_ids["fact"] and body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert detokenize(server, body["tokens"]) == FACT
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert tokenize(server, messages=parts) == tokenize(server, messages=[{"role": "user", "content": "Hello\nthere"}])
    assert len(tokenize(server, messages=TOOL_CHAT)) > len(tokenize(server, messages=TOOL_CHAT[:2]))


def test_version_and_health(server):
    assert requests.get(f"{server.url}/version", headers=auth(), timeout=10).json() == {
        "version": tokenmill.__version__
    }
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200


def test_metrics_count_one_request(server, client, model, prompt_ids):
    before = metric_samples(server.url)
    response = client.completions.create(
        model=model, prompt=FACT, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 2
    after = metric_samples(server.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:generation_tokens_total") == 2
    assert delta("vllm:prompt_tokens_total") == len(prompt_ids["fact"])
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1


# ---------------------------------------------------------------------------------------------- disconnects

NUM_STREAMS = 16
NUM_UNSTREAMED = 2  # non-streamed requests with n=2 whose clients give up too
SHARED_PREFIX = "You are a storyteller who writes long, vivid tales about the sea, ships and distant islands. " * 2
# A dropped request must be gone within this; running to max_tokens would take far longer (hundreds of CPU steps).
DEADLINE_S = 10.0
LONG = MAX_MODEL_LEN - 64


async def open_streams(client: openai.AsyncOpenAI, model: str, chunks_each: int) -> list[openai.AsyncStream]:
    """NUM_STREAMS long streamed completions, each read for `chunks_each` chunks (with text) and left open."""
    streams = await asyncio.gather(
        *(
            client.completions.create(
                model=model,
                prompt=f"{SHARED_PREFIX}Tale number {i}:",
                max_tokens=LONG,
                temperature=0.8,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i in range(NUM_STREAMS)
        )
    )

    async def read(stream: openai.AsyncStream) -> None:
        chunks = aiter(stream)
        for _ in range(chunks_each):
            assert (await anext(chunks)).choices[0].finish_reason is None

    await asyncio.gather(*(read(s) for s in streams))
    return list(streams)


def poll_metrics(url: str, until, deadline_s: float = DEADLINE_S) -> tuple[float, float, float]:
    """(running, kv usage, seconds waited) once `until(running, usage)` holds; fails past the deadline."""
    start = time.monotonic()
    while True:
        running = metric(url, "vllm:num_requests_running")
        usage = metric(url, "vllm:kv_cache_usage_perc")
        waited = time.monotonic() - start
        if until(running, usage):
            return running, usage, waited
        assert waited < deadline_s, f"metrics still say running={running} kv usage={usage} after {waited:.1f} s"
        time.sleep(0.1)


def test_disconnected_clients_free_their_requests_and_blocks(server, client, model):
    num_engine_requests = NUM_STREAMS + 2 * NUM_UNSTREAMED

    async def scenario() -> tuple[float, float]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as async_client:
            unstreamed = [
                asyncio.create_task(
                    async_client.completions.create(
                        model=model,
                        prompt=f"{SHARED_PREFIX}Tale number {i}:",
                        max_tokens=LONG,
                        n=2,
                        extra_body={"ignore_eos": True},
                    )
                )
                for i in range(NUM_STREAMS, NUM_STREAMS + NUM_UNSTREAMED)
            ]
            streams = await open_streams(async_client, model, chunks_each=2)
            _, usage_during, _ = await asyncio.to_thread(
                poll_metrics, server.url, lambda running, usage: running == num_engine_requests
            )
            # every connection drops mid-generation
            for task in unstreamed:
                task.cancel()
            await asyncio.gather(*(stream.close() for stream in streams), *unstreamed, return_exceptions=True)
            _, _, seconds_to_free = await asyncio.to_thread(
                poll_metrics, server.url, lambda running, usage: running == 0 and usage == 0
            )
        return usage_during, seconds_to_free

    usage_during, seconds_to_free = asyncio.run(scenario())
    assert usage_during > 0 and metric(server.url, "vllm:num_requests_waiting") == 0
    print(
        f"{num_engine_requests} requests of dropped clients freed in {seconds_to_free:.2f} s "
        f"(KV usage {usage_during:.3f} before)"
    )
    # Usage counts referenced blocks only: the freed prefix blocks stay cached, and the next request reuses them.
    again = client.completions.create(model=model, prompt=f"{SHARED_PREFIX}Tale number 99:", max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert poll_metrics(server.url, lambda running, usage: usage == 0)[1] == 0
