"""--result-file: the command's result reaches a file, atomically, with or without --json."""
from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import RECIPES

from scaletool.cli import main


def test_result_file_gets_the_json_document(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["--result-file", str(out), "estimate", str(RECIPES / "tiny.yaml")])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    as_json = CliRunner().invoke(main, ["estimate", str(RECIPES / "tiny.yaml"), "--json"])
    assert doc == json.loads(as_json.output)
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed into place


def test_result_file_in_a_missing_directory_is_one_error_line(tmp_path):
    res = CliRunner().invoke(main, ["--result-file", str(tmp_path / "no" / "r.json"), "estimate",
                                    str(RECIPES / "tiny.yaml")])
    assert res.exit_code == 2
    assert res.output.strip().startswith("error: --result-file") and "does not exist" in res.output
