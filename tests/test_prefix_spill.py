"""Prefix cache spill (serving/prefix_spill*.py): evicted blocks and KDA snapshots go to host and disk and
come back on a hit, bit for bit; a missing, corrupt or foreign entry is refused and recomputed, never served.

The service is batch-invariant (a hit changes no bit of a request's logits, docs/design.md §6.5), so "a hit
equals a fresh run" is checked with torch.equal on every logits row sampled from. The device holds 9 blocks
and 2 snapshots: three 256-token prefixes take turns, so every second visit of a prefix finds it spilled.
"""
import errno
import os
import subprocess
import sys

import pytest
import torch

from prometheus_client.parser import text_string_to_metric_families

from latentmoe_lab.server.prom import ServerMetrics
from latentmoe_lab.serving import Engine, ServiceConfig
from latentmoe_lab.serving.cache_tiers.spill_host import HostTier

from spill_cases import BLOCK, PARAMS, block_views, pool_store, prompts, serve, spill_service  # noqa: F401


def service(model, spill=None, prefix=True, kv_cache_dtype="auto") -> ServiceConfig:
    return spill_service(model, spill, prefix=prefix, kv_cache_dtype=kv_cache_dtype, batch_invariant=True)


@pytest.fixture(scope="module")
def fresh(model, prompts):
    return serve(Engine(model, service(model, prefix=False)), prompts)


def assert_same(run, fresh):
    tokens, rows = run
    assert tokens == fresh[0]
    assert len(rows) == len(fresh[1]) == 6 * PARAMS.max_tokens
    assert all(torch.equal(a, b) for a, b in zip(rows, fresh[1]))


def spill_samples(stats) -> dict:
    """/metrics samples of the spill's counters after a server observed these engine stats."""
    metrics = ServerMetrics()
    metrics.observe_engine(stats)
    return {(s.name, *s.labels.values()): s.value for f in text_string_to_metric_families(metrics.exposition().decode())
            for s in f.samples if s.name.startswith(("latentmoe_prefix_hits", "latentmoe_prefix_spill"))}


def assert_drained(engine):
    stats = engine.stats()
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)


@pytest.mark.parametrize("tier, prefix_cache", [("host", {"host_bytes": 1 << 20}), ("disk", {"host_bytes": 0})])
def test_a_spilled_hit_equals_a_fresh_run(model, prompts, fresh, tmp_path, tier, prefix_cache):
    engine = Engine(model, service(model, prefix_cache | {"disk_dir": str(tmp_path)}))
    assert_same(serve(engine, prompts), fresh)
    stats = engine.stats()
    assert stats[f"prefix_hits_{tier}"] == 3 and stats["prefix_hit_tokens"] == 3 * 4 * BLOCK
    assert stats["prefix_hits_refused"] == 0
    assert stats[f"spill_bytes_{tier}_to_device"] > 0 and stats["spill_bytes_device_to_host"] > 0
    assert (stats["spill_host_bytes"] > 0) == (tier == "host") and (stats["spill_disk_bytes"] > 0) == (tier == "disk")
    assert_drained(engine)
    samples = spill_samples(stats)
    assert samples[("latentmoe_prefix_hits_total", tier)] == 3 and samples[("latentmoe_prefix_hits_total", "refused")] == 0
    assert samples[("latentmoe_prefix_spill_bytes_total", f"{tier}_to_device")] == stats[f"spill_bytes_{tier}_to_device"]
    host = engine.block_manager.host
    engine.reset()  # forgets the device's prefix cache, not the spill
    assert engine.block_manager.host is host and engine.stats()[f"prefix_hits_{tier}"] == 3


def test_without_a_spill_the_small_device_cache_misses(model, prompts, fresh):
    engine = Engine(model, service(model))
    assert_same(serve(engine, prompts), fresh)
    assert engine.stats()["prefix_hit_tokens"] == 0 and "prefix_hits_host" not in engine.stats()
    assert spill_samples(engine.stats()) == {}  # no spill, no series


@pytest.fixture
def written(model, prompts, tmp_path):
    """A disk spill directory written by one engine (every prefix's blocks and snapshot on disk)."""
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path)}))
    serve(engine, prompts)
    engine.close()  # writes what the device still holds
    directory = engine.block_manager.disk.directory
    assert len(list(directory.glob("*.rows.safetensors"))) == 3 * 4
    return directory


