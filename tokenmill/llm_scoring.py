"""The offline API of sequence classifiers: `LLM(model, task="score").score(text_1, text_2)` and `.classify(texts)`,
returning vLLM-shaped results (`ScoringRequestOutput`: `.outputs.score`; `ClassificationRequestOutput`:
`.outputs.probs`).

Pairs and their tokens are made exactly as the server makes them (`frontend/score_pairs.py`); the engine runs every
request whole in one step and answers with the activated logits as float32 bytes (`workers/scoring_runner.py`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from tokenmill.frontend.score_pairs import EncodedPair, encode_pairs, encode_single_texts, score_pairs
from tokenmill.messages import EngineRequest, SamplingParams

if TYPE_CHECKING:
    from tokenmill.llm import LLM


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringResult:
    """One pair's result (vLLM's ScoringRequestOutput)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationResult:
    """One text's result (vLLM's ClassificationRequestOutput)."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


def check_classifier(llm: LLM, method: str) -> None:
    task = llm.config.model.task
    if task not in ("classify", "score"):
        raise ValueError(
            f"{method}() needs a sequence classifier (task 'score' or 'classify'); "
            f"{llm.config.model.served_model_name} serves '{task}'"
        )


def score(
    llm: LLM, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate_prompt_tokens: int | None
) -> list[ScoringResult]:
    """One score per pair (1:N or N:N, as the /score endpoint), as sentence-transformers' CrossEncoder.predict."""
    check_classifier(llm, "score")
    pairs = score_pairs(
        text_1 if isinstance(text_1, str) else list(text_1), text_2 if isinstance(text_2, str) else list(text_2)
    )
    encoded = encode_pairs(llm.tokenizer, pairs, truncate_prompt_tokens)
    results = []
    for pair, values in zip(encoded, _run(llm, encoded, "score"), strict=True):
        if values.shape[0] != 1:
            raise ValueError(f"score() needs a single-label model; this one has {values.shape[0]} labels")
        results.append(ScoringResult(uuid.uuid4().hex, pair.token_ids, ScoringOutput(float(values[0]))))
    return results


def classify(llm: LLM, prompts: str | Sequence[str], truncate_prompt_tokens: int | None) -> list[ClassificationResult]:
    """Label probabilities per text (softmax; sigmoid for a single label)."""
    check_classifier(llm, "classify")
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    encoded = encode_single_texts(llm.tokenizer, texts, truncate_prompt_tokens)
    return [
        ClassificationResult(uuid.uuid4().hex, text, item.token_ids, ClassificationOutput(values.tolist()))
        for text, item, values in zip(texts, encoded, _run(llm, encoded, "classify"), strict=True)
    ]


def _run(llm: LLM, encoded: list[EncodedPair], task: Literal["score", "classify"]) -> list[np.ndarray]:
    arrival = time.time()
    requests = [
        EngineRequest(
            request_id=f"{task}-{uuid.uuid4().hex}",
            prompt_token_ids=item.token_ids,
            sampling=SamplingParams(max_tokens=None),
            task=task,
            arrival_time=arrival,
            second_segment_start=item.second_segment_start,
        )
        for item in encoded
    ]
    return [np.frombuffer(raw, dtype="<f4") for raw in llm.run_pooling_requests(requests)]
