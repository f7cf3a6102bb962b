"""The balancing comparison run: modes share weights and data, bias mode moves the bias, aux mode adds the loss."""
import pytest
import torch

from latentmoe_lab.training.balance import MODES, balance_config, compare_balancing, skewed_batches, train_balancing

SMALL_RUN = dict(steps=3, batch=2, seq_len=8, tail=2)


def _config(**moe):
    return balance_config("tiny", **moe).replace(num_layers=2)  # layer 0 dense FFN, layer 1 MoE


def test_skewed_batches_are_deterministic_and_skewed():
    a, b = next(skewed_batches(64, 4, 32, seed=1)), next(skewed_batches(64, 4, 32, seed=1))
    assert torch.equal(a, b) and a.shape == (4, 32) and a.dtype == torch.int64
    counts = torch.bincount(torch.cat([next(skewed_batches(64, 8, 64, seed=s)).reshape(-1) for s in range(4)]),
                            minlength=64)
    assert counts.max() > 3 * counts.float().mean()  # Zipf head


def test_modes_share_the_first_step_and_record_history():
    runs = compare_balancing(config=_config(aux_loss_alpha=0.05), **SMALL_RUN)
    assert list(runs) == list(MODES)
    first = [run.max_over_mean[0] for run in runs.values()]
    assert all(torch.equal(first[0], r) for r in first)  # same weights, same batch, same routing at step 0
    for run in runs.values():
        assert run.max_over_mean.shape == (3, 1) and run.loss.shape == (3,) and torch.isfinite(run.loss).all()
        assert run.final_counts.shape == (1, 8) and int(run.final_counts.sum()) == 2 * (2 * 8 * 2)
        assert run.layer_labels == ["layer 1"] and (run.max_over_mean >= 1).all()
    assert not torch.equal(runs["none"].loss, runs["aux"].loss)  # the aux gradient changed the weights


def test_bias_mode_is_the_only_one_that_moves_the_bias(monkeypatch):
    from latentmoe_lab.layers.moe import LatentMoE

    calls = []
    real = LatentMoE.update_bias
    monkeypatch.setattr(LatentMoE, "update_bias", lambda self, counts: calls.append(1) or real(self, counts))
    train_balancing("none", config=_config(), **SMALL_RUN)
    assert calls == []
    train_balancing("bias", config=_config(), **SMALL_RUN)
    assert len(calls) == 3


@pytest.mark.parametrize("kwargs,name", [
    (dict(mode="both"), "mode"), (dict(mode="aux", config=_config(aux_loss_alpha=0.0)), "config"),
    (dict(mode="none", steps=0), "steps"),
])
def test_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        train_balancing(**kwargs)
