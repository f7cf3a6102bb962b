"""Indexer warm-up: the KL loss, the recall metric, and that training moves the indexer alone."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.training.indexer import (indexer_kl_loss, indexer_scores_and_target, peaked_layer,
                                            synthetic_hidden_states, topk_recall, train_indexer)


def _causal_distribution(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq_len, seq_len, generator=gen)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def test_kl_is_zero_when_scores_are_the_log_of_the_dense_mass():
    target = _causal_distribution(2, 7)
    target[0, 5, :3] = 0.0  # exact zeros in the target contribute nothing
    target = target / target.sum(-1, keepdim=True)
    assert indexer_kl_loss(target.log(), target).abs() < 1e-6
    assert indexer_kl_loss(target.log() + 3.0, target).abs() < 1e-6  # a constant shift per row changes nothing
    assert indexer_kl_loss(torch.zeros_like(target), target) > 0.05


def test_kl_ignores_scores_above_the_diagonal_and_has_finite_gradients():
    target = _causal_distribution(1, 6)
    scores = target.log().clamp(min=-50.0).requires_grad_()  # -50 stands in above the diagonal
    loss = indexer_kl_loss(scores, target)
    loss.backward()
    assert loss.abs() < 1e-5 and torch.isfinite(scores.grad).all()
    assert (scores.grad.triu(diagonal=1) == 0).all()


def test_recall_counts_the_target_mass_inside_the_top_k():
    target = _causal_distribution(2, 10)
    assert topk_recall(target, target, 10) != topk_recall(target, target, 10)  # no query sees more than 10: nan
    assert topk_recall(target.log(), target, 3) > topk_recall(-target, target, 3)
    perfect = topk_recall(target, target, 9)  # only query 9 sees 10 keys; its best 9 miss just the smallest
    assert 0.8 < perfect < 1.0


def test_training_updates_only_the_indexer_and_raises_recall():
    layer = peaked_layer(ModelConfig.from_preset("tiny"))
    frozen = {name: p.clone() for name, p in layer.named_parameters() if not name.startswith("indexer.")}
    history = train_indexer(layer, steps=12, batch=2, seq_len=64, log_every=6)
    assert history.steps == [0, 6, 12]
    assert history.recall[-1] > history.recall[0] and history.loss[-1] < history.loss[0]
    for name, p in layer.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


def test_the_indexer_input_is_detached():
    layer = peaked_layer(ModelConfig.from_preset("tiny"))
    x = synthetic_hidden_states(64, 1, 40).requires_grad_()
    scores, target = indexer_scores_and_target(layer, x)
    indexer_kl_loss(scores, target).backward()
    assert x.grad is None and layer.wq_a.weight.grad is None
    assert layer.indexer.wq.weight.grad is not None


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"scores, target: expected the same shape \[B, T, T\]"):
        indexer_kl_loss(torch.zeros(1, 3, 3), torch.zeros(1, 3, 4))
