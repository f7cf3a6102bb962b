"""The multi-token prediction head (mtp.py): its loss and gradients against a plain reference, checkpoints,
parameter counts and config validation."""
import json

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.meta import count_parameters


def _mtp_config(depth: int = 2) -> ModelConfig:
    return ModelConfig.from_preset("tiny").replace(mtp_depth=depth, vision=None)


def _plain_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_mtp_loss(model: LatentMoEForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Depth by depth and position by position: W_k = [W_h | W_e] applied to the two normed halves, the
    depth's block over the positions that have x[t + k], then -log p(labels[t + k + 1]) per position."""
    eps, d = model.config.rms_norm_eps, model.config.hidden_size
    hidden = model.embed_tokens(ids)
    for block in model.layers:
        hidden = block(hidden)
    losses = []
    for k, depth in enumerate(model.mtp.depths, start=1):
        length = ids.shape[1] - k
        w_h, w_e = depth.proj.weight[:, :d], depth.proj.weight[:, d:]
        rows = []
        for t in range(length):
            h = _plain_rms(hidden[:, t], depth.hidden_norm.weight, eps)
            e = _plain_rms(model.embed_tokens.weight[ids[:, t + k]], depth.embed_norm.weight, eps)
            rows.append(h @ w_h.T + e @ w_e.T)
        hidden = depth.block(torch.stack(rows, dim=1))
        terms = []
        for b in range(ids.shape[0]):
            for t in range(length - 1):
                target = int(labels[b, t + k + 1])
                if target == -100:
                    continue
                logits = _plain_rms(hidden[b, t], depth.norm.weight, eps) @ model.lm_head.weight.T
                terms.append(torch.logsumexp(logits, dim=-1) - logits[target])
        losses.append(torch.stack(terms).mean())
    return torch.stack(losses).mean()


def test_mtp_loss_and_gradients_match_a_plain_reference_in_fp64():
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(_mtp_config(2)).double().eval()
    with torch.no_grad():  # realistic scales: trained-like norms instead of all ones
        for depth in model.mtp.depths:
            for norm in (depth.hidden_norm, depth.embed_norm, depth.norm):
                norm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    labels = ids.clone()
    labels[0, 5] = -100
    labels[1, 2:4] = -100
    out = model(ids, labels=labels)
    expected = _reference_mtp_loss(model, ids, labels)
    assert out.mtp_loss.dtype == torch.float64
    assert out.mtp_loss.item() == pytest.approx(expected.item(), rel=1e-10)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(out.mtp_loss, params, allow_unused=True)
    want = torch.autograd.grad(expected, params, allow_unused=True)
    checked = 0
    for (name, _), g, w in zip(model.named_parameters(), got, want):
        if w is None:
            assert g is None or not g.any(), name
            continue
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-12, msg=name)
        checked += 1
    names = {name.split(".")[0] for (name, _), w in zip(model.named_parameters(), want) if w is not None}
    assert {"embed_tokens", "lm_head", "layers", "mtp"} <= names and checked > 20
    assert torch.equal(out.logits, model(ids).logits)  # the head changes nothing of the main model
    assert out.loss.item() == pytest.approx(model(ids, labels=labels).loss.item())


def test_mtp_loss_ignores_targets_in_a_later_packed_sequence():
    model = LatentMoEForCausalLM(_mtp_config(1)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    packed = model(ids, cu_seqlens=torch.tensor([0, 5, 12]), labels=ids).mtp_loss
    # depth 1 at t predicts t + 2: for t = 3, 4 the target lies in the second sequence, so the packed loss
    # is the two sequences' losses alone, weighted by their target counts (length - 2 each)
    first_count, second_count = 5 - 2, 7 - 2
    first = model(ids[:, :5], labels=ids[:, :5]).mtp_loss * first_count
    second = model(ids[:, 5:], labels=ids[:, 5:]).mtp_loss * second_count
    assert packed.item() == pytest.approx(((first + second) / (first_count + second_count)).item(), rel=1e-5)


def test_a_model_without_the_head_has_no_mtp_parameters_and_loss():
    config = ModelConfig.from_preset("tiny")
    assert config.mtp_depth == 0
    plain, with_head = LatentMoEForCausalLM(config), LatentMoEForCausalLM(config.replace(mtp_depth=1))
    assert plain.mtp is None
    keys = set(with_head.state_dict())
    assert set(plain.state_dict()) == {k for k in keys if not k.startswith("mtp.")} != keys
    ids = torch.randint(0, config.vocab_size, (1, 6))
    assert plain(ids, labels=ids).mtp_loss is None and with_head(ids).mtp_loss is None


def test_checkpoint_round_trip_carries_the_head_and_old_configs_load(tmp_path):
    model = LatentMoEForCausalLM(_mtp_config(2)).eval()
    model.save_pretrained(tmp_path / "with")
    loaded = LatentMoEForCausalLM.from_pretrained(tmp_path / "with").eval()
    assert loaded.config.mtp_depth == 2
    state, again = model.state_dict(), loaded.state_dict()
    assert state.keys() == again.keys() and any(k.startswith("mtp.depths.1.") for k in state)
    assert all(torch.equal(state[k], again[k]) for k in state)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    assert torch.equal(model(ids, labels=ids).mtp_loss, loaded(ids, labels=ids).mtp_loss)
    # a config.json written before the field existed loads as a model without the head
    data = model.config.replace(mtp_depth=0).to_dict()
    del data["mtp_depth"]
    assert ModelConfig.from_dict(data).mtp_depth == 0
    plain = LatentMoEForCausalLM(ModelConfig.from_dict(data))
    plain.save_pretrained(tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["mtp_depth"] == 0
    assert LatentMoEForCausalLM.from_pretrained(tmp_path / "plain").mtp is None


def test_parameter_count_of_the_head_is_closed_form():
    config = _mtp_config(2)
    d, mla, idx = config.hidden_size, config.mla, config.indexer
    attention = (d * mla.q_lora_rank + mla.q_lora_rank
                 + mla.q_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
                 + d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
                 + mla.kv_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
                 + 2 * d * mla.num_heads * mla.v_head_dim)
    indexer = mla.q_lora_rank * idx.num_heads * idx.head_dim + d * idx.head_dim + 2 * idx.head_dim + d * idx.num_heads
    model = LatentMoEForCausalLM(config)
    per_depth = 2 * d + 2 * d * d + d + 2 * d + attention + indexer + 3 * d * config.dense_intermediate_size
    counts, without = count_parameters(config), count_parameters(config.replace(mtp_depth=0))
    assert counts["by_component"]["mtp"] == {"total": 2 * per_depth, "active": 0}
    assert counts["total"] - without["total"] == 2 * per_depth
    assert counts["active"] == without["active"]
    assert sum(p.numel() for p in model.mtp.parameters()) == 2 * per_depth


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_bad_mtp_depth_is_refused_naming_the_field(value):
    with pytest.raises((ValueError, TypeError), match="mtp_depth"):
        ModelConfig.from_preset("tiny").replace(mtp_depth=value)


def test_train_cli_adds_the_weighted_mtp_loss_logs_it_and_resume_checks_the_flags(tmp_path, capsys):
    from latentmoe_lab.cli import main
    from test_training_lm import SMALL_CORPUS, _settings

    from latentmoe_lab.training.lm import train

    flags = ["train", "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq-len", "32", "--eval-every", "2",
             "--eval-rows", "2", "--out", str(tmp_path), "--threads", "1", "--corpus-root",
             SMALL_CORPUS["corpus_root"], "--held-out-fraction", "0.3", "--sample-tokens", "0"]
    assert main([*flags, "--mtp-depth", "1", "--mtp-weight", "0.3", "--stop-at", "1"]) == 0
    for changed, name in ((["--mtp-weight", "0.1"], "--mtp-weight"), (["--mtp-depth", "2"], "--mtp-depth")):
        assert main([*flags, "--resume", *changed]) == 2
        assert name in capsys.readouterr().err
    assert main([*flags, "--resume"]) == 0  # the run's own MTP settings, inherited
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert len(state["mtp_loss"]) == 2 and all(0 < x < 10 for x in state["mtp_loss"])
    model = LatentMoEForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert model.config.mtp_depth == 1 and model.mtp is not None
    # the weight enters the objective: the first step's update, and so the second step's loss, depends on it
    unweighted = train(_settings(steps=2, batch=2, warmup=20, eval_rows=2, mtp_depth=1, mtp_weight=0.0))
    assert unweighted.train_loss[0] == state["train_loss"][0]
    assert unweighted.train_loss[1] != state["train_loss"][1]
    with pytest.raises(ValueError, match="mtp_weight"):
        train(_settings(mtp_depth=1, mtp_weight=-1.0))
    with pytest.raises(ValueError, match="mtp_depth: 1 differs from the config's mtp_depth 2"):
        train(_settings(mtp_depth=1, config=ModelConfig.from_preset("tiny").replace(mtp_depth=2).to_dict()))