def test_a_restarted_engine_reuses_the_disk_spill(model, prompts, fresh, tmp_path, written):
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path)}))
    assert_same(serve(engine, prompts), fresh)
    stats = engine.stats()
    assert stats["prefix_hits_disk"] == 6 and stats["prefix_hit_tokens"] == 6 * 4 * BLOCK  # even first visits
    assert_drained(engine)


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # in the last tensor's bytes: the file still parses, only the checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_a_damaged_snapshot_is_refused_and_recomputed(model, prompts, fresh, tmp_path, written, damage):
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path)}))  # it lists the files, then they change
    snapshots = sorted(written.glob("*.kda.safetensors"))
    assert len(snapshots) == 3
    for path in snapshots[:2]:
        flip_last_byte(path) if damage == "corrupt" else path.unlink()
    assert_same(serve(engine, prompts), fresh)
    stats = engine.stats()
    assert stats["prefix_hits_refused"] == 2
    assert stats["prefix_hit_tokens"] == 4 * 4 * BLOCK  # 2 refused first visits recompute; 4 hits remain
    assert_drained(engine)


def test_a_corrupt_block_file_ends_the_hit_before_it(model, prompts, fresh, tmp_path, written):
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path)}))
    for path in sorted(written.glob("*.rows.safetensors")):
        flip_last_byte(path)
    assert_same(serve(engine, prompts), fresh)
    stats = engine.stats()
    assert stats["prefix_hits_refused"] >= 3 and stats["prefix_hit_tokens"] < 6 * 4 * BLOCK


def test_another_models_spill_is_never_served(model, prompts, tmp_path, written):
    torch.manual_seed(1)
    other = type(model)(model.config).eval()
    other_fresh = serve(Engine(other, service(other, prefix=False)), prompts)
    engine = Engine(other, service(other, {"disk_dir": str(tmp_path)}))
    own = engine.block_manager.disk.directory
    assert own != written and own.parent == written.parent  # keyed by the weights' hash
    for path in written.glob("*.safetensors"):  # even copied into its own directory, a file is refused
        (own / path.name).write_bytes(path.read_bytes())
    engine = Engine(other, service(other, {"disk_dir": str(tmp_path)}))
    assert_same(serve(engine, prompts), other_fresh)
    assert engine.stats()["prefix_hits_refused"] >= 3


def test_an_fp8_cache_spills_its_codes_under_its_own_key(model, prompts, tmp_path, written):
    fresh_fp8 = serve(Engine(model, service(model, prefix=False, kv_cache_dtype="fp8")), prompts)
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path)}, kv_cache_dtype="fp8"))
    assert engine.block_manager.disk.directory != written  # the fp32 cache's files are another key's
    assert engine.block_manager.expected["rows"]["layer3.latent"][0] == torch.uint8  # fp8 codes, not values
    assert_same(serve(engine, prompts), fresh_fp8)
    stats = engine.stats()
    assert stats["prefix_hits_disk"] == 3 and stats["prefix_hits_refused"] == 0


def test_a_directory_of_another_key_or_unwritable_is_an_error_at_start(model, tmp_path, written):
    manifest = written / "spill.json"
    manifest.write_text(manifest.read_text().replace('"key": "', '"key": "0'))
    with pytest.raises(ValueError, match=r"memory.prefix_cache.disk_dir: .* was written for another model or cache"):
        Engine(model, service(model, {"disk_dir": str(tmp_path)}))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"memory.prefix_cache.disk_dir: cannot write the spill directory .*\(key "):
        Engine(model, service(model, {"disk_dir": str(blocker / "spill")}))


