"""K3's model switches (docs/design.md §18): SiTU experts, Block AttnRes, the quantile bias rule.

A tiny model with all three gives the same logits through a full forward, chunked prefill over the cache,
generate and the serving engine (prefix caching and speculation on); its gradients equal autograd through
the reference twins; every switch is refused by name when inconsistent; and the defaults change nothing.
"""
import pytest
import torch
import torch.nn.functional as F

from latentmoe_lab import ModelConfig
from latentmoe_lab.layers.attn_res import AttnResStream, stream_width
from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.ops import grouped_experts
from latentmoe_lab.ops.attnres import attn_res_reference
from latentmoe_lab.ops.balancing import quantile_bias


def k3_config(block_size=2, **changes) -> ModelConfig:
    base = ModelConfig.from_preset("tiny")
    moe = {**base.to_dict()["moe"], "activation": "situ", "bias_update": "quantile"}
    return base.replace(attn_res_block_size=block_size, moe=moe, vision=None, **changes)


def k3_model(block_size=2, **changes) -> LatentMoEForCausalLM:
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(k3_config(block_size, **changes))
    with torch.no_grad():  # trained queries are not zero: make the mix far from the plain mean
        for name, p in model.named_parameters():
            if name.endswith("attn_res.attn.query") or name.endswith("attn_res.mlp.query") or "attn_res_final" in name:
                p.normal_(std=0.5 if name.endswith("query") else 0.1).add_(0 if name.endswith("query") else 1)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return k3_model(mtp_depth=1)


def test_defaults_change_nothing():
    config = ModelConfig.from_preset("tiny")
    assert (config.attn_res_block_size, config.moe.activation, config.moe.bias_update) == (None, "swiglu", "sign")
    names = LatentMoEForCausalLM(config).state_dict().keys()
    assert not any("attn_res" in name for name in names)


@pytest.mark.parametrize("changes, key", [
    ({"attn_res_block_size": 0}, "attn_res_block_size"),
    ({"attn_res_block_size": 2.5}, "attn_res_block_size"),
    ({"moe": {"activation": "gelu"}}, "moe.activation"),
    ({"moe": {"activation": "situ", "activation_clamp": 7.0}}, "moe.activation_clamp"),
    ({"moe": {"situ_beta_gate": 0.0}}, "moe.situ_beta_gate"),
    ({"moe": {"situ_beta_up": float("inf")}}, "moe.situ_beta_up"),
    ({"moe": {"bias_update": "median"}}, "moe.bias_update"),
])
def test_inconsistent_switches_are_refused_naming_the_key(changes, key):
    base = ModelConfig.from_preset("tiny")
    if "moe" in changes:
        changes = {"moe": {**base.to_dict()["moe"], **changes["moe"]}}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        base.replace(**changes)


@pytest.mark.parametrize("block_size, layers", [(1, 4), (2, 4), (3, 7), (12, 93)])
def test_the_stream_holds_the_embedding_the_finished_blocks_and_the_partial_sum(block_size, layers):
    """93 layers in blocks of 12: 7 finished blocks + the embedding + the partial sum = 9 candidates."""
    widths = [stream_width(j, block_size) for j in range(layers + 1)]
    assert widths[0] == 1 and widths[1] == 2 and widths[-1] == 2 + (layers - 1) // block_size
    if (block_size, layers) == (12, 93):
        assert widths[-1] == 9


def test_a_forward_builds_the_stream_it_declares():
    model = k3_model(block_size=3, num_layers=7, layer_types=None)
    seen = []
    for block in model.layers:
        block.register_forward_hook(lambda module, args, out: seen.append(len(out.candidates())))
    model(torch.randint(0, 256, (1, 5)))
    assert seen == [stream_width(j + 1, 3) for j in range(7)]


