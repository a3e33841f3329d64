"""A small flashinfer-python wheel for the MLA decode peer: its Python package plus the CUDA sources
and headers that the batch-MLA JIT module (fa2 and fa3 backends) compiles, and nothing else.

FlashInfer's wheel (~62 MB) carries ~420 MB of CUDA sources for every kernel; on first use the MLA
wrapper JIT-compiles ``csrc/batch_mla{,_sm90}_{plan,run,binding}.cu`` (rendered config from
``csrc/batch_mla_config.jinja``) with nvcc against ``data/include``, ``data/csrc``, CUTLASS,
spdlog and the vendored CCCL. This keeps those .cu files and the headers their ``#include``
directives reach, transitively (a regex walk over the same include dirs flashinfer's JIT passes, in
its order), keeps the three vendored CCCL include roots whole (CCCL includes through macros a regex
cannot follow), drops the rest of ``flashinfer/data``, and rewrites RECORD. Then it downloads the
runtime dependencies a torch 2.11 GPU image lacks (cp312 manylinux wheels).

Usage (any machine with pip and network; writes .whl-fi/ in the repository root):
    python benchmarks/scripts/peers/flashinfer_trim.py [--version 0.7.2.post1] [--out DIR] [--wheel FILE]
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import posixpath
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.7.2.post1"
ROOT = Path(__file__).resolve().parents[3]
DATA = "flashinfer/data/"
# what gen_batch_mla_module (flashinfer/jit/attention/modules.py) copies and compiles, per backend
MLA_SOURCES = [f"csrc/batch_mla{sm}_{part}.cu" for sm in ("", "_sm90") for part in ("plan", "run", "binding")]
MLA_SOURCES.append("csrc/batch_mla_config.jinja")
# include dirs, in the order flashinfer.jit.cpp_ext.build_common_cflags passes them (CCCL first, with -I)
CCCL_DIRS = ["cccl/cub", "cccl/libcudacxx/include", "cccl/thrust"]
INCLUDE_DIRS = CCCL_DIRS + ["include", "csrc", "cutlass/include", "cutlass/tools/util/include", "spdlog/include"]
# kept whole: the CCCL headers proper (under each root: cub/, cuda/ + nv/, thrust/)
KEEP_WHOLE = ["cccl/cub/cub/", "cccl/libcudacxx/include/", "cccl/thrust/thrust/"]
# runtime dependencies imported by `import flashinfer, flashinfer.mla` and the fa2/fa3 JIT path that a
# torch 2.11 image lacks (torch brings jinja2 and filelock; the image has numpy, requests, click,
# tabulate, einops, packaging, ninja, nvidia-ml-py, cuda-bindings). apache-tvm-ffi is imported by
# flashinfer.jit and supplies the headers and library the module links; tqdm is imported at import time.
CARRY = ("apache-tvm-ffi", "tqdm")
INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*(?:[<"]([^>"]+)[>"]|CUDA_STD_HEADER\(([^)]+)\))', re.M)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def includes(text: str) -> list[tuple[str, bool]]:
    """(name, quoted) for every #include in text; CUDA_STD_HEADER(x) (CUTLASS) names cuda/std/x and x."""
    out = []
    for m in INCLUDE_RE.finditer(text):
        if m.group(1):
            out.append((m.group(1), m.group(0).rstrip().endswith('"')))
        else:
            out += [(f"cuda/std/{m.group(2)}", False), (m.group(2), False)]
    return out


def include_walk(files, sources: list[str], dirs: list[str]) -> tuple[set[str], set[str]]:
    """Files reached from sources by #include, transitively, resolving each name as the compiler would
    (a quoted name in the including file's own dir first, then dirs in order). files maps a relative path
    to its bytes (read only for the files reached). Returns (reached, names found in none of dirs: system,
    CUDA toolkit and tvm-ffi headers, generated config)."""
    reached, missing, todo = set(), set(), [s for s in sources if s in files]
    while todo:
        path = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        for name, quoted in includes(files[path].decode("utf-8", "replace")):
            here = [posixpath.dirname(path)] if quoted else []
            for d in here + dirs:
                cand = posixpath.normpath(posixpath.join(d, name))
                if cand in files:
                    todo.append(cand)
                    break
            else:
                missing.add(name)
    return reached, missing


