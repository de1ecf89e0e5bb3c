"""SDE window: fits the schedule, reproducible from the generator, validated."""

import pytest
import torch

from flowloop.sampling import sde_window


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_window_fits_range_and_covers_every_start():
    starts = set()
    for seed in range(200):
        w = sde_window(10, 3, (1, 7), _gen(seed))
        assert isinstance(w, range) and len(w) == 3 and w.step == 1
        assert 1 <= w.start and w.stop <= 7
        starts.add(w.start)
    assert starts == {1, 2, 3, 4}  # uniform over lo .. hi - size, both ends reachable


def test_same_seed_same_window_different_seeds_differ():
    assert sde_window(10, 2, (0, 10), _gen(123)) == sde_window(10, 2, (0, 10), _gen(123))
    windows = {sde_window(10, 2, (0, 10), _gen(seed)).start for seed in range(8)}
    assert len(windows) > 1


def test_range_exactly_the_window_size():
    assert sde_window(10, 4, (3, 7), _gen(0)) == range(3, 7)


@pytest.mark.parametrize("size", [None, 0])
def test_no_size_means_all_but_last(size):
    assert sde_window(10, size, None, None) == range(0, 9)
    assert sde_window(1, size, None, None) == range(0, 0)


@pytest.mark.parametrize(
    "size, window_range, match",
    [
        (11, (0, 10), "sde_window_size"),
        (-1, (0, 10), "sde_window_size"),
        (3, (0, 11), "sde_window_range"),
        (3, (-1, 5), "sde_window_range"),
        (3, (4, 6), "sde_window_range"),
        (3, None, "sde_window_range"),
        (3, (0, 1, 2), "sde_window_range"),
        (3, (0.5, 6), "sde_window_range"),
    ],
)
def test_bad_windows(size, window_range, match):
    with pytest.raises(ValueError, match=match) as info:
        sde_window(10, size, window_range, _gen(0))
    if match == "sde_window_range" and window_range is not None and len(window_range) == 2:
        assert "num_steps=10" in str(info.value)  # names the allowed bounds


def test_needs_generator():
    with pytest.raises(ValueError, match="Generator"):
        sde_window(10, 2, (0, 5), None)
