"""The scheduler's side of draft-model speculation (`{"method": "draft_model", ...}`).

The workers' draft model (workers/draft_proposer.py) proposes up to k tokens after every sampled request's newest
token and returns them with the step's result (`StepResult.draft_token_ids`); the scheduler keeps a request's latest
proposal and schedules it with the request's next decode step, if the request may speculate and its tokens have not
changed since. Draft-model proposals cost a draft forward whether used or not, so there is no n-gram style back-off:
every proposal is verified, cut only to what the budget, max_tokens and the context allow.

The draft writes its KV up to k positions past a request's tokens while proposing: `lookahead_slots` asks the
scheduler for those slots (vLLM's num_lookahead_slots) with every step that reaches a request's end.
"""

from __future__ import annotations

from tokenmill.scheduler.request import Request
from tokenmill.scheduler.spec_decode import SpecDecodeState, Speculator


class DraftModelState(SpecDecodeState):
    """A request's speculation state with the draft model's latest proposal."""

    __slots__ = ("proposal", "proposed_at")

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.proposal: list[int] = []
        self.proposed_at = -1  # the request's token count the proposal follows


class DraftModelSpeculator(Speculator):
    """Schedules the workers' draft-model proposals; counters and `allowed` as every Speculator."""

    @property
    def lookahead_slots(self) -> int:
        return self.k

    def propose(self, req: Request, limit: int) -> list[int]:
        if not self.allowed(req) or not isinstance(req.spec, DraftModelState):
            return []
        state = req.spec
        if state.proposed_at != req.num_tokens or limit <= 0:
            return []
        proposal, state.proposal, state.proposed_at = state.proposal, [], -1  # used once
        return proposal[:limit]

    def receive(self, req: Request, proposal: list[int]) -> None:
        """The draft model's proposal after the request's newest token (just appended from the same result)."""
        if not proposal or not self.allowed(req):
            return
        if not isinstance(req.spec, DraftModelState):
            req.spec = DraftModelState(self.k)
        req.spec.proposal = list(proposal)
        req.spec.proposed_at = req.num_tokens
