"""No rank builds the whole model; a rank killed in training stops the run within its timeout."""
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.parallel.launch import RankFailure, launch

# A wide vocabulary makes the embeddings and the head most of the weights (2 x 200_000 x 64 fp32 = 102 MB),
# so "the shard" is clearly half of "the model".
BIG_VOCAB = 200_000


def _config() -> ModelConfig:
    return ModelConfig.from_preset("tiny").replace(vocab_size=BIG_VOCAB)


def _build_and_measure(layout: NativeLayout, checkpoint: str) -> dict:
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(60)
    torch.set_num_threads(1)
    mesh = build_mesh(layout)
    with torch.device("meta"):  # the first meta build imports sympy & co (~150 MB, once per process): not the model
        LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    process = psutil.Process()

    def anonymous() -> int:  # resident minus file-backed: the safetensors file is mmapped, its pages are page cache
        info = process.memory_info()
        return info.rss - info.shared

    before = anonymous()
    peak, done = [before], threading.Event()

    def sample() -> None:  # ru_maxrss would include the parent's peak, inherited through fork
        while not done.is_set():
            peak[0] = max(peak[0], anonymous())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        native = build_native(_config(), layout, mesh, checkpoint=checkpoint)
    finally:
        done.set()
        sampler.join()
    local_bytes = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
                      for p in native.module.parameters())
    return {"growth": peak[0] - before, "local_bytes": local_bytes}


def test_peak_memory_per_rank_is_its_shard_plus_a_constant(tmp_path):
    full = LatentMoEForCausalLM(_config())
    full_bytes = sum(p.nbytes for p in full.parameters())
    full.save_pretrained(tmp_path / "ck")
    del full
    results = launch(_build_and_measure, 2, args=(NativeLayout(dp_shard=2), str(tmp_path / "ck")), timeout_s=180)
    for result in results:
        assert result["local_bytes"] <= full_bytes / 2 + 4096  # FSDP2's shard: half of every tensor (+ padding)
        # the peak while building and loading: the shard, plus read buffers and allocator slack
        assert result["growth"] <= result["local_bytes"] + 48 * 2**20, (result, full_bytes)
        assert result["growth"] < 0.8 * full_bytes


def _train_until_killed(victim: int) -> None:
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(20)
    torch.set_num_threads(1)
    layout = NativeLayout(dp_shard=2)
    config = ModelConfig.from_preset("tiny")
    trainer = NativeTrainer(build_native(config, layout, build_mesh(layout)))
    batch = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    for step in range(50):
        if step == 2 and torch.distributed.get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(batch)


def test_a_killed_rank_stops_training_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1"):
        launch(_train_until_killed, 2, args=(1,), timeout_s=90)
    assert time.monotonic() - start < 90
