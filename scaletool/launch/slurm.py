"""Slurm: an sbatch script that starts torchrun on every node through ``srun``, and the job-array
script a sweep is submitted as.

The script is rendered from ``slurm.sbatch.j2`` (or a site's own template with the same variables);
a sweep's array from ``sweep-array.sbatch.j2`` (:func:`render_array`).
Every value that reaches the shell body is quoted here with ``shlex.quote`` before rendering, so
the template itself never quotes; values on ``#SBATCH`` lines (sbatch parses them without a shell;
the working directory and the log path are among them) are checked against a plain character set
instead, which also keeps them safe in the body (a newline there would inject a directive).
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scaletool.config import RecipeError
from scaletool.launch.commands import LaunchSpec, torchrun_argv

TEMPLATE = Path(__file__).with_name("slurm.sbatch.j2")
# sbatch's own time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}")
# What an #SBATCH value may contain: no whitespace, quotes, '$', '#', ';' or newlines.
_DIRECTIVE = re.compile(r"[A-Za-z0-9_.,:@%+=/-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ARRAY = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*(%\d+)?")


class Shell(str):
    """An argument the batch shell must expand (``${head_node}:${rdzv_port}``).

    Only this module creates these, never from user input; :func:`shell_quote` puts them in
    double quotes so the variables expand while the result stays one word.
    """


def shell_quote(arg: str) -> str:
    """One argv element as one shell word: :class:`Shell` values in double quotes, the rest ``shlex.quote``-d."""
    return f'"{arg}"' if isinstance(arg, Shell) else shlex.quote(str(arg))


def shell_lines(argv: list[str]) -> list[str]:
    """``argv`` quoted, one option (with its value) per line, for a readable multi-line command."""
    lines: list[list[str]] = []
    for arg in argv:
        if not lines or arg.startswith("--") or arg == "-m":
            lines.append([])
        lines[-1].append(shell_quote(arg))
    return [" ".join(words) for words in lines]


@dataclass(frozen=True)
class SlurmOptions:
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None  # default scaletool-<recipe name>
    gpus_per_node: int | None = None  # default nproc_per_node; 0 leaves the line out (CPU nodes)
    cpus_per_task: int | None = None
    exports: tuple[str, ...] = ()  # NAME=VALUE
    rdzv_port: int = 29500
    workdir: str = "."
    output: str | None = None  # Slurm's log; default <out>/slurm-%j.out


def _exports(items: tuple[str, ...]) -> list[tuple[str, str]]:
    out, problems = [], []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            problems.append(f"--env {item!r}: expected NAME=VALUE with NAME a shell variable name")
        else:
            out.append((name, shell_quote(value)))
    if problems:
        raise RecipeError(problems)
    return out


def render_sbatch(spec: LaunchSpec, opts: SlurmOptions, template: str | Path | None = None) -> str:
    """The sbatch script for ``spec`` (one torchrun per node, c10d rendezvous on the first node)."""
    import jinja2

    job_name = opts.job_name or f"scaletool-{Path(spec.recipe).stem}"
    output = opts.output or str(Path(spec.out) / "slurm-%j.out")
    problems = _directive_problems(opts, job_name, output)
    if not 0 < opts.rdzv_port < 65536:
        problems.append(f"--rdzv-port {opts.rdzv_port}: must be in 1-65535")
    if problems:
        raise RecipeError(problems)
    exports = _exports(opts.exports)
    argv = torchrun_argv(spec, endpoint=Shell("${head_node}:${rdzv_port}"), rdzv_id=Shell("${SLURM_JOB_ID}"))
    path = Path(template) if template else TEMPLATE
    if not path.is_file():
        raise RecipeError(f"--template {path}: no such file")
    # Autoescape stays off: this is a shell script, quoted above with shlex.quote, not HTML.
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    try:
        tmpl = env.from_string(path.read_text())
        return tmpl.render(
            job_name=job_name, nnodes=spec.nnodes, time=opts.time, partition=opts.partition, account=opts.account,
            gpus_per_node=spec.nproc_per_node if opts.gpus_per_node is None else opts.gpus_per_node,
            cpus_per_task=opts.cpus_per_task, output=output, workdir=opts.workdir,
            exports=exports, rdzv_port=opts.rdzv_port, torchrun=shell_lines(argv))
    except jinja2.TemplateError as e:
        raise RecipeError(f"template {path}: {e}") from None


ARRAY_TEMPLATE = Path(__file__).with_name("sweep-array.sbatch.j2")


def render_array(command: list[str], *, array: str, opts: SlurmOptions) -> str:
    """An sbatch job-array script: one task per index of ``array`` (sbatch's ``--array`` value, e.g.
    ``0-2,5%4``), each running ``command`` on one node as one task.

    ``command`` is an argument list (shell-quoted here; :class:`Shell` elements expand, e.g.
    ``"$SLURM_ARRAY_TASK_ID"``); ``opts.output`` is the log path pattern (default ``slurm-%A_%a.out``),
    ``opts.gpus_per_node`` the GPUs of each task (0 or None: none).
    """
    import jinja2

    output = opts.output or "slurm-%A_%a.out"
    job_name = opts.job_name or "scaletool-sweep"
    problems = _directive_problems(opts, job_name, output)
    if not _ARRAY.fullmatch(array):
        problems.append(f"--array {array!r}: expected indices and ranges, e.g. 0-2,5,7%4")
    if problems:
        raise RecipeError(problems)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(ARRAY_TEMPLATE.read_text()).render(
        job_name=job_name, array=array, time=opts.time, partition=opts.partition,
        account=opts.account, gpus_per_node=opts.gpus_per_node, cpus_per_task=opts.cpus_per_task, output=output,
        workdir=opts.workdir, exports=_exports(opts.exports), command=shell_lines(command))


def _directive_problems(opts: SlurmOptions, job_name: str, output: str) -> list[str]:
    """Values bound for ``#SBATCH`` lines that sbatch would misread (or that would inject a directive)."""
    problems = []
    if not _TIME.fullmatch(opts.time):
        problems.append(f"--time {opts.time!r}: expected minutes, HH:MM:SS or D-HH:MM:SS (sbatch's formats)")
    for flag, value in (("--partition", opts.partition), ("--account", opts.account), ("--job-name", job_name),
                        ("--out (Slurm log path)", output), ("--workdir", opts.workdir)):
        if value is not None and not _DIRECTIVE.fullmatch(value):
            problems.append(f"{flag} {value!r}: goes on an #SBATCH line; use letters, digits and _.,:@%+=/- only")
        elif flag == "--workdir" and value.startswith("-"):  # `cd -P` would read an option
            problems.append(f"--workdir {value!r}: starts with '-'; write ./{value} for a relative directory")
    return problems


def sbatch_argv(script: str | Path) -> list[str]:
    """``sbatch --parsable SCRIPT``: prints the job id (and cluster) only."""
    return ["sbatch", "--parsable", str(script)]


def submit(script: str | Path) -> str:
    """Submit ``script`` with sbatch; return the job id. A missing sbatch or a refusal is a RecipeError."""
    argv = sbatch_argv(script)
    if shutil.which(argv[0]) is None:
        raise RecipeError(f"sbatch: not found on PATH; the script is written to {script}: "
                          "submit it from a Slurm login node with `sbatch` (or run launch there with --submit)")
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        raise RecipeError(f"sbatch refused {script}: {why}")
    return res.stdout.strip().split(";")[0]
