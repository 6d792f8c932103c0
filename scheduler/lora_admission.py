"""How many LoRA adapters the running batch holds: never more distinct ones than --max-loras (the workers' slots).

Requests of the base model do not count. The limit holds over the whole running batch (so over every step's), and
is kept at admission only: a running request is never preempted for an adapter (as vLLM). A waiting request whose
adapter would be one too many waits; so that a busy adapter cannot keep its slot forever while another waits behind
it (starvation), every adapter request after the first refused one, in policy order, waits too for that step: the
adapters running drain, a slot frees, and the refused request is next. Base requests keep being admitted meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.scheduler.request import Request


class LoRAAdmission:
    """One step's admission check; `max_loras` None: LoRA is off and nothing is limited."""

    def __init__(self, max_loras: int | None, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        # adapter ids of the running batch (not gathered when LoRA is off: this runs every step)
        self.active: set[int] = set()
        if max_loras is not None:
            self.active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        self.refused_one = False  # an adapter request was refused this step: later ones wait behind it

    def admits(self, request: Request) -> bool:
        """Whether the request may join the batch now, as far as adapters go (a refusal is remembered)."""
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        if not self.refused_one and (lora.lora_int_id in self.active or len(self.active) < self.max_loras):
            return True
        self.refused_one = True
        return False

    def add(self, request: Request) -> None:
        """The request joined the batch: its adapter holds a slot."""
        if request.lora_request is not None:
            self.active.add(request.lora_request.lora_int_id)


def adapter_names(requests: Iterable[Request]) -> list[str]:
    """The distinct adapter names of `requests`, sorted (vLLM's lora_requests_info labels)."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