def test_the_disk_tier_keeps_within_disk_bytes(model, prompts, fresh, tmp_path):
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path), "disk_bytes": 60_000}))
    assert_same(serve(engine, prompts), fresh)
    assert 0 < engine.stats()["spill_disk_bytes"] <= 60_000
    assert sum(p.stat().st_size for p in engine.block_manager.disk.directory.glob("*.safetensors")) <= 60_000


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_a_failing_disk_drops_entries_not_requests(model, prompts, fresh, tmp_path, monkeypatch, code):
    """A failed write costs its entry, never a request; a full disk (ENOSPC, EFBIG) stops the writes after
    the first (it used to escape as a SafetensorError and reset the server's engine once per spill)."""
    def failing_disk(path, data):
        path.write_bytes(data[:100])  # part of it made it to the disk
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("latentmoe_lab.serving.cache_tiers.spill_disk.write_file", failing_disk)
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path)}))
    assert_same(serve(engine, prompts), fresh)
    engine.close()  # the flush of what the device holds meets the same disk
    stats = engine.stats()
    assert stats["spill_disk_bytes"] == 0 and stats["prefix_hit_tokens"] == 0
    full = code != errno.EIO
    assert engine.block_manager.disk.full == full
    assert (stats["spill_disk_write_errors"] == 1) == full and stats["spill_disk_write_errors"] >= 1
    assert not list(engine.block_manager.disk.directory.glob("*.tmp"))


def test_a_spill_entry_that_became_a_directory_is_refused_and_recomputed(model, prompts, fresh, tmp_path,
                                                                         written):
    engine = Engine(model, service(model, {"disk_dir": str(tmp_path)}))
    snapshots = sorted(written.glob("*.kda.safetensors"))
    for path in snapshots[:2]:
        path.unlink()
        path.mkdir()  # IsADirectoryError used to escape (an HTTP 500 through the server)
    assert_same(serve(engine, prompts), fresh)
    assert engine.stats()["prefix_hits_refused"] == 2
    assert all(path.is_dir() for path in snapshots[:2])  # not ours to remove
    assert_drained(engine)


FIFO_SCRIPT = """
import os, sys, torch
from latentmoe_lab.serving.cache_tiers.spill_disk import DiskTier, SpillRefused
tier = DiskTier(sys.argv[1], "ab" * 32, {"what": "test"})
tensors, expected = {"x": torch.arange(6.0).reshape(2, 3)}, {"x": (torch.float32, (2, 3))}
fifo, link = bytes([1] * 8), bytes([2] * 8)
for key in (fifo, link):
    tier.put(key, "rows", tensors)
    assert torch.equal(tier.get(key, "rows", expected)["x"], tensors["x"])
    os.unlink(tier._path(key, "rows"))
os.mkfifo(tier._path(fifo, "rows"))  # nobody ever writes to it
os.symlink("/dev/zero", tier._path(link, "rows"))
for key in (fifo, link):
    try:
        tier.get(key, "rows", expected)
    except SpillRefused as error:
        print("refused:", error)
"""


FILE_SIZE_LIMIT_SCRIPT = """
import resource, signal, sys, torch
from latentmoe_lab.serving.cache_tiers.spill_disk import DiskTier
tier = DiskTier(sys.argv[1], "cd" * 32, {"what": "test"})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
for i in range(3):
    tier.put(bytes([i] * 8), "rows", {"x": torch.zeros(1000)})
print(tier.write_errors, tier.full, tier.nbytes, sorted(p.name for p in tier.directory.iterdir()))
"""


def test_a_real_file_size_limit_stops_the_spill_writes_without_an_error(tmp_path):
    """EFBIG from the kernel (RLIMIT_FSIZE), not a stand-in: one write error, no exception, nothing left."""
    result = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT_SCRIPT, str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split(None, 3)[:3] == ["1", "True", "0"] and "safetensors" not in result.stdout