def test_chunked_prefill_and_generate_give_the_full_forward_logits(model):
    ids = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache, pieces = model.new_cache(), []
        for start, stop in ((0, 7), (7, 8), (8, 30), (30, 41)):
            pieces.append(model(ids[:, start:stop], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)
    tokens = model.generate(ids[:, :20], 6)
    with torch.no_grad():
        again = model(tokens[:, :-1]).logits[:, 19:].argmax(-1)
    assert torch.equal(again, tokens[:, 20:])


def _service(method, chunk):
    from latentmoe_lab.serving import ServiceConfig
    return ServiceConfig.from_dict({
        "model": {"max_model_len": 256},
        "memory": {"cache_bytes": 3_000_000, "block_size": 16, "max_num_seqs": 4, "prefix_cache": {}},
        "scheduler": {"prefill_chunk_size": chunk},
        "speculative": None if method is None else {"method": method, "num_speculative_tokens": 3}})


@pytest.mark.parametrize("method, chunk", [(None, 7), ("mtp", 16), ("ngram", 32)])
def test_engine_with_prefix_caching_and_speculation_equals_generate(model, method, chunk):
    from latentmoe_lab.serving import Engine, SamplingParams
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [shared + [5], shared + [6, 7, 8], torch.randint(0, 256, (23,), generator=g).tolist(), [9]]
    want = [model.generate(torch.tensor([p]), 6)[0, len(p):].tolist() for p in prompts]
    engine = Engine(model, _service(method, chunk))
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=6), use_tqdm=False)  # caches the shared prefix
    outputs = first + engine.generate(prompts[1:], SamplingParams(max_tokens=6), use_tqdm=False)
    assert [o.token_ids for o in outputs] == want
    assert engine.stats()["prefix_hit_tokens"] > 0


def _reference_twins(monkeypatch):
    """Route every op of the model through its plain twin: the AttnRes loop, the per-token MoE loop."""
    monkeypatch.setattr("latentmoe_lab.layers.attn_res.attn_res", attn_res_reference)
    monkeypatch.setattr(LatentMoE, "forward", LatentMoE.reference_forward)


