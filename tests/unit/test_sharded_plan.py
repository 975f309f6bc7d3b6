"""The sharded plan's pure part: which copies of a mesh the trainer ranks hold (trainer/sharded.py
`mesh_copies`). A tensor whose mesh covers a subset of the ranks (FSDP2 on a data-parallel submesh) is held
alike by every copy of that mesh, and each copy sends a stripe of it: copies of unequal sizes, or copies
that leave a rank out or hold it twice, would send bytes twice or never."""

from __future__ import annotations

import pytest

from lightning_weightsync.errors import ConfigError
from lightning_weightsync.trainer.sharded import mesh_copies


def test_equal_copies_that_split_the_ranks_are_found_per_mesh_in_first_use_order() -> None:
    by_rank = [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]
    assert mesh_copies(by_rank, 4) == [[(0, 1), (2, 3)], [(0, 2), (1, 3)]]


def test_copies_of_unequal_sizes_are_a_config_error_naming_the_knob() -> None:
    by_rank = [[[0, 1, 2]], [[0, 1, 2]], [[0, 1, 2]], [[3]]]  # they cover the ranks, but 3 + 1
    with pytest.raises(ConfigError, match=r"equal parts.*trainer\.send_mode=gather"):
        mesh_copies(by_rank, 4)


def test_copies_that_leave_a_rank_out_or_overlap_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="do not split the 3 ranks"):
        mesh_copies([[[0, 1]], [[0, 1]], [[0, 1]]], 3)  # rank 2 holds rank 0 and 1's mesh, not its own
    with pytest.raises(ConfigError, match="do not split the 4 ranks"):
        mesh_copies([[[0, 1]], [[1, 2]], [[1, 2]], [[3, 0]]], 4)  # rank 1 twice, equal sizes


def test_ranks_with_different_numbers_of_meshes_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="different numbers of meshes"):
        mesh_copies([[[0, 1]], [[0, 1], [1]]], 2)