def test_a_fifo_or_a_link_in_the_spill_directory_is_refused_without_blocking(tmp_path):
    """A FIFO in place of a spill file used to block the reading thread in open(2), holding the GIL: the
    whole server froze. Run in a child process, so that a regression fails within the timeout."""
    result = subprocess.run([sys.executable, "-c", FIFO_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused:") and "unreadable" in line for line in lines), lines


@pytest.mark.parametrize("section, message", [  # the deprecated keys' refusals: tests/test_cache_config.py
    ({"host_bytes": -1}, "memory.prefix_cache.host_bytes: must be an integer >= 0"),
    ({"disk_bytes": 10}, "memory.prefix_cache.disk_bytes: needs memory.prefix_cache.disk_dir"),
    ({"disk_dir": ""}, "memory.prefix_cache.disk_dir: must not be empty"),
    ({"disk_dir": "x", "snapshot_slots": 0}, "memory.prefix_cache.disk_dir: needs memory.prefix_cache.snapshot_slots"),
    ({"host_bytes": "1 GB"}, "memory.prefix_cache.host_bytes: expected int"),
    ({"hostbytes": 1}, "memory.prefix_cache.hostbytes: unknown key"),
])
def test_config_errors_name_the_key(section, message):
    data = {"memory": {"cache_bytes": 1 << 20, "prefix_cache": section}}
    with pytest.raises(ValueError, match=message):
        ServiceConfig.from_dict(data)


def test_the_host_tier_demotes_its_least_recently_used_entries():
    demoted = []
    host = HostTier(100, lambda h, kind, tensors: demoted.append((h, kind)))
    entry = {"x": torch.zeros(10)}  # 40 bytes
    for name in (b"a", b"b"):
        host.put(name, "rows", dict(entry))
    host.get(b"a", "rows")  # now b is the least recently used
    host.put(b"c", "kda", dict(entry))
    assert demoted == [(b"b", "rows")] and host.nbytes == 80
    assert host.has(b"a", "rows") and host.has(b"c", "kda") and not host.has(b"b", "rows")
    with pytest.raises(ValueError, match="memory.prefix_cache.host_bytes"):
        HostTier(-1)


def fill(pools, kind_views):
    """Write distinct random values into the given pool views; return copies of what was written."""
    g = torch.Generator().manual_seed(len(kind_views))
    for view in kind_views.values():
        view.copy_(torch.randint(0, 100, view.shape, generator=g).to(view.dtype))
    return {name: view.clone() for name, view in kind_views.items()}


def test_rows_and_snapshots_round_trip_through_the_host_tier_byte_for_byte(model):
    from latentmoe_lab.paged_pools import PagedPools
    from latentmoe_lab.serving.cache_tiers.spill import SpillingBlockManager

    pools = PagedPools(model.config, num_blocks=3, block_size=4, num_slots=3)  # 1 running slot + 2 snapshot rows
    bm = SpillingBlockManager(pool_store(pools), HostTier(1 << 30), None, 3, 4, 1, 2)
    h0, h1, h2 = b"h0", b"h1", b"h2"
    blocks = bm.allocate_blocks(2)
    rows = [fill(pools, block_views(pools, "rows", block)) for block in blocks]
    for block_hash, block in zip((h0, h1), blocks):
        bm.register_block(block_hash, block)
    snapshot = fill(pools, block_views(pools, "kda", bm.snapshot_row_for(h1)))
    bm.release_blocks(blocks)
    # a snapshot evicted while its blocks stay: h2's snapshot takes the older rows' place
    bm.register_block(h2, bm.allocate_blocks(1)[0])
    bm.release_blocks([bm.block_of_hash[h2]])
    bm.snapshot_row_for(h2)
    bm.snapshot_row_for(h0)  # both rows now taken by h2 and h0: h1's snapshot was the least recent
    assert bm.host.has(h1, "kda") and h1 in bm.block_of_hash
    held = bm.allocate_blocks(3)  # every block evicted: h0, h1 (and h2) rows to the host tier
    assert bm.host.has(h0, "rows") and bm.host.has(h1, "rows") and not bm.block_of_hash
    assert bm.match_prefix([h0, h1]) == ([], None)  # no room to bring them back: no hit, entries kept
    assert bm.host.has(h0, "rows") and bm.host.has(h1, "kda")
    bm.release_blocks(held)
    for view in [*block_views(pools, "rows", 0).values(), *block_views(pools, "rows", 1).values(),
                 *block_views(pools, "kda", 1).values()]:
        view.zero_()  # what the device held is gone: only the host copies can bring it back
    table, row = bm.match_prefix([h0, h1, b"never seen"])
    assert len(table) == 2 and bm.counts["prefix_hits_host"] == 1
    for block, expected in zip(table, rows):
        assert all(torch.equal(view, expected[name]) for name, view in block_views(pools, "rows", block).items())
    assert all(torch.equal(view, snapshot[name]) for name, view in block_views(pools, "kda", row).items())
    assert not bm.host.has(h0, "rows") and not bm.host.has(h1, "kda")  # moved back, not copied
    bm.release_blocks(table)
    assert bm.blocks_used == 0


def test_a_restored_block_drops_the_hot_copies_of_its_old_rows(model):
    """With DSA rows offloaded (serving/cache_tiers/offload_tier.py), a decode serves a position from the
    sequence's hot buffer when it holds one: a block restored from the spill must not leave its previous rows there."""
    from latentmoe_lab.serving.cache_tiers.offload_tier import OffloadedPools
    from latentmoe_lab.serving.cache_tiers.spill import SpillingBlockManager

    topk = model.config.indexer.topk
    pools = OffloadedPools(model.config, num_blocks=2, block_size=4, num_slots=2, hot_rows=topk, hot_slots=1)
    bm = SpillingBlockManager(pool_store(pools), HostTier(1 << 30), None, 2, 4, 1, 1)
    block = bm.allocate_blocks(1)[0]
    bm.register_block(b"h", block)
    bm.snapshot_row_for(b"h")
    bm.release_blocks([block])
    other = bm.allocate_blocks(2)  # evicts b"h" to the host tier; the blocks now hold other rows
    hot = pools.layers[model.config.layer_types.index("dsa")].hot
    hot.position[0, :8] = torch.arange(8)  # a decode made the old rows of both blocks hot in slot 0
    bm.release_blocks(other)
    table, _ = bm.match_prefix([b"h"])
    restored = torch.arange(4) + 4 * table[0]
    assert not torch.isin(hot.position, restored).any()  # the restored block's positions are hot nowhere
    assert torch.isin(hot.position, torch.arange(8)).sum() == 4  # the other block's copies stay


def test_layers_that_share_an_indexer_spill_their_latent_rows_only():
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.paged_pools import PagedPools
    from latentmoe_lab.serving.cache_tiers.spill import SpillingBlockManager

    config = ModelConfig.from_preset("small").replace(dsa={"index_share_every": 2})  # DSA layers 3 and 7
    pools = PagedPools(config, num_blocks=1, block_size=4, num_slots=2)
    bm = SpillingBlockManager(pool_store(pools), HostTier(1 << 30), None, 1, 4, 1, 1)
    assert sorted(bm.expected["rows"]) == ["layer3.index", "layer3.latent", "layer7.latent"]
    written = fill(pools, block_views(pools, "rows", bm.allocate_blocks(1)[0]))
    bm.register_block(b"h", 0)
    bm.snapshot_row_for(b"h")
    bm.release_blocks([0])
    reused = bm.allocate_blocks(1)  # b"h" evicted to the host tier, its block overwritten
    for view in block_views(pools, "rows", reused[0]).values():
        view.zero_()
    bm.release_blocks(reused)
    table, _ = bm.match_prefix([b"h"])
    assert all(torch.equal(view, written[name]) for name, view in block_views(pools, "rows", table[0]).items())


def test_a_spill_under_offloaded_dsa_rows_equals_a_fresh_run(model, prompts):
    """Both halves of the cache hierarchy at once: latent rows in part A's host tier (9 blocks' worth), the
    prefix cache spilled to host; logits of hits equal a fresh offloaded run without prefix caching."""
    def offloaded(prefix, spill=None):
        data = {"model": {"max_model_len": 512},
                "memory": {"block_size": BLOCK, "max_num_seqs": 1, "cache_bytes": 400_000,
                           **({"prefix_cache": {"snapshot_slots": 2} | (spill or {})} if prefix else {}),
                           "offload": {"host_cache_bytes": 60_000 if prefix else 200_000, "hot_rows_per_layer": 40}},
                "scheduler": {"prefill_chunk_size": 512, "batch_invariant": True, "max_batch_size": 4}}
        return ServiceConfig.from_dict(data)

    fresh = serve(Engine(model, offloaded(False)), prompts)
    engine = Engine(model, offloaded(True, {"host_bytes": 1 << 20}))
    assert engine.plan.num_blocks == 9
    assert_same(serve(engine, prompts), fresh)
    assert engine.stats()["prefix_hits_host"] == 3
