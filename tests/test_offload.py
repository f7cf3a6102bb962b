"""Issue 29 part A: DSA latent rows in a host tier, top-k rows swapped into per-sequence hot buffers."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.serving.cache_tiers.offload_tier import HotBuffer, OffloadedPools
from latentmoe_lab.paged_pools import PlainFormat
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import HARDWARE, Workload
from latentmoe_lab.parallel.roofline import decode_roofline, layer_time
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.cache_tiers.offload_plan import request_tier_bytes
from latentmoe_lab.serving.sequence import Status
from latentmoe_lab.serving.planner import plan_cache

HOT_ROWS = 40  # tiny's indexer keeps 32 rows; the long prompt has 1500


def _service(offload: dict | None, max_model_len=2048, cache_bytes=3_000_000, prefix=False):
    memory = {"max_num_seqs": 2, "block_size": 16, "cache_bytes": cache_bytes,
              "prefix_cache": {"enabled": prefix}}
    if offload is not None:
        memory["offload"] = offload
    return ServiceConfig.from_dict({"model": {"max_model_len": max_model_len}, "memory": memory,
                                    "scheduler": {"max_batch_size": 4, "prefill_chunk_size": 256}})


ON = {"host_cache_bytes": 2_000_000, "hot_rows_per_layer": HOT_ROWS}


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (1500, 20)]  # 20 < top-k: dense


def _step_logits(model, monkeypatch, run):
    """(run()'s result, the logits [R, vocab] of every serving step the engine ran on `model` meanwhile)."""
    steps, forward = [], model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("batch") is not None:
            steps.append(out.logits.clone())
        return out

    with monkeypatch.context() as patch:
        patch.setattr(model, "forward", recording)
        return run(), steps


@torch.no_grad()
def test_greedy_with_offload_equals_without_and_generate(model, prompts, monkeypatch):
    params = SamplingParams(max_tokens=6)
    plain, plain_logits = _step_logits(model, monkeypatch, lambda: [
        o.token_ids for o in Engine(model, _service(None)).generate(prompts, params, use_tqdm=False)])
    engine = Engine(model, _service(ON))
    offloaded, offloaded_logits = _step_logits(model, monkeypatch, lambda: [
        o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
    reference = model.generate(torch.tensor([prompts[0]]), max_new_tokens=6)[0, len(prompts[0]):].tolist()
    assert offloaded == plain and offloaded[0] == reference
    # bit for bit, not only the argmax: every logits row of every step (the same steps run in both engines)
    assert len(offloaded_logits) == len(plain_logits) >= 6
    for step, (got, want) in enumerate(zip(offloaded_logits, plain_logits)):
        assert got.shape == want.shape and torch.equal(got, want), f"step {step}: logits differ"
    pools = engine.runner.pools
    assert isinstance(pools, OffloadedPools)
    for pool in pools._dsa_layers():
        held = pool.hot.position
        assert pool.hot.rows.shape[0] == 2 * HOT_ROWS  # the device holds hot_rows per running slot, no more
        for slot in range(2):
            rows = held[slot][held[slot] >= 0]
            assert 0 < rows.numel() <= HOT_ROWS and rows.unique().numel() == rows.numel()
    device = pools.nbytes()
    assert device["dsa_latent"] == 2 * HOT_ROWS * 24 * 4  # hot buffers only (24 fp32 values per row)
    assert device["host_dsa_latent"] == pools.num_blocks * 16 * 24 * 4 and pools.layers[3].latent.device.type == "cpu"
    assert pools.stats()["rows_moved"] > 0 and pools.stats()["host_read_rows"] > 0


@torch.no_grad()
@torch.no_grad()
def test_prefix_hits_with_offload_give_the_plain_tokens(model, prompts):
    shared = prompts[0][:256]
    requests = [shared + [5, 6, 7], shared + [9, 8]]  # the second hits the first's blocks (host tier rows)
    params = SamplingParams(max_tokens=4)

    def run(offload):
        engine = Engine(model, _service(offload, prefix=True))
        return [o.token_ids for o in engine.generate(requests[:1], params, use_tqdm=False)
                + engine.generate(requests[1:], params, use_tqdm=False)], engine

    (plain, _), (offloaded, engine) = run(None), run(ON)
    assert offloaded == plain and engine.stats()["prefix_hit_tokens"] >= 256


@torch.no_grad()
def test_bytes_moved_per_step_are_the_selected_rows_not_already_hot(model, prompts, monkeypatch):
    import latentmoe_lab.layers.dsa_paged as dsa_paged

    selections = []
    original = dsa_paged.paged_index_topk

    def recording(*args, **kwargs):
        positions = original(*args, **kwargs)
        selections.append(positions)
        return positions

    monkeypatch.setattr(dsa_paged, "paged_index_topk", recording)
    engine = Engine(model, _service(ON))
    rid = engine.add_request(prompts[0][:300], SamplingParams(max_tokens=8))
    sequence = engine.sequence(rid)
    pool = engine.runner.pools.layers[3]
    while sequence.num_computed < len(sequence.prompt_ids):
        engine.step()
    checked = 0
    while sequence.status != Status.FINISHED:
        before = set(pool.hot.position[sequence.slot].tolist()) - {-1}
        table, slot = torch.tensor(sequence.block_table), sequence.slot
        moved, selections[:] = pool.hot.rows_moved, []
        engine.step()
        (positions,) = selections  # one decode, one DSA layer: [1, 1, top-k] in sequence coordinates
        flat = set((table[positions[0, 0] // 16] * 16 + positions[0, 0] % 16).tolist())
        after = set(pool.hot.position[slot].tolist()) - {-1}
        assert pool.hot.rows_moved - moved == len(flat - before)
        assert flat <= after and len(after) <= HOT_ROWS
        checked += 1
    assert checked == 7  # every decode after the prompt's first token
    assert engine.runner.pools.stats()["bytes_moved"] == engine.runner.pools.stats()["rows_moved"] * 24 * 4


def test_hot_buffer_swaps_only_missing_rows_and_never_serves_a_rewritten_row():
    fmt, dim, rows = PlainFormat(torch.float32), 3, 5
    host = fmt.allocate(4, 4, dim)
    fmt.write(host, torch.arange(16), torch.arange(48, dtype=torch.float32).view(16, 3))
    host_rows = host.view(16, -1)
    hot = HotBuffer(fmt, dim, hot_slots=2, hot_rows=rows, device="cpu")
    held: set[int] = set()
    for step, wanted in enumerate([[3, 1, 4], [1, 5, 9, 2], [6, 5, 3, 1, 4], [0], [15, 14, 13, 12, 11]]):
        moved = hot.rows_moved
        flat = hot.swap_in(1, torch.tensor(wanted), host_rows)
        assert hot.rows_moved - moved == len(set(wanted) - held), step
        torch.testing.assert_close(fmt.read(hot.storage, flat), fmt.read(host, torch.tensor(wanted)), rtol=0, atol=0)
        held = set(hot.position[1].tolist()) - {-1}
        assert set(wanted) <= held and len(held) <= rows
    assert (hot.position[0] == -1).all()  # another slot's buffer is untouched
    hot.invalidate(torch.tensor([13]))  # the host row is rewritten: its hot copy must go
    fmt.write(host, torch.tensor([13]), torch.full((1, dim), -7.0))
    flat = hot.swap_in(1, torch.tensor([13]), host_rows)
    assert fmt.read(hot.storage, flat).eq(-7.0).all()
    with pytest.raises(ValueError, match="hot_rows_per_layer"):
        hot.swap_in(1, torch.arange(6), host_rows)


def test_bad_offload_settings_name_the_key(tiny_config):
    with pytest.raises(ValueError, match="memory.offload.host_cache_bytes: .* fewer than one model.max_model_len"):
        plan_cache(tiny_config, _service({"host_cache_bytes": 10_000}))
    with pytest.raises(ValueError, match=r"memory.offload.hot_rows_per_layer: \(16\) must be >= indexer.topk"):
        plan_cache(tiny_config, _service({"host_cache_bytes": 2_000_000, "hot_rows_per_layer": 16}))
    for offload, message in (({}, "host_cache_bytes: required"), ({"hot_rows": 64}, "memory.offload.hot_rows: unknown"),
                             (0, "memory.offload: expected a mapping"),
                             ({"host_cache_bytes": -5}, "host_cache_bytes: must be a positive integer")):
        with pytest.raises(ValueError, match=message):
            _service(offload)


def test_offload_plan_and_the_one_million_token_figures():
    config = ModelConfig.from_preset("k3-2.8t")
    tiers = request_tier_bytes(config, 2 ** 20, "fp8")
    assert tiers["host: dsa_latent"] == 24 * 2 ** 20 * 656 and tiers["device: dsa_index"] == 24 * 2 ** 20 * 132
    assert tiers["device: dsa_hot_buffers"] == 24 * 4096 * 656
    rows = decode_roofline(config, ParallelConfig(tp=8, ep=8, pp=2), HARDWARE["H200-141GB"], swap_fraction=0.5)
    assert rows["indexer scan"]["bytes"] == 24 * 2 ** 20 * 132  # docs: 3.3 GB per token
    assert rows["top-k gather"]["bytes"] == 24 * 2048 * 656 and rows["host -> hot swap"]["bytes"] == 12 * 2048 * 656
    assert rows["KDA state r/w"]["bytes"] == 69 * 2 * 12 * 128 * 128 * 4  # 96 heads / TP 8
    assert rows["indexer scan"]["seconds"] > rows["top-k gather"]["seconds"] + rows["sparse attention"]["seconds"]
    shared = decode_roofline(config.replace(dsa={"index_share_every": 2}), ParallelConfig(tp=8, ep=8, pp=2),
                             HARDWARE["H200-141GB"])
    assert shared["indexer scan"]["layers"] == 12 and shared["total"]["seconds"] < rows["total"]["seconds"]
    sharing, pconfig = config.replace(dsa={"index_share_every": 2}), ParallelConfig(tp=8, ep=8, pp=2)
    source, reuser = (layer_time(sharing, pconfig, HARDWARE["H200-141GB"], Workload(), i, 0.0, 1.0, 2 ** 20, True)
                      for i in (3, 7))  # the first two DSA layers: 7 reuses 3's selection
    scan = 2 ** 20 * 132 / HARDWARE["H200-141GB"].hbm_bandwidth  # every fp8 index key read, bandwidth-bound
    assert sharing.index_source(7) == 3 and source["compute"] - reuser["compute"] == pytest.approx(scan)


def test_plan_service_prints_the_tiers_and_the_roofline():
    from latentmoe_lab.serving.service_plan import service_plan_text

    service = ServiceConfig.from_dict({
        "model": {"max_model_len": 1048576, "dtype": "fp8"},
        "parallel": {"tensor_parallel_size": 8, "expert_parallel_size": 8, "pipeline_parallel_size": 2},
        "memory": {"kv_cache_dtype": "fp8", "max_num_seqs": 8,
                   "offload": {"host_cache_bytes": 400_000_000_000, "hot_rows_per_layer": 4096}},
        "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 8192}})
    text = service_plan_text(service, ModelConfig.from_preset("k3-2.8t"))
    assert "host tier: dsa_latent (not in total)" in text and "dsa_hot_buffers" in text  # the per-device plan
    assert "host: dsa_latent                16.51 GB" in text  # 24 layers x 2^20 x 656 B
    assert "indexer scan             24     3.32 GB" in text and "host -> hot swap" in text
