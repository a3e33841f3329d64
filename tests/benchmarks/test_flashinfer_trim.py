"""flashinfer_trim.py on a small synthetic flashinfer wheel built here: the include walk keeps what the MLA
sources reach (transitively, quoted relative names, CUTLASS's CUDA_STD_HEADER) and drops the rest, the
CCCL roots stay whole, RECORD is exact, and pip installs the result. No network."""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "scripts" / "peers" / "flashinfer_trim.py"
spec = importlib.util.spec_from_file_location("flashinfer_trim", SCRIPT)
T = importlib.util.module_from_spec(spec)
spec.loader.exec_module(T)

D = "flashinfer/data/"
DIST = "flashinfer_python-0.0.1.dist-info/"
MLA = {f"csrc/batch_mla{sm}_{p}.cu": '#include <flashinfer/attention/mla.cuh>\n#include "batch_mla_config.inc"\n'
       for sm in ("", "_sm90") for p in ("plan", "run", "binding")}
DATA = {
    **MLA,
    "csrc/batch_mla_config.jinja": '#include "tvm_ffi_utils.h"\n',
    "csrc/tvm_ffi_utils.h": "#include <tvm/ffi/function.h>\n",                  # reached; tvm-ffi not here
    "include/flashinfer/attention/mla.cuh": '#include "../utils.cuh"\n  #  include <cute/tensor.hpp>\n',
    "include/flashinfer/utils.cuh": "#include <cuda_runtime.h>\n",               # reached via "../"
    "cutlass/include/cute/tensor.hpp": "#include CUDA_STD_HEADER(cstdint)\n#include <cute/layout.hpp>\n",
    "cutlass/include/cute/layout.hpp": "// leaf\n",
    "cutlass/include/cute/unused.hpp": "// never included\n",
    "include/flashinfer/unused.cuh": '#include "utils.cuh"\n',
    "csrc/other_kernel.cu": "#include <flashinfer/unused.cuh>\n",
    "cccl/libcudacxx/include/cuda/std/cstdint": "// kept whole\n",
    "cccl/libcudacxx/include/cuda/std/unreached": "// kept whole\n",
    "cccl/docs/readme.md": "dropped\n",
    "build_utils.py": "# directly in data/: kept\n",
}
KEPT_DATA = set(DATA) - {"cutlass/include/cute/unused.hpp", "include/flashinfer/unused.cuh", "csrc/other_kernel.cu",
                         "cccl/docs/readme.md"}
OTHER = {"flashinfer/__init__.py": "__version__ = '0.0.1'\n", "flashinfer/mla/__init__.py": "",
         "flashinfer/experimental/big.py": "X = 1\n",
         DIST + "METADATA": "Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.0.1\nRequires-Dist: tqdm\n"
                            'Requires-Dist: apache-tvm-ffi<0.2,>=0.1.11\nRequires-Dist: rich; extra == "b12x"\n',
         DIST + "WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}


def make_wheel(path, data=DATA):
    files = {**{D + k: v for k, v in data.items()}, **OTHER}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(DIST + "RECORD", "".join(f"{n},,\n" for n in files) + f"{DIST}RECORD,,\n")
    return path


def test_include_walk_follows_quoted_relative_and_macro_includes():
    files = {k: v.encode() for k, v in DATA.items()}
    reached, missing = T.include_walk(files, list(MLA) + ["csrc/batch_mla_config.jinja"], T.INCLUDE_DIRS)
    assert reached == KEPT_DATA - {"cccl/libcudacxx/include/cuda/std/unreached", "build_utils.py"}
    assert {"batch_mla_config.inc", "tvm/ffi/function.h", "cuda_runtime.h", "cstdint"} <= missing
    assert "../utils.cuh" not in missing and "cuda/std/cstdint" not in missing


def test_trimmed_wheel_has_exact_record_and_installs(tmp_path):
    src = make_wheel(tmp_path / "flashinfer_python-0.0.1-py3-none-any.whl")
    out = tmp_path / "out"
    assert T.main(["--wheel", str(src), "--out", str(out), "--no-deps"]) == 0
    dst = out / src.name
    with zipfile.ZipFile(dst) as z:
        names = set(z.namelist())
        assert {n[len(D):] for n in names if n.startswith(D)} == KEPT_DATA
        assert set(OTHER) <= names
        assert z.read(DIST + "METADATA").decode() == OTHER[DIST + "METADATA"]
        rows = list(csv.reader(io.StringIO(z.read(DIST + "RECORD").decode())))
        assert {r[0] for r in rows} == names
        for name, digest, size in rows:
            if name == DIST + "RECORD":
                assert digest == size == ""
                continue
            data = z.read(name)
            assert size == str(len(data))
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(target),
                        str(dst)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (target / D / "include/flashinfer/utils.cuh").is_file()
    assert (target / D / "cccl/libcudacxx/include/cuda/std/unreached").is_file()
    assert not (target / D / "csrc/other_kernel.cu").exists()
    assert (target / "flashinfer/experimental/big.py").is_file()


def test_requires_ignores_extras(tmp_path):
    reqs = T.requires(make_wheel(tmp_path / "w.whl"))
    assert reqs == {"tqdm": "tqdm", "apache-tvm-ffi": "apache-tvm-ffi<0.2,>=0.1.11"}


@pytest.mark.parametrize("case", ["not-a-zip", "missing", "no-mla"])
def test_bad_wheel_exits_2_with_one_error_line(tmp_path, case, capsys):
    path = tmp_path / "x.whl"
    if case == "not-a-zip":
        path.write_text("not a zip")
    elif case == "no-mla":
        make_wheel(path, {k: v for k, v in DATA.items() if k != "csrc/batch_mla_sm90_run.cu"})
    out = tmp_path / "out"
    assert T.main(["--wheel", str(path), "--out", str(out), "--no-deps"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert not out.exists()
