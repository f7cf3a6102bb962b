"""The batched MTP drafter: every drafting request of a step through one forward of each MTP depth.

Same drafts as the serial drafter (mtp_drafter.py, its reference twin; tests/test_spec_mtp_batched.py):
with L tokens the target has run positions 0 .. t = L - 2, and depth k at position s reads h_{k-1}[s] and
y[s + k] (y: the tokens, then the drafts so far). Per request depth k has n_k committed rows (those whose
y[s + k] is a real token: n_k = L - k after a propose), and for depth k <= the request's k the rows
n_k .. t whose token is a draft (depth 1 has none: y[t + 1] is the newest token). Both kinds of rows of a
depth are contiguous in position, so one paged forward of depth k takes, for every request, its new
committed rows and (when it drafts that deep) its provisional ones:

    depth 1 .. D:   rows [n_k_old, L - 1) per request (only [n_k_old, L - k) when it drafts fewer than k)
                    -> d_k = argmax LMHead(RMSNorm_k(h_k[t])) for the requests drafting >= k
    past depth D:   one more forward of depth D per draft, one row per request still drafting, at t + j,
                    reading its own previous output and the previous draft

as the target batches its sequences (forward_batch.py): x [1, rows of every request, d] over DraftPools,
DSA's batched decode for one-row requests and its chunked form for the others. A provisional row is
written past n_k, where no committed row reads it, and the next propose overwrites it: no truncation.
Between proposes a request keeps, per depth k < D, the committed h_k rows depth k + 1 has not consumed yet
(one row in steady state), not the whole history. k = 0 commits a request's rows and drafts nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.serving.spec.draft_pools import DraftPools
from latentmoe_lab.serving.spec.drafters import DraftInput, Drafter
from latentmoe_lab.serving.spec.mtp_drafter import check_draft_input, check_mtp_model


@dataclass
class _Rows:
    """committed[k]: n_k (k = 0: the target's rows); tails[k] [n_k - n_{k+1}, d]: committed h_k rows that
    depth k + 1 has not read yet (k = 0 .. D - 1)."""

    committed: list[int]
    tails: list[torch.Tensor]


@dataclass
class _Request:
    """One request of a propose_batch: L = length tokens, y = the tokens then its drafts so far, k drafts
    wanted, and this propose's rows of the depth below from n_k on (for the depth about to run)."""

    request_id: int
    length: int
    y: list[int]
    k: int
    state: _Rows
    below: torch.Tensor


class BatchedMTPDrafter(Drafter):
    """Greedy drafts of `model.mtp` for many requests at once; the serial MTPDrafter's twin."""

    name = "mtp"

    def __init__(self, model, block_size: int = 16):
        check_mtp_model(model)
        self.model = model
        self.pools = DraftPools(model, block_size)
        self.states: dict[int, _Rows] = {}

    def release(self, request_id: int) -> None:
        self.states.pop(request_id, None)
        self.pools.release(request_id)

    def propose(self, request_id: int, draft_input: DraftInput, k: int) -> list[int]:
        return self.propose_batch([(request_id, draft_input, k)])[0]

    @torch.no_grad()
    def propose_batch(self, requests: list[tuple[int, DraftInput, int]]) -> list[list[int]]:
        """requests: (request_id, DraftInput(tokens, hidden), k) with distinct ids -> each one's k drafts
        (k = 0: its rows are committed, no draft)."""
        ids = [request_id for request_id, _, _ in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"requests: a request id appears twice in one batch: {ids}")
        for request in requests:  # every request checked before any state moves
            self._check(*request)
        batch = [self._admit(*request) for request in requests]
        count = len(self.model.mtp.depths)
        for depth_index in range(1, count + 1):
            self._run_depth(depth_index, batch)
        for step in range(1, max((r.k for r in batch), default=0) - count + 1):
            self._run_reused(step, [r for r in batch if r.k >= count + step])
        return [r.y[r.length:] for r in batch]

    def _check(self, request_id: int, draft_input: DraftInput, k: int) -> None:
        state = self.states.get(request_id)
        check_draft_input(self.model, request_id, draft_input, k, 0 if state is None else state.committed[0])

    def _admit(self, request_id: int, draft_input: DraftInput, k: int) -> _Request:
        """Appends the request's new target rows and reserves its blocks."""
        tokens, hidden, state = list(draft_input.tokens), draft_input.hidden, self.states.get(request_id)
        count = len(self.model.mtp.depths)
        if state is None:
            state = self.states[request_id] = _Rows([0] * (count + 1), [hidden[:0]] * count)
        state.committed[0] += hidden.shape[0]
        state.tails[0] = torch.cat([state.tails[0], hidden])
        # rows up to t in every depth, then t + 1 .. t + (k - D) in the last one, reused
        self.pools.reserve(request_id, len(tokens) - 1 + max(0, k - count))
        return _Request(request_id, len(tokens), tokens, k, state, below=state.tails[0])

    def _run_depth(self, depth_index: int, batch: list[_Request]) -> None:
        """One forward of depth k over every request's new committed rows [n_k, L - k) and, for a request
        drafting >= k, its provisional rows [L - k, L - 1); those requests append d_k to y."""
        depth, count = self.model.mtp.depths[depth_index - 1], len(self.model.mtp.depths)
        spans = []
        for r in batch:
            start = r.state.committed[depth_index]
            stop = r.length - 1 if r.k >= depth_index else max(start, r.length - depth_index)
            spans.append((r.request_id, start, stop - start))
        outputs = self._forward(depth_index, spans, [r.below[:n] for r, (_, _, n) in zip(batch, spans)],
                                [token for r, (_, start, n) in zip(batch, spans)
                                 for token in r.y[start + depth_index:start + n + depth_index]])
        picks = []
        for r, (_, start, _), rows in zip(batch, spans, outputs):
            state, committed_end = r.state, max(0, r.length - depth_index)  # the new n_k
            committed = committed_end - start  # rows whose token y[s + k] is real
            state.committed[depth_index] = committed_end
            state.tails[depth_index - 1] = state.tails[depth_index - 1][committed:]  # read by them: dropped
            if depth_index < count:  # h_k from n_{k+1} on for depth k + 1: its unread tail, then provisional
                state.tails[depth_index] = torch.cat([state.tails[depth_index], rows[:committed]])
                r.below = torch.cat([state.tails[depth_index], rows[committed:]])
            else:
                r.below = rows[-1:]  # h_D[t]: what the last depth, reused, reads first
            if r.k >= depth_index:
                picks.append((r, rows[-1]))
        self._pick(depth, picks)

    def _run_reused(self, step: int, batch: list[_Request]) -> None:
        """Draft D + j (j = step): the last depth again at t + j, one row per request, reading its own
        output at t + j - 1 and the draft before."""
        count = len(self.model.mtp.depths)
        spans = [(r.request_id, r.length - 2 + step, 1) for r in batch]
        outputs = self._forward(count, spans, [r.below for r in batch], [r.y[-1] for r in batch])
        for r, rows in zip(batch, outputs):
            r.below = rows
        self._pick(self.model.mtp.depths[-1], [(r, rows[-1]) for r, rows in zip(batch, outputs)])

    def _forward(self, depth_index: int, spans: list[tuple[int, int, int]], hidden: list[torch.Tensor],
                 tokens: list[int]) -> list[torch.Tensor]:
        """spans: (request_id, first position, rows n_i) per request; hidden[i] [n_i, d]; tokens: the y of
        every row, in order -> depth k's h rows [n_i, d] per request. Requests with no rows sit out."""
        live = [i for i, (_, _, n) in enumerate(spans) if n > 0]
        outputs = [h[:0] for h in hidden]
        if not live:
            return outputs
        device = self.pools.device
        batch = ForwardBatch.from_sequences([[0] * spans[i][2] for i in live], [spans[i][1] for i in live],
                                            [self.pools.tables[spans[i][0]] for i in live], [0] * len(live),
                                            self.pools.block_size, device=device)
        embeds = self.model.embed_tokens(torch.tensor([tokens], device=device))
        rows = self.model.mtp.depths[depth_index - 1](torch.cat([hidden[i] for i in live])[None], embeds,
                                                       batch=batch, pool=self.pools.pools[depth_index - 1])[0]
        cursor = 0
        for i in live:
            outputs[i], cursor = rows[cursor:cursor + spans[i][2]], cursor + spans[i][2]
        return outputs

    def _pick(self, depth, picks: list[tuple[_Request, torch.Tensor]]) -> None:
        """Each request's greedy draft from its row at t (or t + j): one LM-head product for all."""
        if not picks:
            return
        rows = torch.stack([row for _, row in picks])
        for (r, _), token in zip(picks, self.model.lm_head(depth.norm(rows)).argmax(dim=-1).tolist()):
            r.y.append(int(token))
