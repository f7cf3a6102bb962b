"""The parallel layouts on torch's own distributed engine (docs/design.md §11); parallel/ is the hand-written twin.

    layout.py        NativeLayout (pp, dp_shard, ep, tp, mixed precision, schedule) and NativeMesh (DeviceMesh)
    local_params.py  LocalParams: a layer's own parameters as DTensors, its forward on local views
    tensor_plan.py   parallelize_module plans for KDA, Gated DSA, dense FFN and shared experts
    expert.py        the autograd All-to-All dispatcher (expert parallelism that trains)
    eplb.py          experts in an EPLB placement's slots (parallel/eplb/); checkpoints mapped to logical order
    stage.py         a pipeline stage under the full model's parameter names
    build.py         build_native / from_pretrained: meta build, plans, FSDP2, local shards from safetensors
    train.py         NativeTrainer: one step = the one-process step on the whole batch
    forward.py       native_logits: the global logits of a NativeModel
    checkpoint.py    sharded, pickle-free save / resharding load / export to safetensors
    traffic.py       planned and measured bytes of FSDP2 and the EP All-to-All
    equivalence.py   check_layouts (vs one process), compare_with_hand_written (vs parallel/)
    placements.py    every parameter's DTensor placement, mesh dims and local shape (notebook 04)
    run.py           `latentmoe-lab train --fsdp/--ep/--tp/--pp`

    layout = NativeLayout(dp_shard=2, ep=2)
    native = build_native(config, layout, build_mesh(layout), checkpoint="ckpt/")   # build.py
    trainer = NativeTrainer(native)                                                 # train.py
    trainer.step(global_batch)             # on every rank of a 4-process group
"""
from latentmoe_lab.native.layout import NATIVE_DIMS, NativeLayout, NativeMesh, build_mesh

__all__ = ["NATIVE_DIMS", "NativeLayout", "NativeMesh", "build_mesh"]
