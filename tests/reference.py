"""Greedy-decoding references from Hugging Face models, and the comparison our engine's output must pass.

Float32 kernels differ in summation order, so where the reference's top two logits nearly tie either token is a
correct answer; from such a step on the two continuations may legitimately diverge, so comparison stops there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEAR_TIE_MARGIN = 1e-4


@torch.no_grad()
def hf_greedy_reference(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[tuple[int, float]]:
    """`model.generate(do_sample=False)` from `prompt_ids`: per new token, (token id, top-1 minus top-2 logit)."""
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
    reference = []
    for token, step_logits in zip(tokens, out.logits):
        top2 = step_logits[0].float().topk(2).values
        reference.append((token, float(top2[0] - top2[1])))
    return reference


def assert_greedy_match(ours: Sequence[int], reference: Sequence[tuple[int, float]]) -> int:
    """Assert `ours` equals the reference token by token up to its first near tie; returns how many were compared.

    `ours` may run longer than the reference (which stops at EOS). It may end one token short of the reference only
    when that token is the reference's last, i.e. the EOS it stopped on (an engine may not list the stop token).
    """
    for step, (token, margin) in enumerate(reference):
        if margin < NEAR_TIE_MARGIN:
            return step
        if step == len(ours) and step == len(reference) - 1:
            return step
        assert step < len(ours), f"ours stopped after {len(ours)} tokens; the reference continues with {token}"
        assert ours[step] == token, (
            f"token {step} differs: ours {ours[step]}, reference {token} (reference margin {margin:.3g}); "
            f"ours {list(ours)}, reference {[t for t, _ in reference]}"
        )
    return len(reference)
