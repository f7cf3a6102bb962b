"""dsa.index_share_every > 1 under tensor, expert and pipeline parallelism (docs/design.md §15.2).

A sharded reusing DSA layer has no indexer to load and replays its rank's sharded source's selections; the
pipeline split never separates a group of index-sharing layers; multi-process runs (gloo, 127.0.0.1: parallelize's
TP2, EP2, PP2, CP2 and the native DTensor TP2) and the TP2 serving engine give the one-process model's logits and
greedy tokens.
"""
import pytest
import torch

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.launch import launch
from latentmoe_lab.parallel.mesh import ProcessMesh, init_distributed
from latentmoe_lab.parallel.pipeline import partition_layers
from latentmoe_lab.parallel.sharded import parallelize
from latentmoe_lab.parallel.tensor import shard_dsa
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

SOURCE, REUSER = 3, 7  # the 8-layer tiny model's DSA layers: 7 reuses 3's selections
LAYOUTS = [ParallelConfig(tp=2), ParallelConfig(ep=2), ParallelConfig(pp=2), ParallelConfig(cp=2)]


def _config(share: int = 2, num_layers: int = 8) -> ModelConfig:
    return ModelConfig.from_preset("tiny").replace(num_layers=num_layers, dsa={"index_share_every": share})


def _model(dtype=torch.float64) -> LatentMoEForCausalLM:
    torch.manual_seed(0)
    return LatentMoEForCausalLM(_config()).to(dtype).eval()


def _prompt(batch: int = 2, length: int = 150) -> torch.Tensor:
    """Longer than the indexer's top-k (32) and several query blocks of 64: the selection matters."""
    return torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_hand_written_tp2_of_a_source_and_its_reuser_sums_to_the_full_layers():
    model = _model()
    source, reuser = model.layers[SOURCE].attn, model.layers[REUSER].attn
    x_source, x_reuser = torch.randn(2, 150, 64, dtype=torch.float64).unbind(0)
    x_source, x_reuser = x_source[None], x_reuser[None]
    want_source, want_reuser = source(x_source), reuser(x_reuser)
    got_source, got_reuser = 0, 0
    for rank in range(2):
        selections = {}  # one rank's: its source shard records, its reuser shard replays
        shards = [shard_dsa(layer, model.config, rank, 2, selections) for layer in (source, reuser)]
        assert [s.selection_role for s in shards] == ["source", "reuse"]
        assert shards[1].indexer is None and shards[0].shared_selection is shards[1].shared_selection
        assert not any(name.startswith("indexer.") for name in shards[1].state_dict())
        got_source = got_source + shards[0](x_source)
        got_reuser = got_reuser + shards[1](x_reuser)
    torch.testing.assert_close(got_source, want_source)
    torch.testing.assert_close(got_reuser, want_reuser)
    with pytest.raises(RuntimeError, match="reuses layer 3's selections"):
        shard_dsa(reuser, model.config, 0, 2)(x_reuser)  # sharded without its source: nothing to replay


def test_pipeline_stages_keep_each_index_sharing_group_on_one_stage():
    assert partition_layers(_config(share=1), 2) == [range(0, 4), range(4, 8)]  # unchanged without sharing
    stages = partition_layers(_config(), 2)
    assert any(SOURCE in stage and REUSER in stage for stage in stages)
    with pytest.raises(ValueError, match=r"pp: 7 stages .*dsa.index_share_every 2"):
        partition_layers(_config(), 7)


def _layouts_worker(layouts: list[ParallelConfig], checkpoint: str) -> tuple[list[dict], float]:
    """Per rank: each layout's gathered prefill logits and greedy tokens against the one-process model, and the
    native (DTensor) TP2 model's logits loaded from `checkpoint` (the same weights): its largest error."""
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.forward import native_logits
    from latentmoe_lab.native.layout import NativeLayout, build_mesh

    _, device = init_distributed(30)
    model, prompt = _model(torch.float32), _prompt()  # fp32: context parallelism's sends are fp32 buffers
    with torch.no_grad():
        reference = model(prompt).logits
    reference_tokens = model.generate(prompt, max_new_tokens=3)
    results = []
    for pconfig in layouts:
        comm = Comm(ProcessMesh(pconfig, device))
        sharded = parallelize(model, comm)
        local = sharded.local_inputs(prompt)
        logits = sharded.gather_logits(sharded(local), local.shape[0], local.shape[1])
        dsa = {i: next(m for m in block.attn.modules() if isinstance(m, GatedDSA))
               for i, block in zip(sharded.layer_ids, sharded.blocks) if block.attention_type == DSA}
        linked = REUSER not in dsa or dsa[REUSER].shared_selection is dsa[SOURCE].shared_selection
        results.append({"error": None if logits is None else float((logits - reference).abs().max()),
                        "tokens_equal": torch.equal(sharded.generate(prompt, 3), reference_tokens),
                        "linked": linked, "layers": list(sharded.layer_ids)})
    layout = NativeLayout(tp=2)
    native = build_native(model.config, layout, build_mesh(layout), checkpoint=checkpoint, dtype=torch.float32)
    with torch.no_grad():
        return results, float((native_logits(native, prompt) - reference).abs().max())


def test_tp2_ep2_pp2_cp2_and_native_tp2_with_shared_indexers_equal_one_process(tmp_path):
    _model(torch.float32).save_pretrained(tmp_path)
    per_rank = launch(_layouts_worker, 2, (LAYOUTS, str(tmp_path)), timeout_s=180)
    assert max(native_error for _, native_error in per_rank) <= 1e-5
    for position, pconfig in enumerate(LAYOUTS):
        ranks = [results[position] for results, _ in per_rank]
        assert all(r["linked"] and r["tokens_equal"] for r in ranks), (pconfig, ranks)
        errors = [r["error"] for r in ranks if r["error"] is not None]
        assert errors and max(errors) <= 1e-5, (pconfig, errors)
        if pconfig.pp > 1:  # the stage boundary falls outside the group of layers 3..7
            assert any({SOURCE, REUSER} <= set(r["layers"]) for r in ranks)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
@torch.no_grad()
def test_tp2_and_pp2_serving_engines_with_shared_indexers_give_generate_tokens(parallel):
    model = _model(torch.float32)
    prompts = [row.tolist() for row in _prompt(1, 120)] + [[7, 300, 11, 42, 5, 9, 260, 3, 1]]
    service = ServiceConfig.from_dict({"model": {"max_model_len": 256}, "scheduler": {"prefill_chunk_size": 48},
                                       "memory": {"max_num_seqs": 2, "block_size": 16, "cache_bytes": 2_000_000},
                                       "parallel": parallel})
    engine = Engine(model, service)
    try:
        assert len(engine.runner.pids) == 2
        assert any({SOURCE, REUSER} <= set(stage.layers) for stage in engine.stages)
        tokens = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=5), use_tqdm=False)]
    finally:
        engine.close()
    for prompt, got in zip(prompts, tokens):
        assert got == model.generate(torch.tensor([prompt]), max_new_tokens=5)[0, len(prompt):].tolist()
