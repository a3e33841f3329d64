"""The commands a launch runs, built as argument lists.

Every command here is a ``list[str]`` handed to ``subprocess`` (or to torchrun's own argument parser),
so a recipe path or an override with spaces or quotes arrives as given. The one launcher that hands
a command to a shell, DeepSpeed's pdsh runner (several nodes without ``--node-rank``), gets the
train arguments as one shell-inert word (:mod:`scaletool.launch.remote`), hosts and endpoints that
are host names or IP addresses, and nothing else it would paste unquoted (:func:`pdsh_problems`).
Workers run ``python -m scaletool train`` (torchrun's ``-m``; the bare ``scaletool`` script may not
be installed on a GPU node), always with ``--auto-resume``: a group that torchrun restarts
after a failure continues from the newest complete checkpoint in ``--out`` instead of step 0.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scaletool.config import RecipeError
from scaletool.errors import echo, shorten
from scaletool.threads import child_env, threads_per_process

TORCHRUN = "torch.distributed.run"
DEEPSPEED_RUNNER = "deepspeed.launcher.runner"
DEFAULT_PORT = 29500
MAX_HOSTFILE_BYTES = 1 << 20  # a hostfile lists nodes; anything larger is the wrong file
# Rendezvous ids name torchrun's log directories: keep them plain.
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# One label of a host name ('_' too: some clusters use it); never a leading '-' (ssh would read an option).
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # an IPv6 zone (fe80::1%eth0)
HOST_RULE = "a host name (letters, digits, '-', '_', dot-separated) or an IP address"
# What DeepSpeed's pdsh runner pastes into the remote command unquoted (its own "plain" set).
_SHELL_PLAIN = re.compile(r"[\w@%+=:,./-]+")
# Environment variables it exports to every host (by name prefix; its accelerators' lists included),
# in double quotes when not plain: there '$', '`', '\\' and '"' still act.
_PDSH_EXPORTS = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "NEUWARE_HOME", "CNCL", "LD_LIBRARY", "PATH", "ASCEND",
                 "HCCL", "BCCL", "BIREN", "SUPA")
# '$', '`', '\\' and '"' act inside double quotes; control characters (NUL included) are no part of a value
_IN_DOUBLE_QUOTES = re.compile(r'[$`\\"\x00-\x08\x0a-\x1f\x7f-\x9f]')
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name `export` takes as it is
MAX_ENV_FILE_BYTES = 1 << 20  # a .deepspeed_env holds a few NAME=VALUE lines


def is_host(text: str) -> bool:
    """A host name or an IPv4/IPv6 address (an IPv6 zone of plain characters), as pdsh, ssh and
    MASTER_ADDR take it; nothing a shell or ssh would read as anything else."""
    if not isinstance(text, str) or not 0 < len(text) <= 253:
        return False
    addr, scoped, zone = text.partition("%")
    try:
        ipaddress.ip_address(addr)
        return not scoped or (":" in addr and bool(_SCOPE.fullmatch(zone)))
    except ValueError:
        pass
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    return all(_LABEL.fullmatch(label) for label in labels)


@dataclass(frozen=True)
class LaunchSpec:
    """One launch of ``scaletool train``: the recipe, where it writes, and the shape of the job."""

    recipe: str
    out: str
    nnodes: int = 1
    nproc_per_node: int = 1
    overrides: tuple[str, ...] = ()
    node_rank: int | None = None  # c10d: node 0 hosts the rendezvous store; deepspeed: --node_rank
    rdzv_endpoint: str | None = None  # HOST:PORT where the nodes meet
    rdzv_id: str | None = None
    rdzv_timeout_s: int = 900  # how long a node waits for the others to join
    join_timeout_s: int | None = None  # the ranks' own wait for each other (train --join-timeout)
    max_restarts: int = 0
    peak_tflops: float | None = None
    resume: bool | str = "auto"  # "auto": resume if --out holds a checkpoint (what a restarted group needs)
    measure: bool = True
    python: str = field(default_factory=lambda: sys.executable)

    @property
    def run_id(self) -> str:
        """The rendezvous id: given, or derived from the run directory (the same on every node)."""
        return self.rdzv_id or "scaletool-" + re.sub(r"[^A-Za-z0-9_.-]", "-", Path(self.out).name or "run")

    def endpoint(self) -> tuple[str, int]:
        """(host, port) of ``rdzv_endpoint``; 127.0.0.1:29500 when none was given."""
        return split_endpoint(self.rdzv_endpoint or f"127.0.0.1:{DEFAULT_PORT}")


def split_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) -> (host, port); a bad one is a RecipeError."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isascii() or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        raise RecipeError(f"--rdzv-endpoint {echo(text)}: expected HOST:PORT with a port in 1-65535, e.g. node001:29500")
    if not is_host(host):
        raise RecipeError(f"--rdzv-endpoint {echo(text)}: {echo(host)} is not {HOST_RULE}")
    return host, int(port)


def check_spec(spec: LaunchSpec, launcher: str) -> None:
    """Problems of a launch that show before anything starts; one RecipeError line each."""
    problems = []
    if spec.nnodes > 1 and launcher in ("torchrun", "deepspeed") and not spec.rdzv_endpoint:
        problems.append(f"--rdzv-endpoint: required with --nnodes {spec.nnodes}: the HOST:PORT of the first node, "
                        "where every node's launcher meets (the same on all nodes)")
    if spec.rdzv_endpoint:
        try:
            split_endpoint(spec.rdzv_endpoint)
        except RecipeError as e:
            problems += e.problems
    if spec.node_rank is not None and not 0 <= spec.node_rank < spec.nnodes:
        problems.append(f"--node-rank {spec.node_rank}: must be in 0..{spec.nnodes - 1} for --nnodes {spec.nnodes}")
    if spec.rdzv_id is not None and not _PLAIN.fullmatch(spec.rdzv_id):
        problems.append(f"--rdzv-id {spec.rdzv_id!r}: letters, digits, '_', '.' and '-' only")
    if spec.max_restarts and launcher == "deepspeed":
        problems.append("--max-restarts: the DeepSpeed launcher does not restart failed workers; use "
                        "`scaletool launch torchrun` (parallel.engine=deepspeed runs under torchrun too)")
    if problems:
        raise RecipeError(problems)


def train_module_args(spec: LaunchSpec) -> list[str]:
    """What follows ``python -m`` on every worker: ``scaletool train RECIPE --out DIR --auto-resume ...``."""
    args = ["scaletool", "train", spec.recipe, "--out", spec.out]
    if spec.resume:
        args.append("--auto-resume" if spec.resume == "auto" else "--resume")
    for o in spec.overrides:
        args += ["--set", o]
    if spec.peak_tflops is not None:
        args += ["--peak-tflops", repr(spec.peak_tflops)]
    if not spec.measure:
        args.append("--no-measure")
    if spec.join_timeout_s is not None:
        args += ["--join-timeout", str(spec.join_timeout_s)]
    return args


def torchrun_argv(spec: LaunchSpec, *, endpoint: str | None = None, rdzv_id: str | None = None) -> list[str]:
    """``python -m torch.distributed.run ...`` for this node.

    One node without an endpoint: ``--standalone`` (a local rendezvous on a free port). Otherwise the
    c10d rendezvous at ``endpoint`` (default ``spec.rdzv_endpoint``): nodes that have not all joined
    within ``rdzv_timeout_s`` end with an error instead of waiting forever (``join_timeout``), and
    ``--node-rank 0`` makes this node host the rendezvous store (``is_host``) instead of guessing from
    its hostname. ``--log-dir`` keeps torchrun's per-attempt error files with the run.
    """
    endpoint = endpoint if endpoint is not None else spec.rdzv_endpoint
    argv = [spec.python, "-m", TORCHRUN, "--nnodes", str(spec.nnodes), "--nproc-per-node", str(spec.nproc_per_node)]
    if spec.nnodes == 1 and endpoint is None:
        argv.append("--standalone")
    else:
        # read_timeout bounds the store's own waits too (connecting to node 0's store included: 60 s a try by
        # default, retried, 166 s in all for a node 0 that never started) by the same --rdzv-timeout
        conf = f"join_timeout={spec.rdzv_timeout_s},read_timeout={spec.rdzv_timeout_s}"
        if spec.node_rank is not None:
            conf += f",is_host={int(spec.node_rank == 0)}"
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id or spec.run_id,
                 "--rdzv-conf", conf]
    argv += ["--max-restarts", str(spec.max_restarts), "--log-dir", str(Path(spec.out) / "torchelastic"),
             "-m", *train_module_args(spec)]
    return argv


def deepspeed_argv(spec: LaunchSpec, hostfile: str) -> list[str]:
    """``python -m deepspeed.launcher.runner ...``: the DeepSpeed launcher with a hostfile.

    With ``node_rank`` (or one node) it runs this node's ranks only (``--no_ssh``; start it on every
    node); without, it reaches the other hosts of the hostfile itself over pdsh/ssh. The first
    ``nnodes`` hosts take ``nproc_per_node`` ranks each; rank 0's host is the endpoint's. This launcher
    has no rendezvous: the ranks bound their own wait for each other (``spec.join_timeout_s``).
    """
    host, port = spec.endpoint()
    argv = [spec.python, "-m", DEEPSPEED_RUNNER, "--hostfile", hostfile, "--num_nodes", str(spec.nnodes),
            "--num_gpus", str(spec.nproc_per_node), "--master_addr", host, "--master_port", str(port)]
    if not uses_pdsh(spec):
        argv += ["--no_ssh", "--node_rank", str(spec.node_rank or 0)]
    # scaletool train reads LOCAL_RANK from the environment; no --local_rank argument.
    argv += ["--no_local_rank", "--module"]
    if uses_pdsh(spec):  # a remote shell reads the command: the arguments go as one inert word
        from scaletool.launch.remote import MODULE, encode

        return argv + [MODULE, encode(train_module_args(spec)[1:])]
    return argv + train_module_args(spec)


def uses_pdsh(spec: LaunchSpec) -> bool:
    """Whether the DeepSpeed launcher reaches the other hosts itself (pdsh over ssh, a remote shell)."""
    return spec.node_rank is None and spec.nnodes > 1


def pdsh_problems(spec: LaunchSpec, cwd: str | None = None, environ: dict[str, str] | None = None) -> list[str]:
    """What DeepSpeed's pdsh runner would paste into the remote shell command unquoted (the working
    directory, the Python, the names of exported variables) or in double quotes (their values, and the
    ``.deepspeed_env`` lines), where a shell would run part of it: one line each, to refuse before anything
    starts. The runner builds ``export NAME=VALUE;`` from every variable whose name starts with one of
    :data:`_PDSH_EXPORTS` and from every line of ``~/.deepspeed_env`` and ``./.deepspeed_env``
    (``$DS_ENV_FILE`` names the file): names must be identifiers, values free of what double quotes
    leave to the shell and of control characters; :func:`env_file_problems` reads each file whole."""
    import shutil

    cwd = os.getcwd() if cwd is None else cwd
    environ = dict(os.environ) if environ is None else environ
    problems = []
    plain = "letters, digits and _@%+=:,./- only"
    if not _SHELL_PLAIN.fullmatch(cwd):
        problems.append(f"the current directory {echo(cwd)}: DeepSpeed's pdsh runner puts it unquoted into the "
                        f"command every host's shell runs; start launch from a directory whose path has {plain}")
    for python in {spec.python, shutil.which(spec.python) or spec.python}:
        if not _SHELL_PLAIN.fullmatch(os.path.abspath(python) if os.sep in python else python):
            problems.append(f"--python {echo(python)}: DeepSpeed's pdsh runner puts it unquoted into the command "
                            f"every host's shell runs; name a Python whose path has {plain}")
    for name, value in sorted(environ.items()):
        if not name.startswith(_PDSH_EXPORTS):
            continue
        where = f"environment variable {name if _IDENT.fullmatch(name) else echo(name)}"
        problem = export_problem(name, value)
        if problem:
            problems.append(f"{where}: DeepSpeed's pdsh runner exports it to every host {problem}; unset it")
    for path in env_file_paths(cwd, environ):
        problems += env_file_problems(path)
    return problems


def export_problem(name: str, value: str) -> str | None:
    """Why ``export NAME=VALUE;`` as DeepSpeed's runner writes it (the name stripped and unquoted, the value
    stripped and in double quotes unless plain) would make a shell do more than set a variable, or None."""
    if not _IDENT.fullmatch(name.strip()):
        return "with its name unquoted, and the name is not an identifier (letters, digits and '_')"
    if _IN_DOUBLE_QUOTES.search(value.strip()):
        return ("in double quotes, where '$', '`', '\\' and '\"' are read by the shell (and control characters "
                "are not text)")
    return None


def env_file_paths(cwd: str, environ: dict[str, str]) -> list[str]:
    """The ``.deepspeed_env`` files DeepSpeed's runner reads, as it finds them: ``$DS_ENV_FILE`` (default
    ``.deepspeed_env``) joined to the home directory and to the working directory, where that is a file
    (a link to one included: the runner follows links)."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    home = environ.get("HOME") or os.path.expanduser("~")
    found: list[str] = []
    for folder in (home, cwd):
        path = os.path.join(folder, name)
        if path not in found and os.path.isfile(path):
            found.append(path)
    return found


