"""A run folder's record files in one xz bundle (scaletool.records, ``python -m scaletool.bench pack|unpack``):
packing and unpacking give back every byte, every reader sees a bundled file as if it were loose, and a hostile
bundle (a path out of the folder, a link on the way, a decompression bomb, a broken stream) is one ``error:`` line
with nothing written."""
from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import ROOT

from scaletool import records
from scaletool.bench import readme
from scaletool.errors import RecipeError

#: a committed run folder with training results the validation re-predicts, subfolders and a hand-written table
COMMITTED_RUN = ROOT / "benchmarks" / "results" / "moe-speed" / "h100-2026-11-27-5"

FILES = {
    "runs.jsonl": '{"command": "a", "status": "ok", "wall_s": 2.0, "result": "a.json", "environment": '
                  '{"commit": "abc123", "cards": ["X"], "tree_differs_from_commit": false}}\n',
    "a.json": json.dumps({"title": "µ-bench ✓", "x": [1, 2.5, None]}, ensure_ascii=False, indent=1),
    "crlf.csv": "a,b\r\n1,2\r\n",
    "bom.txt": "\ufeffline one\n\tline two without an end",
    "sub/deeper/b.jsonl": '{"k": "\\u2028 and \u2028"}\n\n{"k": 2}\n',
    "sub/c.json": "{}",
    "empty.txt": "",
    "report.md": "# scaletool report\n\nGenerated from the results beside it.\n",  # generated: bundled
}
KEPT = {"provenance.json": '{"commit": "abc123", "note": "hand-written"}\n', "README.md": "old\n",
        "sub/table.md": "| a |\n", "calibration.yaml": "name: x\n"}


