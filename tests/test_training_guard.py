"""NonFiniteGuard names the module where a NaN first appears, forward or backward, in that step."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.training.guard import NonFiniteError, NonFiniteGuard


class _NaNGradient(torch.autograd.Function):
    """Identity forward; the backward turns the (finite) incoming gradient into NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _step(model, config):
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    (out.loss + out.aux_loss).backward()


def test_clean_steps_pass(tiny_config):
    """Finite steps go through the guard's hooks untouched: no error, every gradient there and finite."""
    model = LatentMoEForCausalLM(tiny_config)
    with NonFiniteGuard(model) as guard:
        for step in range(2):
            guard.start_step(step)
            _step(model, tiny_config)
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(torch.isfinite(grad).all() for grad in grads)


def test_nan_weight_names_the_layer_in_the_forward(tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    with torch.no_grad():
        model.layers[2].attn.v_proj.weight[0, 0] = float("nan")
    with NonFiniteGuard(model) as guard:
        guard.start_step(7)
        with pytest.raises(NonFiniteError) as error:
            _step(model, tiny_config)
    assert error.value.module == "layers.2.attn.v_proj" and error.value.phase == "forward"
    assert "layers.2.attn.v_proj" in str(error.value) and "step 7" in str(error.value)


def test_nan_made_inside_a_module_backward_names_that_module(tiny_config, monkeypatch):
    """The NaN is born in layer 2's attention backward (not a child): the guard must name layers.2.attn,
    not the projections upstream that receive it, nor a router."""
    model = LatentMoEForCausalLM(tiny_config)
    attn = model.layers[2].attn
    inner = attn.o_proj.forward
    monkeypatch.setattr(attn.o_proj, "forward", lambda x: inner(_NaNGradient.apply(x)))
    with NonFiniteGuard(model) as guard:
        guard.start_step(3)
        with pytest.raises(NonFiniteError) as error:
            _step(model, tiny_config)
    # o_proj's input gradient is where finite became NaN: o_proj itself is the first module to blame
    assert error.value.module == "layers.2.attn.o_proj" and error.value.phase == "backward"


def test_nan_weight_gradient_names_the_owner(tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    model.layers[3].ffn.experts.w2.register_hook(lambda grad: grad * float("nan"))
    with NonFiniteGuard(model, check_forward=False) as guard:
        guard.start_step(0)
        with pytest.raises(NonFiniteError, match="layers.3.ffn.experts") as error:
            _step(model, tiny_config)
    assert "w2" in str(error.value)


def test_removed_guard_is_silent(tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    with torch.no_grad():
        model.layers[3].ffn.experts.w2[0, 0, 0] = float("nan")  # the last layer: no router sees it
    NonFiniteGuard(model).remove()
    ids = torch.randint(0, tiny_config.vocab_size, (2, 12))
    assert torch.isnan(model(ids, labels=ids).loss)  # no hook left: the NaN goes through unreported


def test_the_training_loop_stops_in_the_step_and_names_the_layer(monkeypatch):
    """From step 3 on, layer 3's attention makes NaN gradients: the run stops at step 3 naming it."""
    import sysconfig

    from latentmoe_lab.layers.dsa import GatedDSA
    from latentmoe_lab.training.lm import TrainSettings, train

    calls = {"n": 0}
    forward = GatedDSA.forward

    def sabotaged(self, *args, **kwargs):
        calls["n"] += 1
        out = forward(self, *args, **kwargs)
        return _NaNGradient.apply(out) if calls["n"] >= 3 and torch.is_grad_enabled() else out

    monkeypatch.setattr(GatedDSA, "forward", sabotaged)
    settings = TrainSettings(preset="tiny", steps=5, batch=2, seq_len=32, eval_every=5, eval_rows=2, threads=1,
                             sample_tokens=0, corpus_root=sysconfig.get_paths()["stdlib"] + "/json",
                             held_out_fraction=0.3)
    with pytest.raises(NonFiniteError) as error:
        train(settings)
    assert error.value.module == "layers.3.attn" and error.value.step == 3
