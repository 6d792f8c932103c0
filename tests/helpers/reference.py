"""Greedy-decoding references from Hugging Face models, and the comparison our engine's output must pass.

Float32 kernels differ in summation order, so where the reference's top two logits nearly tie either token is a
correct answer; from such a step on the two continuations may legitimately diverge, so comparison stops there.
"""

from __future__ import annotations

from collections.abc import Sequence

import requests
import torch

from tests.helpers.checkpoints import SMOLLM2_GGUF, smollm2_dir

NEAR_TIE_MARGIN = 1e-4
CLOSE_TOP_K = 5  # vLLM's check_logprobs_close default


@torch.no_grad()
def hf_greedy_logits(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[tuple[int, torch.Tensor]]:
    """`model.generate(do_sample=False)` from `prompt_ids`: per new token, (token id, that step's logits)."""
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    return [(token, step_logits[0]) for token, step_logits in zip(tokens, out.logits)]


def hf_greedy_reference(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[tuple[int, float]]:
    """Per new greedy token, (token id, top-1 minus top-2 logit)."""
    reference = []
    for token, logits in hf_greedy_logits(model, prompt_ids, max_new_tokens):
        top2 = logits.float().topk(2).values
        reference.append((token, float(top2[0] - top2[1])))
    return reference


def hf_greedy_top_ids(model, prompt_ids: Sequence[int], max_new_tokens: int, k: int = CLOSE_TOP_K) -> list:
    """Per new greedy token, (token id, the ids of that step's top `k` logits), for `assert_greedy_close`."""
    steps = hf_greedy_logits(model, prompt_ids, max_new_tokens)
    return [(token, logits.float().topk(k).indices.tolist()) for token, logits in steps]


def assert_greedy_close(
    ours: Sequence[int], our_top_ids: Sequence[Sequence[int]], reference: Sequence[tuple[int, Sequence[int]]]
) -> int:
    """vLLM's `check_logprobs_close`, for reduced precision (bf16 logits tie at a far coarser grain than 1e-4): the
    tokens are equal up to the first step where they differ; there each side's token must be among the other's top
    k, and comparison stops. Returns how many steps were compared (the differing one included)."""
    for step, (token, reference_top) in enumerate(reference):
        if step == len(ours) and step == len(reference) - 1:
            return step  # the reference's EOS, which an engine may not list
        assert step < len(ours), f"ours stopped after {len(ours)} tokens; the reference continues with {token}"
        if ours[step] == token:
            continue
        assert ours[step] in reference_top and token in our_top_ids[step], (
            f"token {step} differs beyond the top {len(reference_top)}: ours {ours[step]} (reference top "
            f"{list(reference_top)}), reference {token} (our top {list(our_top_ids[step])})"
        )
        return step + 1
    return len(reference)


def assert_greedy_match(
    ours: Sequence[int], reference: Sequence[tuple[int, float]], near_tie: float = NEAR_TIE_MARGIN
) -> int:
    """Assert `ours` equals the reference token by token up to its first near tie (top-2 logits within `near_tie`);
    returns how many were compared.

    `ours` may run longer than the reference (which stops at EOS). It may end one token short of the reference only
    when that token is the reference's last, i.e. the EOS it stopped on (an engine may not list the stop token).
    """
    for step, (token, margin) in enumerate(reference):
        if margin < near_tie:
            return step
        if step == len(ours) and step == len(reference) - 1:
            return step
        assert step < len(ours), f"ours stopped after {len(ours)} tokens; the reference continues with {token}"
        assert ours[step] == token, (
            f"token {step} differs: ours {ours[step]}, reference {token} (reference margin {margin:.3g}); "
            f"ours {list(ours)}, reference {[t for t, _ in reference]}"
        )
    return len(reference)


TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "In 1905, Albert Einstein published four papers that changed physics. The first one explained",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List three fruits:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his "
    "daughter. Every morning the woodcutter walked into the forest with his axe, and every evening he came back",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: I like green apples and long walks on the beach, especially in the early morning.",
]


def load_reference_model(family: str, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    if family == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints(family), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos: so must the reference
    return model.eval()


def complete_ids(url: str, prompt: list[int], max_tokens: int = 32, **extra) -> list[int]:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    response = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]
