"""Vision tower: 2D rotary positions, merge-window order, per-image attention, shapes and bad inputs."""
import pytest
import torch

from latentmoe_lab import ModelConfig
from latentmoe_lab.layers.vision import VisionTower, patch_positions, rotary_2d
from latentmoe_lab.multimodal.images import patchify, unpatchify


@pytest.fixture
def tower(tiny_config):
    return VisionTower(tiny_config).eval()


def test_rotary_scores_depend_only_on_relative_2d_offsets():
    q, k = torch.randn(2, 3, 16, dtype=torch.float64).unbind(0)

    def score(q_pos, k_pos):
        rq = rotary_2d(q[None], torch.tensor([q_pos[0]]), torch.tensor([q_pos[1]]))
        rk = rotary_2d(k[None], torch.tensor([k_pos[0]]), torch.tensor([k_pos[1]]))
        return (rq * rk).sum(-1)

    base = score((2, 5), (7, 1))
    torch.testing.assert_close(score((12, 9), (17, 5)), base)  # both shifted by (10, 4)
    assert not torch.allclose(score((2, 5), (7, 2)), base)  # a different column offset
    assert not torch.allclose(score((3, 5), (7, 1)), base)  # a different row offset
    torch.testing.assert_close(rotary_2d(q[None], torch.zeros(1), torch.zeros(1)), q[None])


def test_patch_positions_follow_merge_windows():
    rows, cols, owner = patch_positions(torch.tensor([[2, 4], [4, 2]]), merge_size=2)
    # first image, window (0, 0): (0,0) (0,1) (1,0) (1,1); then window (0, 1): (0,2) (0,3) (1,2) (1,3)
    assert rows[:8].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert cols[:8].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert owner.tolist() == [0] * 8 + [1] * 8
    assert rows[8:].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_patchify_round_trips_and_orders_windows():
    image = torch.rand(3, 28, 56)
    patches, grid = patchify(image, patch_size=14, merge_size=2)
    assert grid == (2, 4) and patches.shape == (8, 3 * 14 * 14)
    torch.testing.assert_close(unpatchify(patches, grid, 14, 2, 3), image)
    # patch 1 is the top-right patch of the first 2x2 window: pixels [0:14, 14:28]
    torch.testing.assert_close(patches[1].view(3, 14, 14) * 0.5 + 0.5, image[:, :14, 14:28])
    # patch 4 opens the second window: pixels [0:14, 28:42]
    torch.testing.assert_close(patches[4].view(3, 14, 14) * 0.5 + 0.5, image[:, :14, 28:42])


@torch.no_grad()
def test_tower_shapes_and_images_do_not_see_each_other(tower, tiny_config):
    a, grid_a = patchify(torch.rand(3, 56, 28), 14, 2)
    b, grid_b = patchify(torch.rand(3, 28, 84), 14, 2)
    both = tower(torch.cat([a, b]), torch.tensor([grid_a, grid_b]))
    assert both.shape == (2 + 3, tiny_config.hidden_size)
    torch.testing.assert_close(both[:2], tower(a, torch.tensor([grid_a])), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[2:], tower(b, torch.tensor([grid_b])), atol=1e-5, rtol=1e-5)
    assert tower.tokens_per_image(torch.tensor([grid_a, grid_b])).tolist() == [2, 3]


def test_tower_backward_reaches_every_parameter(tower):
    patches, grid = patchify(torch.rand(3, 56, 56), 14, 2)
    tower(patches, torch.tensor([grid])).square().mean().backward()
    for name, param in tower.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


@pytest.mark.parametrize("make_inputs, error, match", [
    (lambda: (torch.zeros(4, 10), torch.tensor([[2, 2]])), ValueError, r"pixel_values: expected shape \[N, C\*p\*p"),
    (lambda: (torch.zeros(4, 588, dtype=torch.int64), torch.tensor([[2, 2]])), TypeError, "pixel_values"),
    (lambda: (torch.zeros(4, 588), torch.tensor([[2.0, 2.0]])), TypeError, "image_grids"),
    (lambda: (torch.zeros(6, 588), torch.tensor([[2, 3]])), ValueError, "multiples of merge_size"),
    (lambda: (torch.zeros(8, 588), torch.tensor([[2, 2]])), ValueError, "has 8 patches but image_grids"),
    (lambda: (torch.full((4, 588), float("nan")), torch.tensor([[2, 2]])), ValueError, "NaN"),
])
def test_bad_tower_inputs_are_refused(tower, make_inputs, error, match):
    with pytest.raises(error, match=match):
        tower(*make_inputs())


def test_config_checks_vision_head_dim_and_token_ids():
    with pytest.raises(ValueError, match="vision.num_heads: 2D rotary"):
        ModelConfig.from_preset("tiny").replace(vision=dict(hidden_size=24, num_heads=4))
    with pytest.raises(ValueError, match="vision.image_token_id: must be a token id"):
        ModelConfig.from_preset("tiny").replace(vision=dict(image_token_id=512))
    with pytest.raises(ValueError, match="must differ"):
        ModelConfig.from_preset("tiny").replace(vision=dict(image_start_id=256))
