"""``python -m scaletool.bench STUDY [--out DIR] [--only NAME,...] [--list] [--dry-run] [--allow-dirty]``,
``python -m scaletool.bench readme RUNDIR... | --all [--check]``, ``python -m scaletool.bench pack RUNDIR... | --all``
and ``python -m scaletool.bench unpack RUNDIR --to DIR``."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from scaletool import records
from scaletool.bench import readme
from scaletool.bench.runner import gpu_count, plan, run_study
from scaletool.bench.study import StudyError, load_study, study_names
from scaletool.errors import RecipeError

EPILOG = """\
examples:
  python -m scaletool.bench --list
  python -m scaletool.bench decode --dry-run
  python -m scaletool.bench decode --out runs/bench/decode-h100
  python -m scaletool.bench regenerate-reports
  python -m scaletool.bench regenerate-reports --only quickstart-cpu
  python -m scaletool.bench tp-2gpu --deadline 540   # resumable
  python -m scaletool.bench readme benchmarks/results/decode/h100-2026-11-26
  python -m scaletool.bench readme --all --check
  python -m scaletool.bench pack benchmarks/results/decode/h100-2026-11-26
  python -m scaletool.bench unpack benchmarks/results/decode/h100-2026-11-26 --to /tmp/decode

A study is benchmarks/studies/STUDY.yaml (or a path to such a
file). Its commands run one after the other, each in its own process;
rerunning resumes: a command whose result exists is skipped. OUT/runs.jsonl
records each command with the card, date, torch and CUDA versions and the
commit: a tree that differs from its commit is refused, or with
--allow-dirty its difference is written beside the runs (tree-SHA.diff).
'readme' writes a run folder's README.md from its records; 'pack' moves a run
folder's record files into its records.jsonl.xz (the step before committing
it), 'unpack' writes them out again."""

PACK_EPILOG = f"""\
examples:
  python -m scaletool.bench pack runs/bench/decode
  python -m scaletool.bench pack benchmarks/results/decode/h100-2026-11-26
  python -m scaletool.bench pack --all

Moves each folder's loose record files ({', '.join(records.RECORD_SUFFIXES)}, subfolders
included; provenance.json stays loose) into one xz-compressed file,
{records.BUNDLE}: one JSON line per file, its path and its exact text.
The bundle is read back and compared before a loose file is removed; a
loose file that differs from its bundled copy is refused. A folder with a
README.md has it regenerated. Every reader of benchmarks/results reads the
bundle as if it were unpacked."""

UNPACK_EPILOG = f"""\
examples:
  python -m scaletool.bench unpack benchmarks/results/decode/h100-2026-11-26 --to /tmp/decode
  python -m scaletool.bench unpack path/to/{records.BUNDLE} --to out

Writes every file of the bundle under DIR, byte for byte, and nothing
elsewhere: a bundle holding an absolute path, '..' or a name that is not a
record is refused whole, no file is written through a symbolic link, and a
file already in DIR is kept when it is the same and refused when it differs."""


def printable(text: str) -> str:
    """``text`` for a terminal: control characters (escape sequences among them) shown escaped, not sent."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every scaletool command
        self.exit(2, f"error: {message}; try 'python -m scaletool.bench --help'\n")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and value < 1e7):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m scaletool.bench", description="Run a study of the benchmark suite.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", help="a study name (see --list) or a study YAML file")
    p.add_argument("--out", "-o", type=Path, help="output directory (default runs/bench/STUDY)")
    p.add_argument("--only", help="comma-separated command names or patterns (fnmatch) to run")
    p.add_argument("--list", action="store_true", help="list the studies, or the commands of STUDY")
    p.add_argument("--dry-run", action="store_true", help="print what would run and what is done; run nothing")
    p.add_argument("--deadline", type=_seconds, metavar="SECONDS",
                   help="start no command after SECONDS and stop one still running then; rerun to resume")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run from a tree that differs from its commit, writing the difference beside the runs")
    return p


def _run_folders(p: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[Path]] | None:
    """The run folders a subcommand names (RUNDIR... or --all), each an existing directory, not a link; None
    after one error line when one is not."""
    p.add_argument("dirs", nargs="*", type=Path, metavar="RUNDIR", help="a run folder (a study's --out)")
    p.add_argument("--all", action="store_true", help="every run folder under benchmarks/results")
    args = p.parse_args(argv)
    if bool(args.dirs) == args.all:
        p.error("name run folders, or --all")
    dirs = readme.run_dirs() if args.all else args.dirs
    for d in dirs:
        if d.is_symlink() or not d.is_dir():
            print(f"error: {printable(str(d))}: not a directory", file=sys.stderr)
            return None
    return args, dirs