def env_file_problems(path: str, limit: int = MAX_ENV_FILE_BYTES, shown_lines: int = 5) -> list[str]:
    """Each line of a ``.deepspeed_env`` file that DeepSpeed's runner would crash on (no ``=``: it splits every
    line at the first one) or paste into every host's shell as more than an assignment; the whole file is
    read (never a prefix). A file that is not UTF-8 text, larger than ``limit`` bytes or unreadable is one
    line. At most ``shown_lines`` lines are named, then one line counts the rest."""
    import stat

    where = shorten(path)
    why = "DeepSpeed's launcher exports it to every host"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never wait on a FIFO swapped in after the check
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return [f"{where}: not a regular file; {why}"]
            blob = f.read(limit + 1)
    except OSError as e:
        return [f"{where}: cannot read ({e.strerror or e}); {why}"]
    if len(blob) > limit:
        return [f"{where}: larger than {limit // 2**20} MiB; {why} line by line, and such a file holds a few "
                "NAME=VALUE lines (remove it, or move it aside for this launch)"]
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        return [f"{where}: not UTF-8 text (byte {e.start}); {why}, NAME=VALUE a line"]
    # the runner reads it in text mode: '\r\n' and '\r' end lines too, and a last line needs no newline
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    bad = []
    for i, line in enumerate(lines, 1):
        name, eq, value = line.partition("=")
        if not eq:
            bad.append(f"{where} line {i}: {echo(line)}: not NAME=VALUE (DeepSpeed's runner fails on a line "
                       "without '=', an empty line included)")
        elif _CONTROL.search(line):
            bad.append(f"{where} line {i}: holds a control character; {why}")
        else:
            problem = export_problem(name, value)
            if problem:
                bad.append(f"{where} line {i}: {why} {problem}")
    if len(bad) > shown_lines:
        bad = bad[:shown_lines] + [f"{where}: {len(bad) - shown_lines} more lines like these"]
    return bad


