"""MTP for every request (docs/design.md §12, serving/spec/hidden_rows.py): a request whose first positions came
from the prefix cache, a prefill instance's transfer or a spill restore drafts like the others, its MTP drafter
starting from the hidden row kept beside the KDA slot row it resumed from.

Every combination of {ngram, mtp} x {prefix hit, P/D import, spill restore} x {adaptive K, fixed K with a
k = 0 step forced right after every step that accepted drafts}: greedy outputs equal model.generate, the
restored or imported request has drafts verified and accepted, its first MTP input starts at the row before
its first computed position and that row is the donor's (bit for bit) and the plain forward's (to rounding),
and everything goes back after the drain. Then an abort of such a request mid-run, the planner's bytes
against the allocation, the payload's against bytes_per_request, and the disk tier's entry with its row.

The model is tests/spec_cases.py's echo with its embeddings scaled further, so that the restored requests
repeat tokens often enough for both drafters to have drafts accepted (and rejected) within a few steps.
"""
import copy
import json
import struct

import pytest
import torch

from spec_cases import echo_model  # noqa: F401

from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.cache_tiers.spill_disk import SpillRefused
from latentmoe_lab.serving.planner import pools_bytes
from latentmoe_lab.serving.spec.draft_count import DraftCount
from latentmoe_lab.serving.transport import (bytes_per_request, decode, encode, import_request, prefill_step,
                                             release_exported)
from latentmoe_lab.serving.transport.wire import payload_tensor_bytes

K = 3
BLOCK = 16
NEW_TOKENS = 12
SOURCES = ["prefix-hit", "import", "spill"]


class Watched(DraftCount):
    """The engine's draft count, per request: every (drafts, accepted) a step judged, and with zero_after_accept
    k = 0 for the step right after one that accepted drafts."""

    def __init__(self, spec, zero_after_accept: bool):
        super().__init__(spec)
        self.zero_after_accept, self.steps, self.accepted_last = zero_after_accept, {}, set()

    def observe(self, request_id, drafts, accepted):
        super().observe(request_id, drafts, accepted)
        self.steps.setdefault(request_id, []).append((drafts, accepted))
        if accepted:
            self.accepted_last.add(request_id)

    def choose(self, request_id, context):
        k = super().choose(request_id, context)
        if self.zero_after_accept and request_id in self.accepted_last:
            k = 0
        self.accepted_last.discard(request_id)
        return k


def service(method=None, mode="adaptive", cache_bytes=3_000_000, prefix_cache=None, max_num_seqs=4,
            max_model_len=256, parallel=None) -> ServiceConfig:
    data = {"model": {"max_model_len": max_model_len}, "parallel": parallel or {},
            "memory": {"cache_bytes": cache_bytes, "block_size": BLOCK, "max_num_seqs": max_num_seqs,
                       **({"prefix_cache": prefix_cache} if prefix_cache else {})},
            "scheduler": {"prefill_chunk_size": 32, "max_batch_size": 8}}
    if method is not None:
        data["speculative"] = {"method": method, "num_speculative_tokens": K, "adaptive": mode == "adaptive"}
    return ServiceConfig.from_dict(data)


def spill_service(model, method, mode, parallel=None) -> ServiceConfig:
    """One running sequence (K + 1 slots), 2 snapshot rows and 9 blocks of 16 tokens on the device, a host tier
    behind them: three 4-block prefixes taking turns evict each other to the host."""
    cache = {"snapshot_slots": 2, "host_bytes": 1 << 22}
    probe = service(method, mode, prefix_cache=cache, max_num_seqs=1, max_model_len=128)
    block, slot = pools_bytes(model.config, probe, 1, 0), pools_bytes(model.config, probe, 0, 1)
    return service(method, mode, (K + 1 + 2) * slot + 9 * block, cache, 1, 128, parallel)


def watch(engine, mode):
    """The engine's speculator, watched: its draft count (Watched) and every MTP input, request id -> [(tokens,
    hidden rows)]."""
    speculator = engine.speculator
    count = speculator.draft_count = Watched(engine.config.speculative, mode == "zero-after-accept")
    inputs, propose_batch = {}, speculator.drafter.propose_batch

    def recording(requests):
        for request_id, draft_input, _ in requests:
            hidden = None if draft_input.hidden is None else draft_input.hidden.clone()
            inputs.setdefault(request_id, []).append((list(draft_input.tokens), hidden))
        return propose_batch(requests)

    speculator.drafter.propose_batch = recording
    return count, inputs


