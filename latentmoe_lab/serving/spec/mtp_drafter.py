"""The MTP drafter: the model's multi-token prediction head (latentmoe_lab/mtp.py) proposes greedy drafts.

With L tokens, the target has run positions 0 .. t = L - 2 and x[L - 1] is its newest token. Depth k at
position s reads h_{k-1}[s] and the token y[s + k], where y is the tokens followed by the drafts so far:

    d_k = argmax LMHead(RMSNorm_k(h_k[t]))      k = 1 .. min(K, mtp_depth)   (chained depths)

Past the last depth D, depth D is reused autoregressively: its row at t + j (j >= 1) reads its own output
h_D[t + j - 1] in place of h_{D-1}[t + j] and the token y[t + j + D], and proposes d_{D + j}.

Per request each depth keeps a DSALayerCache of its committed rows (those whose token y[s + k] is a real
token, s + k <= L - 1) and their outputs h_k (the next depth's input). A propose runs only the new
committed rows, then the provisional rows that read drafts, then truncates every cache back to its
committed rows: nothing a draft wrote survives. k = 0 commits the new rows and drafts nothing. The test
twin recomputes every depth from scratch (tests/test_spec_drafters.py). This drafter runs one request at a
time; the engine runs its batched twin, mtp_batched.py (tested equal to this one).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.serving.spec.drafters import DraftInput, Drafter


def check_draft_input(model, request_id: int, draft_input: DraftInput, k: int, held: int) -> None:
    """Both MTP drafters' checks of one proposal: k >= 0, hidden rows [n, hidden_size], and that they continue
    the `held` positions the drafter already has for the request (held + n == len(tokens) - 1)."""
    tokens, hidden = draft_input.tokens, draft_input.hidden
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k: must be an integer >= 0, got {k!r}")
    size = model.config.hidden_size
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != size:
        raise ValueError(f"draft_input.hidden: expected the target's hidden rows [n, {size}], got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    run = hidden.shape[0] + held
    if len(tokens) < 2 or run != len(tokens) - 1:
        raise ValueError(f"draft_input.hidden: the target has run {run} positions of request {request_id}, "
                         f"expected len(tokens) - 1 = {len(tokens) - 1} (at least 1)")


def check_mtp_model(model) -> None:
    """ValueError naming speculative.method unless the model has an MTP head."""
    if getattr(model, "mtp", None) is None:
        raise ValueError("speculative.method: 'mtp' needs a model with an MTP head (config.mtp_depth > 0), "
                         f"this one has mtp_depth {model.config.mtp_depth}")


@dataclass
class _RequestState:
    """hidden[k]: h_k rows [1, n_k, d] for the committed positions (hidden[0]: the target's); caches[k - 1]:
    depth k's DSA cache over the same committed rows of h_k."""

    hidden: list[torch.Tensor]
    caches: list[DSALayerCache] = field(default_factory=list)


class MTPDrafter(Drafter):
    """Greedy drafts from `model.mtp` (chained depths, then the last depth reused); one state per request."""

    name = "mtp"

    def __init__(self, model):
        check_mtp_model(model)
        self.model = model
        self.states: dict[int, _RequestState] = {}

    def release(self, request_id: int) -> None:
        self.states.pop(request_id, None)

    @torch.no_grad()
    def propose(self, request_id: int, draft_input: DraftInput, k: int) -> list[int]:
        tokens, depths, hidden = list(draft_input.tokens), self.model.mtp.depths, draft_input.hidden
        state = self.states.get(request_id)
        check_draft_input(self.model, request_id, draft_input, k,
                          0 if state is None else state.hidden[0].shape[1])
        if state is None:
            state = self.states[request_id] = _RequestState(
                hidden=[hidden[:0][None]] * (len(depths) + 1), caches=[DSALayerCache() for _ in depths])
        state.hidden[0] = torch.cat([state.hidden[0], hidden[None]], dim=1)
        ids = torch.tensor(tokens, device=state.hidden[0].device)[None]
        for depth_index, depth in enumerate(depths, start=1):  # committed rows: real tokens only
            done, ready = state.hidden[depth_index].shape[1], len(tokens) - depth_index
            if ready > done:
                rows = depth(state.hidden[depth_index - 1][:, done:ready],
                             self.model.embed_tokens(ids[:, done + depth_index:ready + depth_index]),
                             state.caches[depth_index - 1])
                state.hidden[depth_index] = torch.cat([state.hidden[depth_index], rows], dim=1)
        try:
            return self._draft(state, ids, k)
        finally:
            for depth_index, cache in enumerate(state.caches, start=1):
                cache.truncate(state.hidden[depth_index].shape[1])

    def _draft(self, state: _RequestState, ids: torch.Tensor, k: int) -> list[int]:
        """d_1 .. d_k from the provisional rows; each depth's cache grows past its committed rows."""
        depths, embed, last = self.model.mtp.depths, self.model.embed_tokens, ids.shape[1] - 2
        drafts: list[int] = []
        below = state.hidden[0]  # rows 0 .. last of the depth below (committed, then provisional)
        for depth_index, depth in enumerate(depths[:k], start=1):
            rows = state.hidden[depth_index]
            start = rows.shape[1]  # the first position whose token y[s + depth_index] is a draft
            if start <= last:
                y = torch.cat([ids, ids.new_tensor([drafts])], dim=1)
                provisional = depth(below[:, start:], embed(y[:, start + depth_index:last + 1 + depth_index]),
                                    state.caches[depth_index - 1])
                rows = torch.cat([rows, provisional], dim=1)
            below = rows
            drafts.append(self._pick(depth, rows[:, last]))
        reused, previous = depths[-1], below[:, last:last + 1]
        while len(drafts) < k:  # past the last depth: its own output stands in for the depth below
            previous = reused(previous, embed(ids.new_tensor([[drafts[-1]]])), state.caches[-1])
            drafts.append(self._pick(reused, previous[:, -1]))
        return drafts

    def _pick(self, depth, hidden_row: torch.Tensor) -> int:
        return int(self.model.lm_head(depth.norm(hidden_row)).argmax(dim=-1)[0])

