"""Every command's --help, `scaletool hardware` and `scaletool schema` read at 80 columns: no line longer, words whole."""
from __future__ import annotations

import json

import click
from click.testing import CliRunner

from scaletool.cli import main


def _commands(cmd: click.Command, path: list[str]):
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _commands(cmd.get_command(ctx, name), [*path, name])


def test_every_help_fits_80_columns_and_shows_examples():
    runner = CliRunner(env={"COLUMNS": "80"})
    seen = []
    for path, cmd in _commands(main, []):
        res = runner.invoke(main, [*path, "--help"])
        assert res.exit_code == 0, (path, res.output)
        long = [ln for ln in res.output.splitlines() if len(ln) > 80]
        assert not long, (path, long)
        if any(isinstance(p, click.Option) for p in cmd.params):
            assert "Examples" in res.output, path
        seen.append(" ".join(path))
    assert {"estimate", "sweep", "report", "plan", "calibrate", "recipe from-hf", "launch slurm"} <= set(seen)


def test_hardware_at_80_columns_wraps_at_word_boundaries():
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["hardware"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80
    head = next(ln for ln in lines if ln.startswith("H100 SXM (cuda)"))
    assert "bf16 989" in head and "HBM 3.35 TB/s" in head
    i = lines.index(head)
    # the profile is a few key: value lines, each word whole (the datasheet name is not cut)
    assert [ln.split(":")[0].strip() for ln in lines[i + 1:i + 4]] == ["matches", "source", "reference"]
    text = " ".join(ln.strip() for ln in lines[i + 3:i + 5])
    assert "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM" in text
    assert any(ln.startswith("A100 (cuda): bf16 312") for ln in lines)


def test_schema_lists_whole_plain_sentences_one_description_per_kind():
    runner = CliRunner(env={"COLUMNS": "80"})
    rows = json.loads(runner.invoke(main, ["schema", "--json"]).output)["kinds"]
    desc = {r["kind"]: r["description"] for r in rows}
    assert all(d.endswith((".", ")")) for d in desc.values()), desc  # whole sentences, not cut
    assert not any(m in d for d in desc.values() for m in ("``", ":class:", ":func:", "`")), desc
    sweep = [desc[k] for k in ("sweep", "sweep_plan", "sweep_record", "sweep_submission")]
    assert len(set(sweep)) == 4, sweep
    assert "DecodePoint per (context, batch)" in desc["decode"]
    assert "params.total is the exact count" in desc["count"]
    res = runner.invoke(main, ["schema"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80
    # wrapped at word boundaries: the text comes back whole when the continuation lines are joined
    i = next(i for i, ln in enumerate(lines) if ln.startswith("count v"))
    block = [lines[i], *[ln for ln in lines[i + 1:i + 8] if ln.startswith("      ")]]
    assert " ".join(ln.split("  ", 1)[1].strip() if j == 0 else ln.strip() for j, ln in enumerate(block)) \
        .startswith(desc["count"][:150])
