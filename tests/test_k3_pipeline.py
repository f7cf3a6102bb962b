"""Block AttnRes across a pipeline cut (docs/design.md §18): on 2 gloo processes a PP=2 split of a model with
AttnRes (and SiTU experts) gives the one-process logits and greedy tokens, a training step gives its
gradients, and the bytes the stages send are exactly what the traffic planner counts for the packed stream."""
from collections import Counter

import torch
import torch.nn.functional as F

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.attn_res import stream_width
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.launch import launch
from latentmoe_lab.parallel.mesh import ProcessMesh, init_distributed
from latentmoe_lab.parallel.pipeline import partition_layers, train_step
from latentmoe_lab.parallel.sharded import parallelize
from latentmoe_lab.parallel.traffic import forward_traffic

BATCH, SEQ_LEN = 2, 20


def _config() -> ModelConfig:
    base = ModelConfig.from_preset("tiny")
    return base.replace(attn_res_block_size=1, vision=None, moe={**base.to_dict()["moe"], "activation": "situ"})


def _model_and_prompt():
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(std=0.5)
    prompt = torch.randint(0, 256, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    return model, prompt


def _pp2_worker():
    _, device = init_distributed(30)
    model, prompt = _model_and_prompt()
    with torch.no_grad():
        want_logits = model(prompt).logits
    want_tokens = model.generate(prompt, 3)
    labels = prompt.roll(-1, dims=1)
    loss = F.cross_entropy(want_logits.flatten(0, 1), labels.flatten())
    model.train()
    F.cross_entropy(model(prompt).logits.flatten(0, 1), labels.flatten()).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.eval()

    pconfig = ParallelConfig(pp=2)
    comm = Comm(ProcessMesh(pconfig, device))
    sharded = parallelize(model, comm)
    comm.reset()
    local = sharded(prompt)
    measured = {tag: n for tag, n in comm.bytes.items() if n}
    logits = sharded.gather_logits(local, BATCH, SEQ_LEN)
    tokens = sharded.generate(prompt, 3)
    train = parallelize(model, Comm(ProcessMesh(ParallelConfig(pp=2, micro_batches=2), device)))
    train_loss = train_step(train, prompt, labels)
    grad_errors = []
    for name, param in train.named_parameters():
        if param.grad is None:
            continue
        if name.startswith("blocks."):
            _, k, rest = name.split(".", 2)
            name = f"layers.{train.layer_ids[int(k)]}.{rest}"
        scale = float(expected[name].abs().max()) or 1.0  # fp32 sums in another order: relative to the size
        grad_errors.append(float((param.grad - expected[name]).abs().max()) / scale)
    return {"logit_error": float((logits - want_logits).abs().max()), "tokens_equal": torch.equal(tokens, want_tokens),
            "measured": measured, "loss_error": float((train_loss - loss).abs()), "grad_errors": grad_errors,
            "attn_res_grads": sum(1 for n, p in train.named_parameters() if "attn_res" in n and p.grad is not None)}


def test_pp2_with_attn_res_equals_one_process_and_sends_what_the_planner_counts():
    per_rank = launch(_pp2_worker, 2, ())
    config = _config()
    stages = partition_layers(config, 2)
    planned = forward_traffic(config, ParallelConfig(pp=2), BATCH, SEQ_LEN, act_bytes=4)
    width = stream_width(stages[0].stop, 1)
    assert width >= 3  # the embedding, a finished block, the partial sum: more than the plain stream
    assert planned[0]["pp.act"] == width * BATCH * SEQ_LEN * config.hidden_size * 4
    for rank, result in enumerate(per_rank):
        assert result["logit_error"] <= 1e-5 and result["tokens_equal"], rank
        assert Counter(result["measured"]) == planned[rank], rank
        assert result["loss_error"] < 1e-5 and result["grad_errors"] and max(result["grad_errors"]) < 1e-4, rank
        assert result["attn_res_grads"] > 0, rank


def test_serving_pp2_with_attn_res_gives_the_one_process_tokens():
    """The serving pipeline stage sends the packed stream; 2 gloo worker processes, chunked prefill (32) with
    prefix caching, as in tests/test_serving_pipeline.py."""
    from serving_cases import PARAMS, PROMPTS, SERVICE
    from latentmoe_lab.serving import Engine, ServiceConfig

    model, _ = _model_and_prompt()
    want = [o.token_ids for o in Engine(model, ServiceConfig.from_dict(SERVICE)).generate(PROMPTS, PARAMS,
                                                                                            use_tqdm=False)]
    engine = Engine(model, ServiceConfig.from_dict(SERVICE | {"parallel": {"pipeline_parallel_size": 2}}))
    try:
        assert len(engine.stages) == 2 and engine.stages[1].layers.start > 0
        got = [o.token_ids for o in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        engine.close()
    assert got == want
