"""The worker's LoRA adapters: a fixed pool of `max_loras` device slots, and an LRU host cache of `max_cpu_loras`
adapters read from disk.

Each step the worker asks for the slots of its requests' adapters (`assign_slots`): an adapter already in a slot
keeps it; another is copied in (from the host cache, else read from its folder) over an empty slot or the least
recently used slot that no request of this step needs. The scheduler never schedules more distinct adapters in a
step than there are slots; a step that does is refused here (ValueError), before any slot changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from tokenmill.config import LoRAConfig
from tokenmill.messages import LoRARequest
from tokenmill.workers.lora.adapter import LoRAAdapter, load_adapter
from tokenmill.workers.lora.punica import LoRAStep
from tokenmill.workers.lora.slots import LoRALinearSlots, attach_lora_slots
from tokenmill.workers.models.llama import PagedCausalLM

BASE_SLOT = -1  # the token slot of requests on the base model
_NARROW_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def slot_dtype(config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The slot weights' dtype (vLLM's --lora-dtype): "auto" is the model's."""
    return _NARROW_DTYPES.get(config.lora_dtype, model_dtype)


class LoRAManager:
    def __init__(self, model: PagedCausalLM, config: LoRAConfig, num_layers: int, dtype: torch.dtype) -> None:
        """Attach slots to `model`'s layers (`dtype`: the activations'); call it under the model's default device and
        the slots' dtype (`slot_dtype`)."""
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self.max_cpu_loras = max(config.max_cpu_loras or config.max_loras, config.max_loras)
        self.num_layers = num_layers
        self.dtype = dtype
        self.step = LoRAStep(config.max_loras)
        self.layers: list[LoRALinearSlots] = attach_lora_slots(model, config.max_loras, config.max_lora_rank, self.step)
        self.served = {(layer.layer, piece.projection) for layer in self.layers for piece in layer.slices}
        self.slot_ids: list[int | None] = [None] * config.max_loras  # lora_int_id in each slot
        self.slot_last_used = [0] * config.max_loras  # step counter of each slot's last use
        self.steps = 0
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, least recent first
        self.loads_from_disk = 0  # how many times an adapter was read (tests check the host cache)

    def assign_slots(self, requests: Sequence[LoRARequest | None]) -> list[int]:
        """Each request's slot (BASE_SLOT without an adapter), loading the adapters that are not in one."""
        self.steps += 1
        wanted: dict[int, LoRARequest] = {}
        for request in requests:
            if request is not None:
                wanted.setdefault(request.lora_int_id, request)
        if len(wanted) > self.max_loras:
            raise ValueError(
                f"a step uses {len(wanted)} distinct LoRA adapters but max_loras={self.max_loras} slots exist"
            )
        slot_of = {lora_id: slot for slot, lora_id in enumerate(self.slot_ids) if lora_id in wanted}
        for lora_id, request in wanted.items():
            if lora_id not in slot_of:
                slot_of[lora_id] = self._load_into_free_slot(request, set(slot_of.values()))
        for slot in slot_of.values():
            self.slot_last_used[slot] = self.steps
        return [BASE_SLOT if request is None else slot_of[request.lora_int_id] for request in requests]

    def begin_step(self, token_slots: torch.Tensor | None) -> None:
        """The coming forward's slot per token (None: no request of the step has an adapter)."""
        self.step.set(token_slots, self.dtype)

    def record_steps(self, max_tokens: int) -> None:
        """Before recording CPU steps (`workers/cpu_graphs.py`): every LoRA layer's kernel call reads the step's
        grouping from fixed buffers, which `stage_recorded_step` fills before each replay; `begin_step` after."""
        self.step.record_staged(max_tokens)

    def stage_recorded_step(self, token_slots: torch.Tensor | None) -> None:
        """The slot per token of a step about to replay a recording (None: no adapter token)."""
        self.step.stage(token_slots)

    def _load_into_free_slot(self, request: LoRARequest, taken: set[int]) -> int:
        adapter = self._adapter(request)
        free = [slot for slot in range(self.max_loras) if slot not in taken]
        slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self.slot_last_used[s]))  # empty, else LRU
        self.slot_ids[slot] = None  # half-written until every layer has the new adapter
        for layer in self.layers:
            layer.write(slot, adapter)
        self.slot_ids[slot] = request.lora_int_id
        return slot

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter from the host cache (now most recent), else read from its folder into it."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is not None:
            self.host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.max_lora_rank, self.num_layers)
        missing = sorted(key for key in adapter.pairs if key not in self.served)
        if missing:
            layer, projection = missing[0]
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} targets layer {layer} {projection}, which this model cannot "
                "apply an adapter to"
            )
        self.loads_from_disk += 1
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter
