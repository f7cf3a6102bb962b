"""benchmarks/bench_train_race.py: the dense racers match the parameter counts they are sized to, and every racer
spends mini's training FLOPs, to within half of one of its steps."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_train_parts import model_flops_per_token  # noqa: E402
from bench_train import quality  # noqa: E402
from bench_train_race import DENSE_SHAPES, RACERS, dense_sized, flops_race, mini_parameters, twin_config  # noqa: E402

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig  # noqa: E402


@pytest.fixture(scope="module")
def mini() -> ModelConfig:
    return ModelConfig.from_preset("mini")


def test_dense_models_match_the_counts_they_are_sized_to(mini):
    sizes = mini_parameters(mini)
    assert sizes["total"] > 2 * sizes["active"]  # 16 experts, 2 active: most weights idle per token
    for name, (count, d_model, heads) in DENSE_SHAPES.items():
        model = dense_sized(mini.vocab_size, 128, sizes[count], d_model, heads)
        assert model_flops_per_token(model, 128)["active_parameters"] == pytest.approx(sizes[count], rel=0.01), name
        twin = twin_config(mini, sizes[count])
        assert twin.dense_intermediate_size % 8 == 0
        counted = model_flops_per_token(LatentMoEForCausalLM(twin), 128)["active_parameters"]
        assert counted == pytest.approx(sizes[count], rel=0.01), f"twin of {name}"


def test_dense_sized_refuses_a_target_below_its_attention(mini):
    with pytest.raises(ValueError, match="target"):
        dense_sized(mini.vocab_size, 128, 1000, 384, 6)


def test_every_racer_spends_minis_flops(mini):
    torch.manual_seed(0)
    seq_len, batch = 16, 2
    rows = (torch.randint(0, 256, (64, seq_len)), torch.randint(0, 256, (4, seq_len)))
    race = flops_race(mini, batch, seq_len, 6, rows, racers=RACERS, dense_lrs=(1e-3, 2e-3))
    assert set(race["models"]) == set(RACERS)
    for name, run in race["models"].items():
        step_flops = run["flops_per_token"] * batch * seq_len
        assert abs(run["curve"][-1]["flops"] - race["budget_flops"]) <= step_flops / 2, name
        assert [point["steps"] for point in run["curve"]] == sorted({max(1, round(run["steps"] * k / 4))
                                                                    for k in (1, 2, 3, 4)}), name
    assert set(race["lr_sweep"]["dense_active"]) == {"0.001", "0.002"}
    best = min(race["lr_sweep"]["dense_active"].values())
    assert race["models"]["dense_active"]["curve"][-1]["bits_per_byte"] == best
    final = {name: run["curve"][-1]["bits_per_byte"] for name, run in race["models"].items()}
    assert race["ratios"]["mini_over_dense_total"] == pytest.approx(final["mini"] / final["dense_total"])
    assert "twin_active_over_dense_active" not in race["ratios"]  # only mini and its K3 variant are raced against
    with pytest.raises(ValueError, match="racers"):
        flops_race(mini, batch, seq_len, 6, rows, racers=("mini", "dense_huge"))


def test_the_minute_race_takes_every_family_member_against_the_dense_reference(mini):
    """--minutes with --race: mini, its K3 variant and its twin each train the same (tiny) time as the dense model,
    steps interleaved by training time, and are evaluated at each quarter of it."""
    torch.manual_seed(0)
    rows = (torch.randint(0, 256, (64, 16)), torch.randint(0, 256, (4, 16)))
    family = ("mini", "mini_situ_quantile", "twin_active")
    out = quality(mini, 2, 16, 0.02, rows, family)
    assert set(out["ratios"]) == {f"{name}_over_dense" for name in family}
    for name in (*family, "dense"):
        points = out[name]
        assert len(points) == 4 and points[-1]["train_s"] >= 0.02 * 60, name
        assert [p["steps"] for p in points] == sorted(p["steps"] for p in points), name
    assert out["ratios"]["twin_active_over_dense"] == pytest.approx(out["twin_active"][-1]["bits_per_byte"]
                                                                    / out["dense"][-1]["bits_per_byte"])
    assert out["mini_over_dense"] == out["ratios"]["mini_over_dense"]