def read_hostfile(path: str | Path, spec: LaunchSpec) -> dict[str, int]:
    """Parse a DeepSpeed hostfile (``host slots=N`` lines) with DeepSpeed's own parser and check it
    has ``nnodes`` hosts of at least ``nproc_per_node`` slots."""
    import logging
    import stat

    p = Path(path)
    where = f"--hostfile {shorten(str(p))}"
    try:
        st = p.stat()
    except FileNotFoundError:
        raise RecipeError(f"{where}: no such file") from None
    except OSError as e:
        raise RecipeError(f"{where}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RecipeError(f"{where}: not a regular file")
    if st.st_size > MAX_HOSTFILE_BYTES:
        raise RecipeError(f"{where}: {st.st_size} bytes; a hostfile holds one 'host slots=N' line per node "
                          f"(at most {MAX_HOSTFILE_BYTES // 2**20} MiB)")
    # DeepSpeed logs a notice at import (the accelerator it picked) and the whole file before raising on a bad
    # one, on stdout (its handler takes sys.stdout at its first import): the line below says what matters, and
    # stdout keeps --json alone.
    ds_logger, quiet = logging.getLogger("DeepSpeed"), (lambda record: False)
    ds_logger.addFilter(quiet)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.launcher.runner import fetch_hostfile
        pool = fetch_hostfile(str(p))
    except UnicodeDecodeError:
        raise RecipeError(f"{where}: not text (a hostfile holds 'host slots=N' lines)") from None
    except ValueError as e:  # a bad entry, a repeated host, no host
        raise RecipeError(f"{where}: {shorten(str(e), 200)}") from None
    except OSError as e:
        raise RecipeError(f"{where}: cannot read ({e.strerror or e})") from None
    finally:
        ds_logger.removeFilter(quiet)
    problems = [f"{where}: {echo(h)} is not {HOST_RULE}" for h in pool if not is_host(h)][:3]
    if len(pool) < spec.nnodes:
        problems.append(f"--hostfile {p}: {len(pool)} host(s), but --nnodes is {spec.nnodes}")
    small = [h for h, slots in list(pool.items())[:spec.nnodes] if slots < spec.nproc_per_node]
    if small:
        problems.append(f"--hostfile {p}: {', '.join(small)} ha{'s' if len(small) == 1 else 've'} fewer than "
                        f"--nproc-per-node {spec.nproc_per_node} slots")
    if problems:
        raise RecipeError(problems)
    return pool


def hostfile_text(hosts: list[str], slots: int) -> str:
    """A DeepSpeed hostfile with ``slots`` ranks on each of ``hosts``."""
    if not hosts or not all(is_host(h) for h in hosts):
        raise RecipeError(f"--hosts: expected comma-separated hosts, each {HOST_RULE}; got {echo(','.join(hosts))}")
    return "".join(f"{h} slots={slots}\n" for h in hosts)


def node_env(launcher: str) -> dict[str, str]:
    """Environment the node process (torchrun's agent or the DeepSpeed launcher) needs, shown by ``--dry-run``.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun: by default its workers share the agents'
    rendezvous store across restarts, so after a restart a fast rank can read the address a dead
    rank of the previous attempt published and fail to connect (3 of 5 kill -9 trials with two
    nodes); with it, every attempt gets a fresh store (0 of 11).
    """
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun" else {}


def thread_env(nproc_per_node: int) -> dict[str, str]:
    """Each rank's share of this node's cores (:mod:`scaletool.threads`; an explicit ``OMP_NUM_THREADS``
    wins), as the environment of its process (decided on the node)."""
    return child_env(threads_per_process(nproc_per_node))
