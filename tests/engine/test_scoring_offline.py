"""Sequence classifiers through the offline API against their references, float32 on random-weight checkpoints
built from real configs: BERT and XLM-R cross-encoders against sentence-transformers' CrossEncoder.predict, label
probabilities against transformers' softmax, a decoder reranker scored from its yes/no tokens (--hf-overrides)
against transformers' causal LM computing sigmoid(logit_yes - logit_no)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.cross_encoders import build_bert_cross_encoder, build_xlmr_cross_encoder
from tokenmill.llm import LLM

QUERY = "how does paged attention store the KV cache?"
DOCUMENTS = [
    "Paged attention stores keys and values in fixed-size blocks allocated on demand.",
    "The cat sat on the mat.",
    "Blocks",
    "A prefix cache shares the blocks of a common prompt prefix between requests, " * 4,
]
QWEN3_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("classifiers")


def cross_encoder_scores(path, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu").predict(pairs, batch_size=len(pairs))


@pytest.mark.parametrize("build", [build_bert_cross_encoder, build_xlmr_cross_encoder], ids=["bert", "xlm-roberta"])
def test_scores_equal_cross_encoder_predict(root, build):
    path = build(root)
    pairs = [(QUERY, doc) for doc in DOCUMENTS] + [("hi", "hello there"), ("Blocks", QUERY)]
    want = cross_encoder_scores(path, pairs)
    assert np.ptp(want) > 1e-3  # random weights still separate the pairs: the comparison means something
    with LLM(str(path), dtype="float32") as llm:
        assert llm.config.model.task == "score"  # auto-detected from the architecture
        one_to_many = llm.score(QUERY, DOCUMENTS)
        pairwise = llm.score([a for a, _ in pairs], [b for _, b in pairs])
    got = np.array([r.outputs.score for r in pairwise])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose([r.outputs.score for r in one_to_many], want[: len(DOCUMENTS)], atol=1e-4, rtol=0)


def test_classify_probs_equal_transformers_softmax(root):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = build_bert_cross_encoder(root, num_labels=3)
    texts = [QUERY, *DOCUMENTS]
    reference = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    batch = AutoTokenizer.from_pretrained(path)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.softmax(reference(**batch).logits, dim=-1).numpy()
    with LLM(str(path), dtype="float32", task="classify") as llm:
        results = llm.classify(texts)
        with pytest.raises(ValueError, match="single-label"):
            llm.score(QUERY, DOCUMENTS)  # three labels: no relevance score
    got = np.array([r.outputs.probs for r in results])
    assert got.shape == (len(texts), 3) and results[0].outputs.num_classes == 3
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_decoder_reranker_from_yes_no_logits(root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_checkpoint("qwen3", root)
    tokenizer = AutoTokenizer.from_pretrained(path)
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(str(path), dtype="float32", task="score", hf_overrides=QWEN3_RERANKER) as llm:
        results = llm.score(QUERY, DOCUMENTS)
    want = []
    for result in results:
        with torch.no_grad():
            logits = reference(torch.tensor([result.prompt_token_ids])).logits[0, -1]
        want.append(torch.sigmoid(logits[yes] - logits[no]).item())
    assert results[0].prompt_token_ids == tokenizer(QUERY, text_pair=DOCUMENTS[0])["input_ids"]
    assert np.ptp(want) > 1e-3
    np.testing.assert_allclose([r.outputs.score for r in results], want, atol=1e-4, rtol=0)


def test_decoder_sequence_classifier_score_head(root):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    causal = build_tiny_checkpoint("qwen3", root)
    path = root / "qwen3-seq-cls"
    config = AutoConfig.from_pretrained(causal)
    config.architectures, config.num_labels, config.pad_token_id = ["Qwen3ForSequenceClassification"], 1, 0
    torch.manual_seed(1)
    reference = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    reference.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(causal).save_pretrained(path)
    with LLM(str(path), dtype="float32") as llm:  # auto-detected: task "score", the checkpoint's score.weight head
        results = llm.score(QUERY, DOCUMENTS)
    with torch.no_grad():
        want = [torch.sigmoid(reference(torch.tensor([r.prompt_token_ids])).logits[0, 0]).item() for r in results]
    assert np.ptp(want) > 1e-3
    np.testing.assert_allclose([r.outputs.score for r in results], want, atol=1e-4, rtol=0)