def bench(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scaletool.bench", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def _folder(tmp_path: Path) -> Path:
    run = tmp_path / "results" / "study" / "cpu-2026-01-01"
    for rel, text in {**FILES, **KEPT}.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(text.encode("utf-8"))
    return run


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _one_error(r: subprocess.CompletedProcess, says: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_pack_then_unpack_gives_back_every_byte_and_keeps_what_a_person_reads_loose(tmp_path):
    run = _folder(tmp_path)
    before = _tree(run)
    r = bench("pack", str(run))
    assert r.returncode == 0, r.stderr
    assert f"{len(FILES)} file(s)" in r.stdout
    after = _tree(run)
    assert set(after) == {records.BUNDLE, *KEPT}  # the emptied sub/deeper/ is gone, sub/ keeps its table
    assert not (run / "sub" / "deeper").exists()
    assert {k: after[k] for k in KEPT if k != "README.md"} == {k: before[k] for k in KEPT if k != "README.md"}
    lines = lzma.decompress(after[records.BUNDLE]).decode().splitlines()
    assert [json.loads(line)["path"] for line in lines] == sorted(FILES)
    assert all(set(json.loads(line)) == {"path", "text"} for line in lines)
    out = tmp_path / "out"
    r = bench("unpack", str(run), "--to", str(out))
    assert r.returncode == 0, r.stderr
    assert _tree(out) == {rel: text.encode("utf-8") for rel, text in FILES.items()}  # byte for byte
    assert {rel: before[rel] for rel in FILES} == _tree(out)
    # deterministic: the unpacked copy packs to the same bytes
    again = tmp_path / "again" / "cpu-2026-01-01"
    shutil.copytree(out, again)
    assert bench("pack", str(again)).returncode == 0
    assert (again / records.BUNDLE).read_bytes() == after[records.BUNDLE]
    # unpacking onto the same files again writes nothing and is no error
    r = bench("unpack", str(run / records.BUNDLE), "--to", str(out))
    assert r.returncode == 0 and "0 file(s) written" in r.stdout, r.stderr


def test_every_reader_sees_bundled_files_as_loose_ones(tmp_path):
    run = _folder(tmp_path)
    loose = list(records.iter_record_files(run))
    assert [rel for rel, _ in loose] == sorted([*FILES, "provenance.json"])
    readme_loose = readme.generate(run)
    assert bench("pack", str(run)).returncode == 0
    assert list(records.iter_record_files(run)) == loose
    assert records.read_record(run / "sub" / "deeper" / "b.jsonl") == FILES["sub/deeper/b.jsonl"]
    assert records.exists(run / "sub" / "c.json") and not records.exists(run / "sub" / "missing.json")
    assert [r.path for r in records.walk_records(tmp_path)] == [run / rel for rel, _ in loose]
    with pytest.raises(RecipeError, match="no such file"):
        records.read_record(run / "missing.json")
    # the README lists the same files with the same summaries; a bundled one unlinked (the line above says where)
    text = (run / "README.md").read_text()
    assert text == readme.generate(run) and bench("readme", str(run), "--check").returncode == 0
    assert "| a | ok | 2.0 |" in text and "`abc123` (runner's; clean tree)" in text
    assert "| a.json | JSON, keys: title, x |" in text and "An unlinked file is in [records.jsonl.xz]" in text
    assert "| [sub/table.md](sub/table.md) | 1 lines: | a | |" not in text  # a cell's '|' is escaped
    assert "| [sub/table.md](sub/table.md) | 1 lines: \\| a \\| |" in text
    # the first readme.LISTED bundled files are described, the rest counted (7 bundled here)
    bundled = [row for row in readme_loose.splitlines()
               if row.startswith("| [") and "table.md" not in row and "calibration" not in row]
    assert len(bundled) == 7 and readme.LISTED < 7
    for row in bundled[:readme.LISTED]:
        rel = row[3:row.index("]")]
        assert row.replace(f"[{rel}]({rel})", rel) in text
    for row in bundled[readme.LISTED:]:
        rel = row[3:row.index("]")]
        assert rel not in text
    assert text.endswith(f"| … | {7 - readme.LISTED} more in records.jsonl.xz |\n")


def test_a_bundled_result_is_done_for_the_runner_and_an_input_for_a_study(tmp_path):
    from scaletool.bench.runner import _done
    from scaletool.bench.study import _repo_file

    run = _folder(tmp_path)
    assert bench("pack", str(run)).returncode == 0
    assert _done(run / "sub" / "c.json") and not _done(run / "sub" / "other.json")
    committed = COMMITTED_RUN / "new-mb12" / "train.json"  # loose or bundled, a file of the repository
    assert _repo_file(str(committed.relative_to(ROOT))) and not _repo_file("benchmarks/results/none/x.json")


def test_validate_reads_a_bundle_like_the_files_it_holds(tmp_path):
    from scaletool.predict.validation import validate

    out = tmp_path / "unpacked"
    if (COMMITTED_RUN / records.BUNDLE).exists():
        assert len(records.unpack(COMMITTED_RUN, out)) == 8
    else:
        shutil.copytree(COMMITTED_RUN, out)
    files = sorted(p for p in out.rglob("*.json") if p.name != "provenance.json")
    loose = validate(files)
    run = tmp_path / "packed"
    shutil.copytree(out, run)
    assert bench("pack", str(run)).returncode == 0
    bundled = validate([run / records.BUNDLE])
    assert len(loose["runs"]) == 3 and loose["skipped"] == []
    figures = ("measured_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu", "engine", "card")
    assert [{k: r[k] for k in figures} for r in bundled["runs"]] == [{k: r[k] for k in figures} for r in loose["runs"]]
    assert [Path(r["run"]).relative_to(run) for r in bundled["runs"]] == \
        [Path(r["run"]).relative_to(out) for r in loose["runs"]]


def test_pack_refuses_a_loose_file_that_differs_from_its_bundled_copy_and_changes_nothing(tmp_path):
    run = _folder(tmp_path)
    assert bench("pack", str(run)).returncode == 0
    (run / "a.json").write_text("{}")
    before = _tree(run)
    _one_error(bench("pack", str(run)), "differs from its copy")
    assert _tree(run) == before
    with pytest.raises(RecipeError, match="differs from its copy"):
        records.records(run)
    (run / "a.json").write_text(FILES["a.json"])  # the same text: packed away, the bundle unchanged
    assert bench("pack", str(run)).returncode == 0 and not (run / "a.json").exists()
    assert (run / records.BUNDLE).read_bytes() == before[records.BUNDLE]


def test_pack_refuses_a_record_that_is_not_utf8_or_is_a_link_and_changes_nothing(tmp_path):
    run = _folder(tmp_path)
    (run / "bad.txt").write_bytes(b"\xff\xfe")
    before = _tree(run)
    _one_error(bench("pack", str(run)), "not a UTF-8 text file")
    assert _tree(run) == before
    (run / "bad.txt").unlink()
    (tmp_path / "victim.json").write_text("{}")
    (run / "link.json").symlink_to(tmp_path / "victim.json")
    _one_error(bench("pack", str(run)), "symbolic link")
    assert not (run / records.BUNDLE).exists() and (tmp_path / "victim.json").read_text() == "{}"


def test_pack_and_unpack_refuse_bad_arguments_in_one_line(tmp_path):
    _one_error(bench("pack"), "name run folders, or --all")
    _one_error(bench("pack", str(tmp_path / "missing")), "not a directory")
    _one_error(bench("unpack", str(tmp_path)), "--to")
    _one_error(bench("unpack", str(tmp_path), "--to", str(tmp_path / "o")), f"holds no {records.BUNDLE}")
    assert not (tmp_path / "o").exists()
    assert "python -m scaletool.bench unpack" in bench("unpack", "--help").stdout
    assert "python -m scaletool.bench pack --all" in bench("pack", "--help").stdout


def _bundle(tmp_path: Path, lines: list, *, raw: bytes | None = None) -> Path:
    src = tmp_path / "hostile" / "cpu-2026-01-01"
    src.mkdir(parents=True)
    data = raw if raw is not None else "".join(json.dumps(x) + "\n" for x in lines).encode()
    (src / records.BUNDLE).write_bytes(lzma.compress(data, format=lzma.FORMAT_XZ, preset=1))
    return src


@pytest.mark.parametrize("path,says", [
    ("../escape.json", "'..' part"), ("/tmp/abs.json", "is absolute"), ("a/../../b.json", "'..' part"),
    ("README.md", "not a record file"), ("run.sh", "not a record file"), (".hidden/x.json", "hidden part"),
    ("a\\..\\b.json", "backslash"), ("a\x1b[2Jb.json", "control character"), ("", "non-empty string"),
    (7, "non-empty string")])
def test_unpack_refuses_a_bundle_with_a_path_out_of_its_folder_and_writes_nothing(tmp_path, path, says):
    src = _bundle(tmp_path, [{"path": "a.json", "text": "{}"}, {"path": path, "text": "pwned"}])
    r = bench("unpack", str(src), "--to", str(tmp_path / "out"))
    _one_error(r, says)
    assert "\x1b" not in r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape.json").exists()
    assert not Path("/tmp/abs.json").exists() or Path("/tmp/abs.json").read_text() != "pwned"


@pytest.mark.parametrize("lines,raw,says", [
    ([{"path": "b.json", "text": "1"}, {"path": "a.json", "text": "2"}], None, "out of order or given twice"),
    ([{"path": "a.json", "text": "1"}, {"path": "a.json", "text": "2"}], None, "out of order or given twice"),
    ([{"path": "a.json", "text": 5}], None, "with text a string"),
    ([{"path": "a.json", "text": "1", "mode": "0777"}], None, "with text a string"),
    ([["a.json", "1"]], None, "with text a string"),
    (None, b"not json\n", "line 1 is not JSON"),
    (None, b'{"path": "a.json", "text": "1"}', "last line is not ended"),
    (None, b"\xff\n", "not UTF-8"),
], ids=["unsorted", "twice", "text-not-string", "extra-key", "not-object", "not-json", "unended", "not-utf8"])
def test_a_malformed_bundle_is_one_error_line_for_every_reader(tmp_path, lines, raw, says):
    src = _bundle(tmp_path, lines or [], raw=raw)
    _one_error(bench("unpack", str(src), "--to", str(tmp_path / "out")), says)
    _one_error(bench("readme", str(src)), says)
    assert not (tmp_path / "out").exists() and not (src / "README.md").exists()
    with pytest.raises(RecipeError, match=says):
        records.read_bundle(src / records.BUNDLE)


def test_a_bundle_that_is_not_xz_cut_or_followed_by_bytes_is_one_error_line(tmp_path):
    src = _bundle(tmp_path, [{"path": "a.json", "text": "{}"}])
    good = (src / records.BUNDLE).read_bytes()
    for blob, says in ((b"PK\x03\x04 a zip", "not an xz bundle"), (good[:-9], "cut short"),
                       (good + b"trailing", "follow the xz stream")):
        (src / records.BUNDLE).write_bytes(blob)
        _one_error(bench("unpack", str(src), "--to", str(tmp_path / "out")), says)
        assert not (tmp_path / "out").exists()


def test_a_decompression_bomb_stops_at_the_cap_without_writing(tmp_path):
    src = tmp_path / "hostile" / "cpu-2026-01-01"
    src.mkdir(parents=True)
    xz = lzma.LZMACompressor(format=lzma.FORMAT_XZ, preset=1)
    chunk = b"a" * (1 << 20)
    blob = [xz.compress(b'{"path": "a.json", "text": "')]
    blob += [xz.compress(chunk) for _ in range((records.MAX_UNPACKED_BYTES >> 20) + 1)]
    blob += [xz.compress(b'"}\n'), xz.flush()]
    (src / records.BUNDLE).write_bytes(b"".join(blob))
    assert (src / records.BUNDLE).stat().st_size < 100_000  # a few KiB that would decode past the cap
    _one_error(bench("unpack", str(src), "--to", str(tmp_path / "out")), "decodes to more than 256 MiB")
    assert not (tmp_path / "out").exists()


def test_a_bundle_asking_the_decoder_for_gigabytes_is_refused_before_it_allocates(tmp_path):
    """An xz block header may name a 4 GiB dictionary for a few bytes of data; the decoder's memory limit refuses it."""
    src = _bundle(tmp_path, [{"path": "a.json", "text": "{}"}])
    blob = bytearray((src / records.BUNDLE).read_bytes())
    assert blob[12:17] == bytes([2, 0, 0x21, 1, blob[16]])  # block header: 12 bytes, one LZMA2 filter, its dict byte
    blob[16] = 40  # LZMA2's largest dictionary, 4 GiB - 1
    blob[20:24] = zlib.crc32(bytes(blob[12:20])).to_bytes(4, "little")  # the header's own CRC, so only the size is wrong
    (src / records.BUNDLE).write_bytes(bytes(blob))
    _one_error(bench("unpack", str(src), "--to", str(tmp_path / "out")), "not an xz bundle of records (Memory usage limit")
    assert not (tmp_path / "out").exists()


def test_unpack_writes_no_file_through_a_link_and_keeps_what_differs(tmp_path):
    src = _bundle(tmp_path, [{"path": "a.json", "text": "{}"}, {"path": "sub/x.json", "text": "pwned"}])
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "sub").symlink_to(victim)
    _one_error(bench("unpack", str(src), "--to", str(out)), "symbolic link")
    assert list(victim.iterdir()) == [] and not (out / "a.json").exists()  # checked whole before any write
    (out / "sub").unlink()
    (out / "sub").mkdir()
    (out / "sub" / "x.json").symlink_to(victim / "x.json")
    _one_error(bench("unpack", str(src), "--to", str(out)), "symbolic link")
    assert list(victim.iterdir()) == []
    (out / "sub" / "x.json").unlink()
    (out / "sub" / "x.json").write_text("mine")
    _one_error(bench("unpack", str(src), "--to", str(out)), "exists and differs")
    assert (out / "sub" / "x.json").read_text() == "mine" and not (out / "a.json").exists()
    link_to = tmp_path / "link-to"
    link_to.symlink_to(victim)
    _one_error(bench("unpack", str(src), "--to", str(link_to)), "symbolic link")
    (src / records.BUNDLE).rename(tmp_path / "real.xz")
    (src / records.BUNDLE).symlink_to(tmp_path / "real.xz")
    _one_error(bench("unpack", str(src), "--to", str(tmp_path / "o2")), "not a regular file")
    assert list(victim.iterdir()) == []


def test_a_fifo_for_a_bundle_is_refused_not_waited_on(tmp_path):
    src = tmp_path / "cpu-2026-01-01"
    src.mkdir()
    os.mkfifo(src / records.BUNDLE)
    _one_error(bench("unpack", str(src), "--to", str(tmp_path / "out")), "not a regular file")
    _one_error(bench("readme", str(src)), "not a regular file")
