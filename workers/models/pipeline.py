"""Pipeline parallelism's share of the model: which decoder layers (and which ends of the model) a stage holds.

The decoder layers are split into `size` contiguous ranges as even as possible; as in vLLM, the stages before the
last take the extra layers (the last also runs the final norm and the LM head). Stage 0 holds the embedding, the last
stage the final norm and the LM head; layers outside a stage's range are `MissingLayer` placeholders, so parameter
names (`model.layers.N...`) stay those of the checkpoint and each stage loads only the tensors it owns.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from torch import nn

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class PipelineStage(NamedTuple):
    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's decoder layers."""
        if num_layers < self.size:
            raise ValueError(f"num_hidden_layers={num_layers} is less than pipeline_parallel_size={self.size}")
        counts = [num_layers // self.size] * self.size
        for stage in range(num_layers % self.size):  # the extra layers go to the stages just before the last
            counts[-2 - stage] += 1
        start = sum(counts[: self.rank])
        return start, start + counts[self.rank]

    def weight_name(self, name: str, num_layers: int, tied_embeddings: bool) -> str | None:
        """The name a checkpoint tensor loads under on this stage, or None when another stage owns it.

        A tied LM head on a last stage that has no embedding loads the embedding's tensor into its own weight.
        """
        if self.size == 1:
            return name
        match = _LAYER_INDEX.search(name)
        if match is not None:
            start, end = self.layer_range(num_layers)
            return name if start <= int(match.group(1)) < end else None
        if "embed_tokens." in name:
            if self.is_first:
                return name
            return "lm_head.weight" if tied_embeddings and self.is_last and name.endswith(".weight") else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.is_last else None
        return name


class MissingLayer(nn.Identity):
    """A decoder layer (or embedding, norm) that another pipeline stage holds: no parameters, never called."""