def test_gradients_equal_autograd_through_the_reference_twins(monkeypatch):
    model = k3_model(block_size=2).train()
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(5))  # past one KDA chunk

    def grads():
        model.zero_grad(set_to_none=True)
        logits = model(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fast = grads()
    with monkeypatch.context() as patch:
        _reference_twins(patch)
        twin = grads()
    assert fast.keys() == twin.keys() and any("attn_res" in n for n in fast)
    for name in fast:
        torch.testing.assert_close(fast[name], twin[name], rtol=2e-3, atol=2e-5, msg=name)
    assert any(float(g.abs().max()) > 0 for n, g in fast.items() if n.endswith("attn.query"))


@pytest.mark.parametrize("counts", [[3, 0, 5, 1, 0, 7, 2, 0], [0, 0, 0, 0, 0, 13, 0, 0]])
def test_grouped_situ_experts_equal_the_twin(monkeypatch, counts):
    monkeypatch.setattr("latentmoe_lab.ops.routing.CPU_TILE_ROWS", 5)
    torch.manual_seed(0)
    experts = LatentExperts(8, 16, 12, situ_betas=(4.0, 25.0))
    with torch.no_grad():
        experts.w13.normal_(std=1.5)  # gates well into tanh's bend
        experts.w2.normal_(std=0.5)
    counts = torch.tensor(counts)
    z = torch.randn(int(counts.sum()), 16, requires_grad=True)
    assert grouped_experts.fits(z, experts.w13, experts.w2)
    out, ref = experts(z, counts), experts.forward_reference(z, counts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn_like(out)
    params = [z, experts.w13, experts.w2]
    for fast, twin in zip(torch.autograd.grad(out, params, grad_out), torch.autograd.grad(ref, params, grad_out)):
        torch.testing.assert_close(fast, twin, rtol=1e-5, atol=1e-5)


def test_quantile_rule_sets_the_bias_from_the_last_training_forward():
    config = k3_config()
    layer = LatentMoE(config)
    with pytest.raises(ValueError, match="quantile"):
        layer.update_bias(torch.zeros(config.moe.num_experts, dtype=torch.int64))
    x = torch.randn(3, 10, config.hidden_size)
    layer(x)
    layer.update_bias(layer.last_expert_counts)
    logits = F.linear(x.reshape(-1, config.hidden_size), layer.router.weight)
    torch.testing.assert_close(layer.correction_bias, quantile_bias(torch.sigmoid(logits), config.moe.top_k))
    assert layer.correction_bias.dtype == torch.float32 and layer.correction_bias.grad is None


def test_compiled_experts_op_with_situ_equals_the_autograd_function():
    """The custom op torch.compile runs (latentmoe::grouped_swiglu_experts) carries the SiTU betas too."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 9, 1, 0, 2])
    z = torch.randn(int(counts.sum()), 8, generator=gen, requires_grad=True)
    w13 = torch.randn(5, 8, 16, generator=gen, requires_grad=True)
    w2 = torch.randn(5, 8, 8, generator=gen, requires_grad=True)
    results = []
    for run in (lambda: grouped_experts.grouped_swiglu_experts(z, counts, w13, w2, situ_betas=(4.0, 25.0)),
                lambda: torch.ops.latentmoe.grouped_swiglu_experts(z, counts, w13, w2, None, [4.0, 25.0])[0]):
        out = run()
        results.append((out, *torch.autograd.grad(out.square().sum(), (z, w13, w2))))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.library.opcheck(torch.ops.latentmoe.grouped_swiglu_experts, (z, counts, w13, w2, None, [4.0, 25.0]),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_depth_weights_line_up_by_source():
    """analysis.depth_mix: an untrained model (zero queries) mixes its candidates evenly; cells line up as
    embedding, finished blocks, partial sum, blank where a source does not exist at that depth."""
    from latentmoe_lab.analysis.depth_mix import attn_res_depth_weights

    torch.manual_seed(0)
    model = LatentMoEForCausalLM(k3_config(block_size=2)).eval()  # 4 layers: blocks {0, 1}, {2, 3}
    depth = attn_res_depth_weights(model, torch.randint(0, 256, (2, 9)))
    assert depth.sources == ["embedding", "block 1", "partial sum"]
    assert depth.sublayers[:2] == ["layer 0 attention", "layer 0 MLP"] and depth.sublayers[-1] == "final"
    rows = dict(zip(depth.sublayers, depth.weights))
    assert rows["layer 0 attention"] == [1.0, None, None]
    assert rows["layer 1 MLP"] == pytest.approx([0.5, None, 0.5])
    assert rows["layer 2 attention"] == pytest.approx([0.5, 0.5, None])  # a block boundary: no partial sum
    assert rows["final"] == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError, match="attn_res_block_size"):
        attn_res_depth_weights(LatentMoEForCausalLM(ModelConfig.from_preset("tiny")), torch.zeros(1, 2).long())


def test_native_pipeline_stages_refuse_attn_res_by_name():
    """torch.distributed.pipelining stages pass one tensor, not the AttnRes stream: refused before any build."""
    from latentmoe_lab.native.layout import NativeLayout

    NativeLayout(pp=1).validate_for(k3_config())  # one stage: the whole model's forward carries the stream
    with pytest.raises(ValueError, match="attn_res_block_size"):
        NativeLayout(pp=2).validate_for(k3_config())


def test_checkpoint_round_trip_keeps_the_switches_and_the_logits(tmp_path):
    model = k3_model(block_size=2)
    ids = torch.randint(0, 256, (1, 12))
    model.save_pretrained(tmp_path / "k3")
    loaded = LatentMoEForCausalLM.from_pretrained(tmp_path / "k3").eval()
    assert loaded.config.attn_res_block_size == 2 and loaded.config.moe.activation == "situ"
    assert loaded.config.moe.bias_update == "quantile"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
