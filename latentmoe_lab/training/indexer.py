"""Lightning-indexer warm-up (docs/design.md §1.4): teach the indexer to rank keys the way dense attention does.

For each query t the teacher is the dense attention mass summed over heads and L1-normalised,
p_t = sum_h A_h[t, :] / H, and the student is q_t = softmax over the causal keys of the index
scores I_t. The loss is

    KL(p_t || q_t) = sum_{s <= t} p_ts (log p_ts - log q_ts),   averaged over queries,

and it is zero exactly when I_t equals log p_t up to a constant. The indexer reads detached inputs
(x and c_q), so this loss trains the indexer alone and never moves the main attention. Progress is
measured as top-k recall: the share of the dense attention mass that falls inside the indexer's
top-k positions, over the queries that see more than k keys (the others keep every key).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.ops.sparse_attention import select_topk


def indexer_kl_loss(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) over causal keys, mean over queries.

    scores: [B, T, T] index scores (any real numbers); target: [B, T, T] rows summing to 1 over s <= t.
    Scores above the diagonal are ignored; a zero target entry contributes nothing.
    """
    if scores.shape != target.shape or scores.dim() != 3 or scores.shape[1] != scores.shape[2]:
        raise ValueError(f"scores, target: expected the same shape [B, T, T], got {tuple(scores.shape)} "
                         f"and {tuple(target.shape)}")
    causal = torch.ones(scores.shape[1], scores.shape[1], dtype=torch.bool, device=scores.device).tril()
    log_student = torch.log_softmax(scores.float().masked_fill(~causal, float("-inf")), dim=-1)
    target = target.float()
    # where() rather than xlogy: 0 * log(0) and 0 * -inf (masked keys) must both count as 0.
    terms = torch.where(target > 0, target * (target.log() - log_student), 0.0)
    return terms.sum(dim=-1).mean()


def topk_recall(scores: torch.Tensor, target: torch.Tensor, k: int) -> float:
    """Mean share of the target mass inside the causal top-k of `scores`, over queries seeing more than k keys.

    scores, target: [B, T, T]. Returns nan when no query sees more than k keys.
    """
    selected = select_topk(scores, k)  # [B, T, k], -1 pads
    mass = torch.where(selected >= 0, target.gather(-1, selected.clamp(min=0)), 0.0).sum(dim=-1)  # [B, T]
    return mass[:, k:].mean().item() if scores.shape[1] > k else float("nan")


def synthetic_hidden_states(hidden_size: int, batch: int, seq_len: int, vocab: int = 32,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, T, hidden] inputs with content structure: embeddings of random ids from a small vocabulary plus noise.

    Repeated ids give dense attention something to find, which a random-noise input would not.
    """
    embed_gen = torch.Generator().manual_seed(1234)  # the same vocabulary in every batch
    table = torch.randn(vocab, hidden_size, generator=embed_gen)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    return table[ids] + 0.3 * torch.randn(batch, seq_len, hidden_size, generator=generator)


def peaked_layer(config: ModelConfig, sharpness: float = 6.0, seed: int = 0) -> GatedDSA:
    """A fresh GatedDSA whose query projection W_qb is scaled by `sharpness`, so attention logits are that
    much larger: a stand-in for the peaky heads of a trained model. At random init attention is near
    uniform, which leaves the indexer nothing to learn."""
    torch.manual_seed(seed)
    layer = GatedDSA(config)
    with torch.no_grad():
        layer.wq_b.weight.mul_(sharpness)
    return layer


@dataclass
class IndexerHistory:
    """Per logged step: the KL loss and the top-k recall, both on one fixed held-out batch."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    recall: list[float] = field(default_factory=list)


def indexer_scores_and_target(layer: GatedDSA, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T, hidden] -> (index scores [B, T, T] with grad to the indexer only, teacher mass [B, T, T])."""
    with torch.no_grad():
        target = layer.attention_probs(x).sum(dim=1)
        target = target / target.sum(dim=-1, keepdim=True)  # L1-normalise the head sum
        c_q = layer.q_norm(layer.wq_a(x))
    x, c_q = x.detach(), c_q.detach()  # the indexer's input is cut off from the main model
    return layer.indexer.scores(x, c_q, layer.indexer.keys(x)), target


def train_indexer(layer: GatedDSA, steps: int = 200, batch: int = 4, seq_len: int = 128, lr: float = 3e-3,
                  log_every: int = 10, seed: int = 0) -> IndexerHistory:
    """Adam on the indexer's parameters only, fresh synthetic batches each step; returns the logged curve."""
    generator = torch.Generator().manual_seed(seed)
    held_out = synthetic_hidden_states(layer.hidden_size, batch, seq_len, generator=generator)
    optimizer = torch.optim.Adam(layer.indexer.parameters(), lr=lr)
    history = IndexerHistory()
    for step in range(steps + 1):
        if step % log_every == 0 or step == steps:
            with torch.no_grad():
                scores, target = indexer_scores_and_target(layer, held_out)
            history.steps.append(step)
            history.loss.append(indexer_kl_loss(scores, target).item())
            history.recall.append(topk_recall(scores, target, layer.indexer.topk))
        if step == steps:
            break
        x = synthetic_hidden_states(layer.hidden_size, batch, seq_len, generator=generator)
        scores, target = indexer_scores_and_target(layer, x)
        loss = indexer_kl_loss(scores, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return history
