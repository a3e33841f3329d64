"""Greedy decode steps of a whole batch, one call per step: the eager reference and the CUDA graph.

Both keep the current tokens on the device (greedy argmax, no host reads), so a timed loop around
``step()`` never waits for the GPU.

- :class:`EagerSteps`: the position is a Python int and attention reads the cache prefix up to it
  (``Transformer.step``'s slicing path). This is the reference.
- :class:`GraphSteps`: gpt-fast's decode loop. Token and position live in device tensors, the
  caches are static (every shape fixed at ``max_len``), attention masks the positions past the
  current one (the Triton latent kernel reads a device-side length and skips them), and the step
  ends by writing the next token and advancing the position in place. On CUDA that step is
  captured once in a CUDA graph and every ``step()`` is one ``replay()`` (hundreds of launches per
  step). We capture with ``torch.cuda.CUDAGraph`` directly: the eager kernels stay the ones measured.
- ``compile=True``: the static step through ``torch.compile`` (static shapes, one compile per point),
  captured in the same graph, as gpt-fast does; not ``mode="reduce-overhead"``, whose graph trees skip
  graphs that mutate non-static inputs (token and position). The MLA kernel is the custom operator
  ``scaletool::mla_decode`` there; ``tuning=True`` adds Inductor's coordinate-descent tuning.
- ``gemv=True``: bias-free linear layers through :mod:`scaletool.kernels.gemv` at up to 8 rows;
  ``split=N``: the batch as N parts on N CUDA streams in the one captured step (not compiled); ``pdl=True``:
  its Triton kernels under programmatic dependent launch (:mod:`scaletool.kernels.pdl`; Hopper and newer).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from scaletool.kernels import gemv as gemv_kernel
from scaletool.kernels import pdl as pdl_kernels
from scaletool.model.attention import DecodeMode
from scaletool.model.cache import cache_rows
from scaletool.model.transformer import Transformer


class EagerSteps:
    """Greedy steps with an int position over the cache prefix (the reference path)."""

    cuda_graph, compiled, tuning, compile_s, graph_breaks, gemv_linears, split, pdl = (False, False, None, None, None, 0,
                                                                                       1, False)

    def __init__(self, model: Transformer, caches: nn.ModuleList, mode: DecodeMode, token: torch.Tensor, pos: int):
        self.model, self.caches, self.mode = model, caches, mode
        self.token, self.pos = token, pos  # (B,) the token at position pos, not yet in the caches

    def step(self) -> None:
        self.token = self.model.step(self.token[:, None], self.pos, self.caches, self.mode).argmax(-1)
        self.pos += 1

    def mark(self) -> tuple:
        """Where the stepper stands (token, position), for :meth:`rewind` (a step replaces the token tensor,
        never writes into it)."""
        return self.token, self.pos

    def rewind(self, mark: tuple) -> None:
        """Back to ``mark``: the next step rewrites the cache row the steps since wrote."""
        self.token, self.pos = mark


class GraphSteps:
    """Greedy steps over the static caches with token and position as device tensors.

    ``capture=True`` (CUDA only) records one step in a CUDA graph after two warm-up steps on a side
    stream (Triton compilation, cuBLAS workspaces and SDPA kernel selection must happen before the
    capture); the warm-up writes land at the positions the real steps overwrite next. Without
    capture the same static step runs eagerly: what the CPU tests compare against the reference.
    """

    def __init__(self, model: Transformer, caches: nn.ModuleList, mode: DecodeMode, token: torch.Tensor, pos: int,
                 *, capture: bool, compile: bool = False, backend: str = "inductor", tuning: bool = False,
                 gemv: bool = False, split: int = 1, pdl: bool = False):
        self.model, self.caches, self.mode = model, caches, mode
        self.pdl = bool(pdl) and pdl_kernels.supported(token.device)  # programmatic dependent launch
        self.token = token.clone()  # (B,) static: the graph reads and writes this storage
        self.pos = torch.tensor(pos, dtype=torch.long, device=token.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled = compile
        self.tuning = tuning if compile else None  # Inductor's coordinate-descent tuning
        # bias-free linear layers routed through the Triton GEMV at decode's few rows (0: cuBLAS throughout)
        self.gemv_linears = gemv_kernel.install(model) if gemv and gemv_usable(model) else 0
        self.compile_s: float | None = None  # seconds of the first compiled call (tracing and code generation)
        self.graph_breaks: int | None = None
        # split > 1: the batch as that many parts, each decoded on its own CUDA stream inside the one step
        # (and graph), so one part's projections can run beside another's attention
        if split > 1 and compile:
            raise ValueError("split: the batch parts run on separate CUDA streams, which the compiled step does "
                             "not take; use the graphed eager step")
        self.split = max(1, min(split, int(token.shape[0])))
        bounds = [round(i * token.shape[0] / self.split) for i in range(self.split + 1)]
        self._parts = None if self.split == 1 else [
            (lo, hi, cache_rows(caches, lo, hi), torch.cuda.Stream(token.device) if token.is_cuda else None)
            for lo, hi in zip(bounds, bounds[1:])]
        self._run = self._static_step
        if compile:
            self._compile(backend)
        if capture:
            self._capture()

    def _compile(self, backend: str) -> None:
        """Compile the static step and run it once (restoring token, position and the cache row it wrote)."""
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # a fresh compile per point: shapes differ, and the recompile limit stays far
        counters.clear()
        self._run = torch.compile(self._static_step, backend=backend, dynamic=False)
        mark = self.mark()
        if self.token.is_cuda:
            torch.cuda.synchronize(self.token.device)
        t0 = time.perf_counter()
        import torch._inductor.config as inductor_config

        with inductor_config.patch({"coordinate_descent_tuning": bool(self.tuning),  # the first call compiles
                                    "triton.enable_pdl": self.pdl}), pdl_kernels.enabled(self.pdl):
            self._run()
        if self.token.is_cuda:
            torch.cuda.synchronize(self.token.device)
        self.compile_s = time.perf_counter() - t0
        self.graph_breaks = int(sum(counters["graph_break"].values()))
        self.rewind(mark)  # the step's cache write lands at pos, which the next step overwrites

    @property
    def cuda_graph(self) -> bool:
        return self.graph is not None

    def mark(self) -> tuple:
        """Where the stepper stands (copies of token and position), for :meth:`rewind`."""
        return self.token.clone(), self.pos.clone()

    def rewind(self, mark: tuple) -> None:
        """Back to ``mark``, in place (a CUDA graph reads these very tensors): the next step rewrites the
        cache row the steps since wrote."""
        self.token.copy_(mark[0])
        self.pos.copy_(mark[1])

    def _static_step(self) -> None:
        if self._parts is None:
            logits = self.model.step(self.token[:, None], self.pos, self.caches, self.mode)
            self.token.copy_(logits.argmax(-1))
        else:
            here = torch.cuda.current_stream(self.token.device) if self.token.is_cuda else None
            for lo, hi, caches, stream in self._parts:  # fork: every part waits for what came before the step
                if stream is not None:
                    stream.wait_stream(here)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    logits = self.model.step(self.token[lo:hi, None], self.pos, caches, self.mode)
                    self.token[lo:hi].copy_(logits.argmax(-1))
            for *_, stream in self._parts:  # join: the position advances after every part
                if stream is not None:
                    here.wait_stream(stream)
        self.pos.add_(1)

    def _capture(self) -> None:
        if self.token.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        mark = self.mark()
        side = torch.cuda.Stream(self.token.device)
        side.wait_stream(torch.cuda.current_stream(self.token.device))
        with torch.cuda.stream(side), pdl_kernels.enabled(self.pdl):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream(self.token.device).wait_stream(side)
        self.rewind(mark)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), pdl_kernels.enabled(self.pdl):  # the graph keeps each launch's attribute
            self._run()
        self.graph = graph

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with pdl_kernels.enabled(self.pdl):
                self._run()


def gemv_usable(model: nn.Module) -> bool:
    """Whether the Triton GEMV (:mod:`scaletool.kernels.gemv`) can run this model's decode projections:
    Triton and CUDA present, 16-bit weights on a CUDA device."""
    w = next(model.parameters())
    return (gemv_kernel.triton is not None and w.device.type == "cuda"
            and w.dtype in (torch.bfloat16, torch.float16))


def make_steps(model: Transformer, caches: nn.ModuleList, mode: DecodeMode, token: torch.Tensor, pos: int,
               cuda_graph: bool, compile: bool = False, backend: str = "inductor",
               tuning: bool = False, gemv: bool = False, split: int = 1, pdl: bool = False) -> EagerSteps | GraphSteps:
    """The stepper a benchmark point runs: captured static steps with ``cuda_graph``, compiled with
    ``compile`` (captured too on CUDA with ``cuda_graph``), else the reference."""
    if cuda_graph or compile or split > 1:
        return GraphSteps(model, caches, mode, token, pos, capture=cuda_graph, compile=compile, backend=backend,
                          tuning=tuning, gemv=gemv, split=split, pdl=pdl)
    return EagerSteps(model, caches, mode, token, pos)
