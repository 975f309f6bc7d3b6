"""`tools/plant_check.py` plants bugs by replacing one exact piece of source text; when that
text changes, the plant silently stops applying. This keeps every plant pointing at code that exists
(running the plants themselves is the script's job: it edits the tree, so it is not in the suite)."""

from __future__ import annotations

import pytest

from tools.plant_check import PLANTS, REPO


@pytest.mark.parametrize("plant", PLANTS, ids=lambda p: p.name)
def test_every_plant_applies_to_the_current_source(plant) -> None:
    source = (REPO / plant.path).read_text()
    assert source.count(plant.old) == 1, f"{plant.name}: update the plant's text in tools/plant_check.py"
    assert plant.new != plant.old
    test_file = plant.tests[0].split("::")[0]
    assert (REPO / test_file).is_file(), test_file
