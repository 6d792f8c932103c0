"""Logprobs in OpenAI's two shapes: completions (parallel lists) and chat (one entry per token with its top list).

The engine sends, per sampled token, (its logprob, top ids, top logprobs); token ids become text here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.frontend.outputs import TokenLogprobs
from tokenmill.frontend.protocol import ChatLogprobEntry, ChatLogprobs, CompletionLogProbs, TopLogprob


class TokenTexts:
    """Each token id's own text, decoded once (special tokens included: logprobs name every token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __getitem__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs], texts: TokenTexts, text_offset: int
) -> tuple[CompletionLogProbs, int]:
    """Completions logprobs for these tokens, their text offsets starting at `text_offset`; also the next offset."""
    result = CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for token_id, (logprob, top_ids, top_logprobs) in zip(token_ids, entries):
        token = texts[token_id]
        result.tokens.append(token)
        result.token_logprobs.append(logprob)
        result.text_offset.append(text_offset)
        top = {texts[i]: lp for i, lp in zip(top_ids, top_logprobs)}
        top.setdefault(token, logprob)  # the sampled token is always listed, as vLLM does
        result.top_logprobs.append(top)
        text_offset += len(token)
    return result, text_offset


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs], texts: TokenTexts, num_top: int
) -> ChatLogprobs:
    content: list[ChatLogprobEntry] = []
    for token_id, (logprob, top_ids, top_logprobs) in zip(token_ids, entries):
        token = texts[token_id]
        top = [
            TopLogprob(token=texts[i], logprob=lp, bytes=list(texts[i].encode()))
            for i, lp in zip(top_ids[:num_top], top_logprobs[:num_top])
        ]
        content.append(ChatLogprobEntry(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)
