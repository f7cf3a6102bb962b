"""PeakMemory: counts the storages a block allocates and holds, the same on real and meta tensors."""
import torch

from latentmoe_lab.analysis.memory import PeakMemory


def test_counts_new_storages_not_views_inputs_or_in_place_results():
    outside = torch.randn(100, 100)  # 40 kB allocated before the block: never counted
    with PeakMemory() as memory:
        a = torch.empty(1000)  # 4 kB
        b = a * 2  # 4 kB
        del a  # freed: the 40 kB product below sees only b alive
        b.view(10, 100).add_(1)  # a view and an in-place op allocate nothing
        outside.mul_(1.0)
        product = outside @ outside  # 40 kB
    assert memory.peak_bytes == 44_000
    assert memory.current_bytes == 44_000
    del b, product
    assert memory.current_bytes == 0


def test_meta_tensors_replay_the_same_peak():
    def work(device):
        x = torch.ones(256, 64, device=device)
        hidden = (x @ torch.ones(64, 512, device=device)).relu()
        return hidden.softmax(dim=-1).sum(dim=0)

    peaks = []
    for device in ("cpu", "meta"):
        with PeakMemory() as memory:
            work(device)
        peaks.append(memory.peak_bytes)
    assert peaks[0] == peaks[1] > 256 * 512 * 4