def record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def write_wheel(src: Path, dst: Path, keep) -> tuple[int, int]:
    """Copy the members of wheel src for which keep(name) is true into dst, with a new RECORD
    (sha256 and size of every file kept; METADATA, WHEEL and the rest of dist-info unchanged).
    Returns (members kept, members dropped)."""
    kept = dropped = 0
    rows = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
        for info in zin.infolist():
            if info.filename == record or info.is_dir():
                continue
            if not keep(info.filename):
                dropped += 1
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            rows.append(record_line(info.filename, data))
            kept += 1
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows + [[record, "", ""]])
        zout.writestr(zipfile.ZipInfo(record, date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue(),
                      compress_type=zipfile.ZIP_DEFLATED)
    return kept, dropped


class LazyMembers(dict):
    """The wheel's members under prefix, keyed by their path below it, read on first access."""

    def __init__(self, zin: zipfile.ZipFile, prefix: str):
        super().__init__((n[len(prefix):], None) for n in zin.namelist() if n.startswith(prefix) and not n.endswith("/"))
        self.zin, self.prefix = zin, prefix

    def __getitem__(self, key: str) -> bytes:
        if super().__getitem__(key) is None:
            self[key] = self.zin.read(self.prefix + key)
        return super().__getitem__(key)


def mla_keep(zin: zipfile.ZipFile) -> tuple[callable, set[str], set[str]]:
    """The keep predicate for flashinfer's wheel: everything outside flashinfer/data/, the files directly
    in it, the MLA sources, the headers they reach and the CCCL include roots."""
    files = LazyMembers(zin, DATA)
    absent = [s for s in MLA_SOURCES if s not in files]
    if absent:
        raise ValueError(f"this wheel lacks the MLA JIT sources {', '.join(absent)} (under {DATA})")
    reached, missing = include_walk(files, MLA_SOURCES, INCLUDE_DIRS)

    def keep(name: str) -> bool:
        if not name.startswith(DATA):
            return True
        rel = name[len(DATA):]
        return "/" not in rel or rel in reached or any(rel.startswith(k) for k in KEEP_WHOLE)
    return keep, reached, missing


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def requires(wheel: Path) -> dict[str, str]:
    """Requires-Dist without an extra marker: normalised name -> requirement string."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    out = {}
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = line.split(":", 1)[1].split(";")[0].strip()
            out[re.split(r"[<>=!~ \[]", req)[0].lower().replace("_", "-")] = req
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", default=VERSION, help=f"flashinfer-python release (default {VERSION})")
    ap.add_argument("--wheel", type=Path, help="trim this flashinfer-python wheel instead of downloading one")
    ap.add_argument("--out", type=Path, default=ROOT / ".whl-fi", help="output directory (default .whl-fi/)")
    ap.add_argument("--no-deps", action="store_true", help="only the trimmed wheel, no dependencies")
    a = ap.parse_args(argv)
    if a.wheel is not None and not zipfile.is_zipfile(a.wheel):
        print(f"error: {a.wheel} is not a wheel (zip) file", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        src = a.wheel
        if src is None:
            pip("download", "--no-deps", f"flashinfer-python=={a.version}", "-d", tmp)
            src = next(Path(tmp).glob("flashinfer_python-*.whl"))
        try:
            with zipfile.ZipFile(src) as zin:
                keep, reached, missing = mla_keep(zin)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        a.out.mkdir(parents=True, exist_ok=True)
        dst = a.out / src.name
        kept, dropped = write_wheel(src, dst, keep)
        log(f"{src.name}: {src.stat().st_size / 2**20:.1f} MiB -> {dst.stat().st_size / 2**20:.1f} MiB "
            f"({kept} files kept, {dropped} dropped; {len(reached)} reached by the include walk, "
            f"{len(missing)} names left to the system/CUDA/tvm-ffi include paths)")
        if not a.no_deps:
            reqs = requires(src)
            for name in CARRY:
                pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                    "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(a.out),
                    reqs.get(name, name))
    total = sum(p.stat().st_size for p in a.out.glob("*.whl"))
    for p in sorted(a.out.glob("*.whl")):
        print(f"{p.stat().st_size / 2**20:7.2f} MiB  {p.name}")
    print(f"{total / 2**20:7.2f} MiB  total in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
