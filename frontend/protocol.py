"""OpenAI (and vLLM-extension) request and response schemas as msgspec Structs, and request -> SamplingParams.

Requests are decoded with `decode_request(body, type)`: msgspec validates types and ranges while parsing and its
error names the field, which becomes the error's `param`. Integers are bounded to 64 bits (they cross to the engine
as msgpack). Unknown fields are ignored, as OpenAI clients send many; the OpenAI and vLLM fields tokenmill does not
implement are declared (`Any`) so that `frontend/unsupported.py` can refuse a request that uses one. The limits that
are flags (n, logprobs, stop, logit_bias, JSON depth) are checked by `frontend/limits.py`.
Responses are encoded with `encode_json`; fields that must be absent rather than null default to `msgspec.UNSET`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from tokenmill.frontend.errors import APIError, validation_error
from tokenmill.messages import SamplingParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Timeout = Annotated[float, Meta(gt=0.0, le=1e7)]  # a request's deadline, in seconds (finite: JSON may say 1e999)


def decode_request(body: bytes, request_type: type) -> Any:
    try:
        return msgspec.json.decode(body, type=request_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise validation_error(exc) from None
    except RecursionError:  # msgspec decodes nested JSON recursively, as deep as the interpreter's stack allows
        raise APIError(400, "The request body's JSON is nested too deeply to decode.") from None
    except UnicodeDecodeError as exc:  # msgspec checks UTF-8 only where a string is decoded, and raises this
        raise APIError(400, f"The request body is not valid UTF-8 (byte {exc.start}).") from None


def encode_json(value: Any) -> bytes:
    return msgspec.json.encode(value)


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(Struct, kw_only=True):
    """The fields completions and chat share: OpenAI sampling plus vLLM's extras."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: PositiveInt = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    cache_salt: str | None = None
    prompt_logprobs: NonNegativeInt | None = None  # top logprobs per prompt token (frontend/prompt_logprobs.py)
    timeout: Timeout | None = None  # seconds from arrival: then it ends with what it has (generation.request_deadline)
    # structured outputs: at most one of these, read and checked by frontend/structured_outputs.py
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # not implemented: a request that sets one (to more than its no-op value) is refused (frontend/unsupported.py)
    best_of: Any = None
    use_beam_search: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None


class CompletionRequest(SamplingRequest, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists (checked in `prompt_inputs`)
    prompt: str | list[str | int | list[int]]
    # the legacy completions default, as OpenAI and vLLM; null = all the room left; 0 only with echo
    max_tokens: NonNegativeInt | None = 16
    logprobs: NonNegativeInt | None = None
    echo: bool = False
    add_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM extension: choices carry prompt_token_ids and token_ids
    suffix: Any = None  # not implemented


class TextPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET
    tool_call_id: str | UnsetType = UNSET


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegativeInt | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template; checked in frontend/tool_choice.py
    tool_choice: Any = None  # none, auto, required or a named function (frontend/tool_choice.py)
    parallel_tool_calls: bool | None = None  # false: at most the first call is returned, as vLLM
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # rendered only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # only the variables the template reads
    # not implemented (frontend/unsupported.py)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    documents: Any = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: either `prompt` (text) or `messages` (chat, templated first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None  # with messages, as in a chat request
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[NonNegativeInt]


# ---------------------------------------------------------------------------------------------- conversion


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise APIError(400, "stop strings must not be empty", "stop")
    return stops


def parse_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not logit_bias:
        return None
    parsed: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise APIError(
                400, f"logit_bias token id {token_id} is out of the vocabulary (0..{vocab_size - 1})", "logit_bias"
            )
        parsed[token_id] = bias
    return parsed


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, prompt_param: str = "messages"
) -> int:
    """The completion budget: what was asked, or all the room left; a 400 when the prompt plus it does not fit."""
    if num_prompt_tokens >= max_model_len:  # the prompt alone does not fit: blame the prompt, whatever max_tokens is
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            f"input messages.",
            prompt_param,
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, "
            f"{requested} in the completion). Please reduce the length of the messages or completion.",
            "max_tokens",
        )
    return requested


def to_sampling_params(
    request: SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    defaults: dict[str, int | float] | None = None,
) -> SamplingParams:
    """One choice's SamplingParams (n=1; the caller fans out n requests and offsets the seed per choice).

    `defaults` are the model's generation-config defaults (`ModelConfig.generation_defaults`): they fill the sampling
    fields the request left unset, and their `max_tokens` caps every request's, as vLLM's `--generation-config auto`.
    """
    defaults = defaults or {}

    def unless_set(value, name: str, fallback):
        return defaults.get(name, fallback) if value is None else value

    stop_token_ids = list(request.stop_token_ids or [])
    if any(t >= vocab_size for t in stop_token_ids):
        raise APIError(400, f"stop_token_ids must be below the vocabulary size {vocab_size}", "stop_token_ids")
    max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))
    if request.min_tokens > max_tokens:
        raise APIError(
            400, f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    if request.prompt_logprobs and request.stream:  # as vLLM: a stream has nowhere to put them
        raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    top_k = unless_set(request.top_k, "top_k", 0)
    return SamplingParams(
        n=1,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=unless_set(request.temperature, "temperature", 1.0),
        top_p=unless_set(request.top_p, "top_p", 1.0),
        top_k=max(top_k, 0),  # -1 and 0 both mean "disabled"
        min_p=unless_set(request.min_p, "min_p", 0.0),
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=unless_set(request.repetition_penalty, "repetition_penalty", 1.0),
        logit_bias=parse_logit_bias(request.logit_bias, vocab_size),
        stop=stop_strings(request.stop),
        stop_token_ids=stop_token_ids,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
    )


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    """How many top logprobs the engine must return per token for a chat request (None: no logprobs)."""
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def chat_max_tokens(request: ChatCompletionRequest) -> int | None:
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


# ---------------------------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageInfo(Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(Struct, kw_only=True):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class Logprob(Struct, kw_only=True):
    """vLLM's Logprob: one token's entry in a `prompt_logprobs` position (rank 1 = the most likely token)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: Logprob} (the token and its top k)
PromptLogprobs = list[dict[int, Logprob] | None]
# what a server response carries: the same list already encoded, a slice at a time (frontend/prompt_logprobs.py)
PromptLogprobsField = PromptLogprobs | msgspec.Raw | UnsetType


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobsField = UNSET


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | UnsetType = UNSET


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(Struct, kw_only=True):
    name: str | UnsetType = UNSET  # in a call's first delta
    arguments: str = ""


class DeltaToolCall(Struct, kw_only=True):
    index: int
    id: str | UnsetType = UNSET  # id and type: in a call's first delta
    type: str | UnsetType = UNSET
    function: DeltaFunctionCall


class AssistantMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None | UnsetType = UNSET  # with --reasoning-parser
    tool_calls: list[ToolCall] | UnsetType = UNSET  # parsed tool calls, when there are any


class ChatChoice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField = UNSET


class DeltaMessage(Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatStreamChoice(Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


# ---------------------------------------------------------------------------------------------- embeddings


class EmbeddingRequest(Struct, kw_only=True):
    """OpenAI's embeddings request, plus vLLM's extensions (truncate_prompt_tokens, add_special_tokens, priority)."""

    # a string, a list of strings, a list of token ids, or a list of token-id lists (checked in `embedding_inputs`)
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None  # last N tokens; -1: max_model_len
    add_special_tokens: bool = True
    priority: Int64 = 0


class EmbeddingData(Struct, kw_only=True):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 bytes


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
