"""Inputs that would make a command wait or work forever: a sweep grid of a million points is refused from the
lengths of its lists before anything is enumerated (the count and the limit named), and a plan for more GPUs
than any cluster from the count; a --result-file FIFO nobody reads is in test_hostile_links.py, FIFO
calibrations, profiles and result files in their own modules."""
from __future__ import annotations

import pytest
import yaml
from hostile import RECIPES, invoke

from scaletool.sweep.spec import MAX_POINTS


@pytest.mark.parametrize("grid, zipped, count, shape", [
    ({f"model.{k}": list(range(1, 33)) for k in ("n_layers", "d_model", "n_heads", "vocab_size")}, None,
     32 ** 4, "32 x 32 x 32 x 32"),
    ({"model.n_layers": list(range(1, 101))}, {"train.seed": list(range(101))}, 10_100, "100 x zip 101"),
    ({f"parallel.deepspeed.k{i}": [1, 2] for i in range(64)}, None, "about 10^19", "the product of 64 lists"),
    ({f"parallel.deepspeed.k{i}": list(range(10)) for i in range(5000)}, None, "about 10^5000", "the product of 5000 lists"),
])
def test_a_grid_past_the_limit_is_one_line_naming_the_count(tmp_path, grid, zipped, count, shape):
    spec = {"recipe": str(RECIPES / "tiny.yaml"), "modes": ["estimate"], "grid": grid}
    if zipped:
        spec["zip"] = zipped
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(spec))
    lines, _ = invoke(["sweep", str(path), "-o", str(tmp_path / "out"), "--dry-run"])
    count = f"{count:,}" if isinstance(count, int) else count
    expected = f"error: {path}: {count} points ({shape}); a sweep plans at most {MAX_POINTS:,}: split it"
    assert [ln for ln in lines if "points (" in ln] and any(ln.startswith(expected) for ln in lines), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gpus, per_node", [("100000000000", "100000000000"), ("1" + "0" * 400, None),
                                            ("1048577", "1"), ("8", "100000000000")])
def test_plan_for_more_gpus_than_any_cluster_is_one_line_at_once(gpus, per_node):
    """10^11 GPUs once kept `plan` searching for minutes; the count is bounded before any search."""
    args = ["plan", "tiny", "--gpus", gpus] + (["--gpus-per-node", per_node] if per_node else [])
    lines, _ = invoke(args)
    assert len(lines) == 1 and "scaletool plans for at most 1,048,576 GPUs" in lines[0] and len(lines[0]) < 200, lines
