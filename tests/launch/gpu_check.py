"""Launch failures on a real 2-GPU host with NCCL (run by hand; pytest does not collect this file).

    PYTHONUNBUFFERED=1 python3 tests/launch/gpu_check.py OUT_DIR

Two one-GPU "nodes" on one host (CUDA_VISIBLE_DEVICES=0 and 1) meeting at a loopback rendezvous:
1. kill -9 of a worker with --max-restarts 1: the group restarts and resumes (NCCL, FSDP2, DCP);
2. a hung peer (SIGSTOP) with parallel.collective_timeout_s=20: the NCCL watchdog ends the other rank;
then on both GPUs of one node: 3. more ranks than GPUs (launch's check, and torchrun without it);
4. out of memory. Each check prints PASS/FAIL with the lines seen; OUT_DIR/launch_gpu_check.json has them.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "scaletool", "launch", "torchrun"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv, log: Path, gpus: str) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, stdout=open(log.with_suffix(".out"), "w"), stderr=open(log, "w"),
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus})


def errors(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith("error: ")]


def two_nodes(out: Path, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    return [start(LAUNCH + ["recipes/tiny.yaml", "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint",
                            f"127.0.0.1:{port}", "--out", str(out), "--set", "parallel.engine=fsdp",
                            "--set", "model.dtype=bf16", *extra], out.parent / f"{out.name}-node{i}.err", str(i))
            for i in range(2)]


def wait_until(ready, procs, limit=300):
    t0 = time.time()
    while not ready():
        if any(p.poll() is not None for p in procs) or time.time() - t0 > limit:
            raise RuntimeError("a node ended (or nothing happened) before the failure was injected")
        time.sleep(0.05)


def worker(node: subprocess.Popen) -> psutil.Process:
    return next(p for p in psutil.Process(node.pid).children() if "scaletool" in " ".join(p.cmdline()))


def check_restart(base: Path) -> dict:
    out = base / "restart"
    nodes = two_nodes(out, "--max-restarts", "1", "--set", "train.steps=200", "--set", "train.checkpoint_every=20")
    ckpt = out / "checkpoints" / "step_20" / "trainer.json"
    wait_until(ckpt.exists, nodes)
    worker(nodes[1]).kill()
    codes = [n.wait(timeout=600) for n in nodes]
    s = json.loads((out / "summary.json").read_text())
    ok = codes == [0, 0] and s["status"] == "completed" and s["history"]["step"] == list(range(200)) \
        and s["elastic"]["restart_count"] == 1 and s["start_step"] >= 20
    return {"ok": ok, "exit": codes, "start_step": s.get("start_step"), "elastic": s.get("elastic"),
            "gpu_names": s["environment"].get("gpu_names"), "backend": s["environment"].get("backend")}


def check_hung_peer(base: Path) -> dict:
    out = base / "hung"
    nodes = two_nodes(out, "--set", "train.steps=1000000", "--set", "parallel.collective_timeout_s=20")
    metrics = out / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count("loss/train") >= 3, nodes)
    hung = worker(nodes[1])
    hung.send_signal(signal.SIGSTOP)
    t0 = time.time()
    code0 = nodes[0].wait(timeout=600)
    waited = time.time() - t0
    hung.send_signal(signal.SIGCONT)
    code1 = nodes[1].wait(timeout=600)
    lines = errors(base / "hung-node0.err")
    return {"ok": code0 == 1 and any("communication timed out" in ln for ln in lines), "exit": [code0, code1],
            "seconds_to_fail": round(waited, 1), "lines": lines, "other_node": errors(base / "hung-node1.err")}


def check_too_many_ranks(base: Path) -> dict:
    pre = subprocess.run(LAUNCH + ["recipes/tiny.yaml", "--nproc-per-node", "3", "--set", "parallel.engine=ddp",
                                   "--out", str(base / "pre")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    log = base / "torchrun3.err"
    p = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m",
               "scaletool", "train", "recipes/tiny.yaml", "--set", "parallel.engine=ddp", "--out",
               str(base / "torchrun3")], log, "0,1")
    code = p.wait(timeout=600)
    lines = errors(log)
    return {"ok": pre.returncode == 2 and "2 CUDA device(s)" in pre.stderr and code != 0
            and any("missing GPU" in ln for ln in lines),
            "launch_exit": pre.returncode, "launch_line": pre.stderr.strip().splitlines()[-1:], "torchrun_exit": code,
            "lines": lines}


def check_oom(base: Path) -> dict:
    log = base / "oom.err"
    p = start(LAUNCH + ["recipes/mha-1b.yaml", "--nproc-per-node", "2", "--set", "parallel.engine=ddp",
                        "--set", "train.micro_batch_size=128", "--set", "train.steps=2", "--out", str(base / "oom")],
              log, "0,1")
    code = p.wait(timeout=600)
    lines = errors(log)
    return {"ok": code == 1 and any("out of memory" in ln for ln in lines), "exit": code, "lines": lines}


def main() -> None:
    base = Path(sys.argv[1]).resolve()
    base.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, check in (("restart", check_restart), ("hung_peer", check_hung_peer),
                        ("too_many_ranks", check_too_many_ranks), ("oom", check_oom)):
        try:
            results[name] = check(base)
        except Exception as e:  # noqa: BLE001 - report every check, whatever one of them does
            results[name] = {"ok": False, "exception": f"{type(e).__name__}: {e}"}
        print(("PASS " if results[name]["ok"] else "FAIL ") + name, json.dumps(results[name])[:1500], flush=True)
    (base / "launch_gpu_check.json").write_text(json.dumps(results, indent=2))
    sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


if __name__ == "__main__":
    main()
