"""What a prompt position's logprobs cost in forward tokens (WorkerReady.prompt_logprobs_row_cost): the LM head and
scoring over the vocabulary against the body's weights, the vocabulary tables left out of the body."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from tokenmill.workers.model_facts import SCORE_MACS_PER_LOGIT, body_weight_elements, prompt_logprobs_row_cost
from tokenmill.workers.models.registry import model_class

SHAPE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def llama(tied: bool) -> torch.nn.Module:
    config = AutoConfig.for_model("llama", num_key_value_heads=2, tie_word_embeddings=tied, **SHAPE)
    with torch.device("meta"):
        return model_class("LlamaForCausalLM")(config, max_model_len=128)


def expected_body() -> int:
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = hidden // 2  # 2 of 4 heads
    layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden  # qkv, o, mlp, 2 norms
    return SHAPE["num_hidden_layers"] * layer + hidden  # and the final norm


@pytest.mark.parametrize("tied", [False, True])
def test_the_body_leaves_out_the_embedding_and_the_lm_head(tied):
    assert body_weight_elements(llama(tied)) == expected_body()


def test_a_row_costs_the_head_and_scoring_over_the_body():
    cost = prompt_logprobs_row_cost(llama(False), SHAPE["vocab_size"], SHAPE["hidden_size"])
    assert cost == pytest.approx(1000 * (64 + SCORE_MACS_PER_LOGIT) / expected_body())