def _readme(argv: list[str]) -> int:
    p = _Parser(prog="python -m scaletool.bench readme",
                description="Write each run folder's README.md from its records (runs.jsonl, provenance.json, results).")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each README that differs")
    got = _run_folders(p, argv)
    if got is None:
        return 2
    args, dirs = got
    stale = []
    for d in dirs:
        try:
            if args.check:
                current = d / readme.README
                if not current.is_file() or current.is_symlink() or current.read_text() != readme.generate(d):
                    stale.append(d)
                continue
            readme.write(d)
        except RecipeError as e:
            print(f"error: {printable(e.problems[0])}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"error: {printable(str(e.filename or d))}: {e.strerror or e}", file=sys.stderr)
            return 2
    for d in stale:
        print(f"{printable(str(d))}: README.md differs from its records; run python -m scaletool.bench readme {d}")
    return 1 if stale else 0


def _pack(argv: list[str]) -> int:
    p = _Parser(prog="python -m scaletool.bench pack", epilog=PACK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                description=f"Move each run folder's record files into its {records.BUNDLE}.")
    got = _run_folders(p, argv)
    if got is None:
        return 2
    _, dirs = got
    try:
        for d in dirs:
            done = records.pack(d)
            if (d / readme.README).is_file() and not (d / readme.README).is_symlink():
                readme.write(d)  # it lists the files and where they are
            if done.added:
                print(printable(f"{d}: {done.added} file(s), {done.loose_bytes:,} bytes, packed; {records.BUNDLE} "
                                f"holds {done.files} in {done.bundle_bytes:,} bytes"))
    except RecipeError as e:
        print(f"error: {printable(e.problems[0])}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {printable(str(e.filename or ''))}: {printable(str(e.strerror or e))}", file=sys.stderr)
        return 2
    return 0


def _unpack(argv: list[str]) -> int:
    p = _Parser(prog="python -m scaletool.bench unpack", epilog=UNPACK_EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description=f"Write the record files of a run folder's {records.BUNDLE} under DIR.")
    p.add_argument("src", type=Path, metavar="RUNDIR", help=f"a run folder holding {records.BUNDLE}, or the bundle itself")
    p.add_argument("--to", type=Path, metavar="DIR", required=True, help="where to write them (made if missing)")
    args = p.parse_args(argv)
    bundle = args.src if args.src.name == records.BUNDLE else args.src / records.BUNDLE
    if not bundle.exists() and not bundle.is_symlink():
        print(f"error: {printable(str(args.src))}: holds no {records.BUNDLE}", file=sys.stderr)
        return 2
    try:
        written = records.unpack(args.src, args.to)
    except RecipeError as e:
        print(f"error: {printable(e.problems[0])}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {printable(str(e.filename or args.to))}: {printable(str(e.strerror or e))}", file=sys.stderr)
        return 2
    print(printable(f"{args.to}: {len(written)} file(s) written"))
    return 0


def _list_studies() -> int:
    rows = []
    for name in study_names():
        try:
            s = load_study(name)
            desc = printable(s.description)
            desc = desc if len(desc) <= 90 else desc[:87] + "..."
            rows.append((name, str(s.gpus), str(len(s.commands)), desc))
        except StudyError as e:
            rows.append((name, "?", "?", f"invalid: {printable(e.problems[0])}"))
    w = max((len(r[0]) for r in rows), default=5)
    print(f"{'study':{w}}  GPUs  commands  description")
    for name, gpus, n, desc in rows:
        print(f"{name:{w}}  {gpus:>4}  {n:>8}  {desc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["readme"]:
        return _readme(argv[1:])
    if argv[:1] == ["pack"]:
        return _pack(argv[1:])
    if argv[:1] == ["unpack"]:
        return _unpack(argv[1:])
    args = _parser().parse_args(argv)
    if args.study is None:
        if args.list:
            return _list_studies()
        _parser().error("name a study, or --list to see them")
    try:
        study = load_study(args.study)
        out = args.out if args.out is not None else Path("runs") / "bench" / study.name
        if out.exists() and not out.is_dir():
            raise StudyError([f"--out {out}: exists and is not a directory"])
        if out.is_symlink():
            raise StudyError([f"--out {out}: is a symbolic link; name the directory itself"])
        only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
        planned = plan(study, out, only)
        if args.list or args.dry_run:
            print(f"study {study.name}: {printable(study.description)} (GPUs: {study.gpus}; output {printable(str(out))})")
            for p in planned:
                state = "done" if p.done else "todo"
                print(printable(f"  {state}  {p.command.name} -> {p.command.result}"))
                if args.dry_run:
                    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.command.env.items())
                    argv = [a.replace("{out}", str(out)) for a in p.command.argv]
                    where = f"(in {out}) " if p.command.cwd == "out" else ""
                    print("        " + printable(f"{where}{env + ' ' if env else ''}{shlex.join(argv)}"))
            return 0
        if study.gpus:
            present = gpu_count()
            if present < study.gpus:
                raise StudyError([f"study {study.name} needs {study.gpus} GPU(s), but this machine shows {present}"])
        out.mkdir(parents=True, exist_ok=True)
        return run_study(study, out, only, log=lambda line: print(printable(line), file=sys.stderr, flush=True),
                         deadline_s=args.deadline, allow_dirty=args.allow_dirty)
    except (StudyError, RecipeError) as e:  # RecipeError: a bundled input that cannot be read
        for problem in e.problems:
            print(f"error: {printable(problem)}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {printable(str(e.filename or args.out))}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
