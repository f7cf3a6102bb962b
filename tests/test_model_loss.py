"""forward(..., labels=): the next-token loss and the scaled router losses against a hand computation."""
import math

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.ops.balancing import sequence_aux_loss_reference


def _hand_ce(logits: torch.Tensor, labels: torch.Tensor, skip=()) -> float:
    """sum over (b, t) of logsumexp(logits[b, t]) - logits[b, t, labels[b, t + 1]], over the kept targets."""
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target == -100 or (b, t + 1) in skip:
                continue
            row = [float(v) for v in logits[b, t].detach().double()]
            top = max(row)
            total += top + math.log(sum(math.exp(v - top) for v in row)) - row[target]
            count += 1
    return total / count


def test_loss_matches_a_hand_computation_with_ignored_labels(tiny_config):
    model = LatentMoEForCausalLM(tiny_config).eval()
    ids = torch.randint(0, tiny_config.vocab_size, (2, 9))
    labels = ids.clone()
    labels[0, 3] = -100
    labels[1, 1:4] = -100
    out = model(ids, labels=labels)
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert out.loss.item() == pytest.approx(_hand_ce(out.logits, labels), rel=1e-5)
    assert torch.equal(out.logits, model(ids).logits)  # labels change nothing else
    assert model(ids).loss is None and model(ids).aux_loss is None


def test_all_labels_ignored_gives_zero_not_nan(tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    ids = torch.randint(0, tiny_config.vocab_size, (1, 5))
    out = model(ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0 and out.loss.requires_grad


def test_packed_sequences_do_not_predict_across_the_boundary(tiny_config):
    model = LatentMoEForCausalLM(tiny_config).eval()
    ids = torch.randint(0, tiny_config.vocab_size, (1, 10))
    out = model(ids, cu_seqlens=torch.tensor([0, 4, 10]), labels=ids)
    # token 4 opens the second sequence: nothing predicts it from token 3
    assert out.loss.item() == pytest.approx(_hand_ce(out.logits, ids, skip={(0, 4)}), rel=1e-5)


def test_aux_loss_is_the_scaled_sum_of_balance_and_z_losses(tiny_config):
    config = tiny_config.replace(moe={**tiny_config.to_dict()["moe"], "aux_loss_alpha": 0.01, "z_loss_coef": 1e-3})
    model = LatentMoEForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 7))
    captured = []
    hooks = [block.ffn.register_forward_pre_hook(lambda m, args: captured.append((m, args[0])))
             for block in model.layers if block.is_moe]
    out = model(ids, labels=ids)
    for hook in hooks:
        hook.remove()
    expected = 0.0
    for layer, x in captured:
        logits = layer.router_logits(x.reshape(-1, x.shape[-1]))
        _, indices = layer.select_experts(logits)
        balance = sequence_aux_loss_reference(logits.view(2, 7, -1), indices.view(2, 7, -1), alpha=0.01)
        z = torch.logsumexp(logits.double(), -1).square().mean()
        expected += balance.item() + 1e-3 * z.item()
    assert len(captured) == config.num_layers - config.first_dense_layers
    assert out.aux_loss.item() == pytest.approx(expected, rel=1e-5)
    out.aux_loss.backward()
    assert model.layers[1].ffn.router.weight.grad.abs().sum() > 0  # the aux loss trains the router


def test_bad_labels_are_refused(tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    ids = torch.randint(0, tiny_config.vocab_size, (1, 5))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :4])
    with pytest.raises(TypeError, match="labels"):
        model(ids, labels=ids.float())
    with pytest.raises(ValueError, match="labels: must be token ids"):
        model(ids, labels=torch.full_like(ids, tiny_config.vocab_size))