@pytest.fixture(scope="module")
def model(echo_model):
    """The echo model, embeddings (and the LM head copied from them) 7x the random ones instead of 5x."""
    model = copy.deepcopy(echo_model)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(1.4)
        model.lm_head.weight.copy_(model.embed_tokens.weight)
    return model


@pytest.fixture(scope="module")
def prompts():
    """Three 4-block prefixes, each with two suffixes of its own."""
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 256, (4 * BLOCK,), generator=g).tolist() for _ in range(3)]
    suffixes = ([1, 2, 3], [9, 9, 9, 9], [5])
    return [prefix + suffix for prefix in prefixes for suffix in suffixes[:2]] + [prefixes[0] + suffixes[2]]


@pytest.fixture(scope="module")
def references(model, prompts):
    return [model.generate(torch.tensor([p]), NEW_TOKENS)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def plain_hidden(model, prompts):
    """prompt index -> the last hidden state before the final norm at every prompt position [len, hidden], from the
    model's plain forward."""
    rows = {}
    for i, prompt in enumerate(prompts):
        captured = []
        hook = model.norm.register_forward_hook(lambda module, args, out: captured.append(args[0][0]))
        with torch.no_grad():
            model(torch.tensor([prompt]))
        hook.remove()
        rows[i] = captured[0]
    return rows


def run_one_at_a_time(engine, prompts, order):
    """Each prompt of `order` served alone -> {prompt index: finished output}."""
    return {i: engine.generate([prompts[i]], SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)[0] for i in order}


def run_imports(model, prompts, order, decode_engine):
    """Each prompt prefilled by an engine without speculation, its payload through the wire into decode_engine,
    then decoded -> ({prompt index: output}, {prompt index: payload})."""
    prefill = Engine(model, service())
    payloads, index_of = {}, {}
    for i in order:
        request = prefill.add_request(prompts[i], SamplingParams(max_tokens=NEW_TOKENS))
        caches = []
        while not caches:
            caches = prefill_step(prefill)[1]
        payloads[i] = encode(caches[0])
        index_of[import_request(decode_engine, decode(payloads[i]))] = i
        release_exported(prefill, request)
    assert prefill.block_manager.blocks_used == 0 and prefill.block_manager.slots_used == 0
    outputs = {}
    while decode_engine.has_unfinished():
        outputs.update({index_of[o.request_id]: o for o in decode_engine.step() if o.finished})
    return outputs, payloads


def serve(model, prompts, method, mode, source):
    """-> (engine, outputs {prompt index: output}, the restored / imported prompt indices, their donors {index:
    prompt index that computed the prefix first}, payloads, count, inputs)."""
    payloads, donors = {}, {}
    if source == "prefix-hit":
        engine = Engine(model, service(method, mode, prefix_cache={"snapshot_slots": 4}))
        count, inputs = watch(engine, mode)
        outputs = run_one_at_a_time(engine, prompts, [0, 1, 2, 3])  # 1 and 3 hit the prefix of 0 and 2
        donors = {1: 0, 3: 2}
    elif source == "import":
        engine = Engine(model, service(method, mode))
        count, inputs = watch(engine, mode)
        outputs, payloads = run_imports(model, prompts, [0, 3, 5], engine)
        donors = {0: None, 3: None, 5: None}
    else:
        engine = Engine(model, spill_service(model, method, mode))
        count, inputs = watch(engine, mode)
        outputs = run_one_at_a_time(engine, prompts, [0, 2, 4, 1])  # 1: prefix 0 again, read back from the host
        assert engine.stats()["prefix_hits_host"] >= 1 and engine.stats()["prefix_hits_refused"] == 0
        donors = {1: 0}
    return engine, outputs, donors, payloads, count, inputs


def assert_drained(engine):
    stats = engine.stats()
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
    assert len(engine.block_manager.free_slots) == engine.block_manager.num_slots
    assert stats["snapshots"] <= engine.block_manager.num_snapshots
    drafter, count = engine.speculator.drafter, engine.speculator.draft_count
    assert getattr(drafter, "states", {}) == {} and count.acceptance == {} and count.idle == {}
    if hasattr(drafter, "pools"):  # the batched MTP drafter's blocks
        assert drafter.pools.blocks_used == 0


def request_ids(engine, outputs):
    return {i: out.request_id for i, out in outputs.items()}


@pytest.mark.parametrize("mode", ["adaptive", "zero-after-accept"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_restored_and_imported_requests_draft_and_stay_exact(model, prompts, references, plain_hidden, method, mode,
                                                             source):
    engine, outputs, donors, payloads, count, inputs = serve(model, prompts, method, mode, source)
    for i, out in outputs.items():
        assert out.error is None and out.token_ids == references[i], i
    ids = request_ids(engine, outputs)
    for i, donor in donors.items():
        metrics, steps = outputs[i].metrics, count.steps[ids[i]]
        resumed = len(prompts[i]) if source == "import" else metrics.prefix_hit_tokens
        assert resumed > 0  # it came from the cache or the transfer
        assert sum(d for d, _ in steps) > 0 and metrics.spec_accepted_tokens > 0, (i, steps)  # it drafted
        if mode == "zero-after-accept":  # a step without drafts right after one that accepted some
            assert any(a > 0 and later == 0 for (_, a), (later, _) in zip(steps, steps[1:])), steps
        if method == "mtp":  # its MTP history starts at the row before its first computed position
            tokens, hidden = inputs[ids[i]][0]
            assert tokens == (prompts[i] + references[i])[resumed - 1:len(tokens) + resumed - 1]
            assert hidden.shape[0] == len(tokens) - 1
            torch.testing.assert_close(hidden[0], plain_hidden[i][resumed - 1], atol=1e-4, rtol=1e-4)
            if donor is not None:  # bit for bit what the donor's step computed there
                assert torch.equal(hidden[0], inputs[ids[donor]][0][1][resumed - 1])
            else:
                assert torch.equal(hidden[0], decode(payloads[i]).mtp_hidden[0])
    for i, payload in payloads.items():  # planned == measured, the hidden row included
        assert decode(payload).mtp_hidden.shape == (1, model.config.hidden_size)
        assert payload_tensor_bytes(payload) == bytes_per_request(model.config, len(prompts[i]), "fp32", "fp32")
    assert_drained(engine)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_an_abort_after_drafting_gives_everything_back(model, prompts, method, source):
    long = SamplingParams(max_tokens=40)
    if source == "import":
        engine = Engine(model, service(method))
        run_imports(model, prompts, [1], engine)  # drained
        prefill = Engine(model, service())
        request = prefill.add_request(prompts[3], long)
        caches = []
        while not caches:
            caches = prefill_step(prefill)[1]
        target = import_request(engine, decode(encode(caches[0])))
        release_exported(prefill, request)
    else:
        engine = (Engine(model, service(method, prefix_cache={"snapshot_slots": 4})) if source == "prefix-hit"
                  else Engine(model, spill_service(model, method, "adaptive")))
        run_one_at_a_time(engine, prompts, [0, 2, 4] if source == "spill" else [0])
        target = engine.add_request(prompts[1], long)
    seq = engine.sequence(target)
    while seq.spec_draft_tokens == 0 and len(seq.generated_ids) < 30:
        engine.step()
    assert seq.spec_draft_tokens > 0 and (seq.prefix_hit_tokens > 0 or source == "import")
    engine.abort(target)
    assert_drained(engine)
    engine.reset()  # and the prefix cache forgotten: nothing cached, nothing held
    stats = engine.stats()
    assert (stats["blocks_used"], stats["slots_used"], stats["cached_blocks"], stats["snapshots"]) == (0, 0, 0, 0)


def test_the_planner_counts_the_hidden_rows(model):
    """Planned == allocated: the pools and one hidden row per KDA slot row; a model without an MTP head keeps
    none; a pipeline stage's plan has none (the rows stay in the engine's process)."""
    from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
    from latentmoe_lab.serving.config import serving_layout
    from latentmoe_lab.serving.workers.pipeline_stage import plan_stages

    for method in (None, "ngram", "mtp"):
        engine = Engine(model, service(method, prefix_cache={"snapshot_slots": 4}))
        plan, rows = engine.plan, engine.slot_hidden
        assert rows.rows.shape == (plan.pool_rows, model.config.hidden_size)
        assert sum(engine.runner.pools.nbytes().values()) + rows.nbytes == plan.total_bytes
        assert plan.bytes_by_kind()["mtp_hidden_rows"] == rows.nbytes == plan.pool_rows * 4 * 64
    torch.manual_seed(0)
    plain = Engine(LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval(), service())
    assert plain.slot_hidden is None and "mtp_hidden_rows" not in plain.plan.bytes_by_kind()
    assert sum(plain.runner.pools.nbytes().values()) == plain.plan.total_bytes
    pp = ServiceConfig.from_dict({**service().to_dict(), "parallel": {"pipeline_parallel_size": 2}})
    for stage in plan_stages(model.config, pp, serving_layout(model.config, pp.parallel)):
        assert stage.plan.config.mtp_depth == 0 and "mtp_hidden_rows" not in stage.plan.bytes_by_kind()


def test_a_disk_entry_carries_the_row_under_its_checksum(model, prompts, references, tmp_path):
    """A closed engine's snapshots go to disk with their hidden rows; a new engine on the directory restores one
    and drafts from its row; a flipped byte of a row is refused like any other; an entry without a row (as an
    older file) is served, its request drafting from the rows computed after the boundary."""
    from safetensors.torch import load_file

    cache = {"snapshot_slots": 4, "disk_dir": str(tmp_path)}
    first = Engine(model, service("mtp", prefix_cache=cache))
    run_one_at_a_time(first, prompts, [0, 2])
    first.close()
    files = {path: load_file(path) for path in tmp_path.glob("*/*.kda.safetensors")}
    assert files and all(t["mtp.hidden"].shape == (model.config.hidden_size,) for t in files.values())

    second = Engine(model, service("mtp", prefix_cache=cache))
    count, inputs = watch(second, "adaptive")
    out = run_one_at_a_time(second, prompts, [1])[1]
    assert out.token_ids == references[1] and second.stats()["prefix_hits_disk"] == 1
    resumed = out.metrics.prefix_hit_tokens
    assert resumed > 0 and out.metrics.spec_accepted_tokens > 0
    assert inputs[out.request_id][0][0][0] == prompts[1][resumed - 1]  # drafted from the restored row

    manager = second.block_manager
    disk, expected, optional = manager.disk, manager.expected["kda"], manager.store.optional("kda")
    kda = [key for key in disk.files if key[1] == "kda"]
    path = disk.directory / f"{kda[0][0].hex()}.kda.safetensors"
    data = bytearray(path.read_bytes())
    (header_bytes,) = struct.unpack("<Q", data[:8])  # safetensors: header length, JSON header, then the data
    data[8 + header_bytes + json.loads(data[8:8 + header_bytes])["mtp.hidden"]["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SpillRefused, match="checksum"):
        disk.get(*kda[0], expected, optional)
    for key in kda[1:]:  # rewritten without their rows, checksummed again (as a file written before the rows)
        tensors = disk.get(*key, expected, optional)
        disk.discard(*key)
        disk.put(*key, {name: t for name, t in tensors.items() if name != "mtp.hidden"})
    third = Engine(model, service("mtp", prefix_cache=cache))
    count, inputs = watch(third, "adaptive")
    outputs = run_one_at_a_time(third, prompts, [1, 3])
    assert [outputs[i].token_ids for i in (1, 3)] == [references[1], references[3]]
    assert third.stats()["prefix_hits_disk"] >= 1 and third.stats()["prefix_hits_refused"] == 0
    for i in (1, 3):  # a row-less hit drafts from the first position it computed
        resumed = outputs[i].metrics.prefix_hit_tokens
        if resumed:
            assert inputs[outputs[i].request_id][0][0][0] == prompts[i][resumed]
    assert third.stats()["spec_draft_tokens"] > 0


def test_on_worker_processes_the_rows_stay_in_the_engines_process(model, prompts, references):
    """tp 2: the pools are the workers', the hidden rows the engine's; a request read back from the host tier
    drafts from its donor's row all the same (the spill moves the KDA rows through the workers, the hidden
    row beside them in the engine's process)."""
    engine = Engine(model, spill_service(model, "mtp", "adaptive", {"tensor_parallel_size": 2}))
    try:
        count, inputs = watch(engine, "adaptive")
        outputs = run_one_at_a_time(engine, prompts, [0, 2, 4, 1])
        stats = engine.stats()
    finally:
        engine.close()
    assert {i: out.token_ids for i, out in outputs.items()} == {i: references[i] for i in outputs}
    assert stats["prefix_hits_host"] >= 1 and stats["worker_restarts"] == 0
    resumed, target = outputs[1].metrics.prefix_hit_tokens, outputs[1].request_id
    assert resumed > 0 and outputs[1].metrics.spec_accepted_tokens > 0
    assert torch.equal(inputs[target][0][1][0], inputs[outputs[0].request_id][0][1][resumed - 1])
    assert (stats["blocks_used"], stats["slots_used"]) == (0, 0)
