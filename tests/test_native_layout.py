"""NativeLayout's rules, and FSDP2's bf16 mixed precision training next to fp32."""
import math

import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.parallel.launch import launch

TINY = ModelConfig.from_preset("tiny")  # 2 KDA heads, 2 MLA heads, 8 experts, 4 layers


def test_sizes_names_and_shards():
    layout = NativeLayout(dp_shard=2, ep=2, tp=2)
    assert layout.world_size == 8 and layout.data_shards == 4
    assert layout.name == "FSDP2xEP2xTP2" and NativeLayout().name == "1 process"
    layout.validate_for(TINY, 8)
    NativeLayout(pp=2, micro_batches=2).validate_batch(4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "tp: must be a positive integer"), (dict(ep=True), "ep: must be a positive integer"),
    (dict(param_dtype="fp8"), "param_dtype"), (dict(schedule="zb"), "schedule"),
    (dict(micro_batches=0), "micro_batches")])
def test_bad_layouts_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NativeLayout(**kwargs)


@pytest.mark.parametrize("layout, message", [
    (NativeLayout(ep=3), "ep: 3 must divide moe.num_experts = 8"), (NativeLayout(tp=4), "tp: 4 must divide"),
    (NativeLayout(pp=5), "pp: 5 stages need at least as many layers")])
def test_splits_the_model_cannot_take(layout, message):
    with pytest.raises(ValueError, match=message):
        layout.validate_for(TINY)


def test_world_size_and_batch_rules():
    with pytest.raises(ValueError, match="needs 4 processes, got 2"):
        NativeLayout(dp_shard=2, ep=2).validate_for(TINY, 2)
    with pytest.raises(ValueError, match="batch: 6 rows must split evenly over dp_shard x ep = 4"):
        NativeLayout(dp_shard=2, ep=2).validate_batch(6)
    with pytest.raises(ValueError, match="micro_batches"):
        NativeLayout(pp=2, micro_batches=4).validate_batch(2)


def _losses(param_dtypes: list[str]) -> list[list]:
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(60)
    torch.set_num_threads(1)
    batch = torch.randint(0, TINY.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    runs = []
    for param_dtype in param_dtypes:
        layout = NativeLayout(dp_shard=2, param_dtype=param_dtype)
        native = build_native(TINY, layout, build_mesh(layout), seed=0)
        trainer = NativeTrainer(native, lr=3e-3)
        dtypes = {str(p.dtype) for p in native.module.parameters()}
        runs.append([trainer.step(batch)["loss"] for _ in range(3)] + [sorted(dtypes)])
    return runs


def test_bf16_mixed_precision_trains_like_fp32():
    fp32, bf16 = launch(_losses, 2, args=(["fp32", "bf16"],), timeout_s=180)[0]
    assert fp32[-1] == bf16[-1] == ["torch.float32"]  # sharded masters stay fp32; only the gathered copies are bf16
    assert all(math.isfinite(x) for x in bf16[:-1])
    assert bf16[:-1] == pytest.approx(fp32[:-1], abs=0.05)
    assert bf16[:-1] != fp32[:-1]  # it did compute in bf16
    assert bf16[2] < bf16[0]


def _fresh_tp2() -> dict:
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.forward import native_logits
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(60)
    torch.set_num_threads(1)
    layout = NativeLayout(tp=2)
    native = build_native(TINY, layout, build_mesh(layout), seed=3)
    attn = native.module.layers[0].attn
    batch = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"replicated": attn.f_down.weight.detach().clone(), "sharded": attn.q_proj.weight.to_local().clone(),
            "logits": native_logits(native, batch)}


def test_a_fresh_initialisation_draws_replicas_alike_and_shards_apart():
    first, second = launch(_fresh_tp2, 2, timeout_s=120)
    assert torch.equal(first["replicated"], second["replicated"])  # f_down is replicated over tp
    assert not torch.equal(first["sharded"], second["sharded"])  # each rank's q_proj rows are its own
    assert torch.equal(first["logits"], second["logits"]) and first["logits"].std() > 0
