"""Decode steps with the position on the device (the CUDA-graph path) against the eager reference.

On CPU the static step runs uncaptured: same shapes, same masks, same in-place token/position
updates as the captured graph, so its agreement with the reference checks the graph path's maths.
The CUDA test captures the graph for real and compares it with eager decoding.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from tiny_variants import VARIANTS, tiny_model

from scaletool.decode.generate import prefill
from scaletool.decode.steps import EagerSteps, GraphSteps, make_steps
from scaletool.model.attention import DecodeMode
from scaletool.model.cache import make_caches, replicate_first_row


def _run(cls_or_factory, model, cfg, mode, B, T, steps, device="cpu", dtype=torch.float32, **kw):
    """Prefill a random prompt of T tokens, then decode ``steps`` greedy tokens; (tokens (B, steps), logits)."""
    caches = make_caches(cfg, B, T + steps + 2, dtype=dtype, device=device, mla_mode=mode.mla)
    prompt = torch.randint(cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(11)).to(device)
    logits = prefill(model, prompt, caches, mode=mode)
    replicate_first_row(caches, T, B)
    st = cls_or_factory(model, caches, mode, logits.argmax(-1).expand(B).contiguous(), T, **kw)
    out = []
    for _ in range(steps):
        st.step()
        out.append(st.token.clone())
    return torch.stack(out, 1), caches


@pytest.mark.parametrize("label", list(VARIANTS))
def test_static_steps_reproduce_the_eager_reference(label):
    cfg, model, mla = tiny_model(label)
    mode = DecodeMode(mla, "torch")
    eager, c_eager = _run(EagerSteps, model, cfg, mode, 3, 9, 12)
    static, c_static = _run(GraphSteps, model, cfg, mode, 3, 9, 12, capture=False)
    assert torch.equal(static, eager)
    for a, b in zip(c_eager.buffers(), c_static.buffers()):  # the caches hold the same entries
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("label", ["mha", "mla", "mla-naive"])
def test_static_step_masks_whatever_the_cache_holds_past_the_position(label):
    """One step at a device position over a longer cache holding garbage past it equals the int-position step."""
    cfg, model, mla = tiny_model(label)
    mode = DecodeMode(mla, "torch")
    prompt = torch.randint(cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    a, b = (make_caches(cfg, 2, 16, dtype=torch.float32, device="cpu", mla_mode=mla) for _ in range(2))
    prefill(model, prompt, a, mode=mode)
    prefill(model, prompt, b, mode=mode)
    for buf in b.buffers():
        buf.narrow(1 if buf.dim() == 3 else 2, 10, 6).fill_(1e3)  # positions 10..15: (B,S,c) or (B,KV,S,d)
    tok = prompt[:, -1:]
    torch.testing.assert_close(model.step(tok, torch.tensor(10), b, mode), model.step(tok, 10, a, mode))


def test_make_steps_refuses_graphs_off_cuda():
    cfg, model, _ = tiny_model("mla")
    caches = make_caches(cfg, 1, 8, dtype=torch.float32, device="cpu")
    assert isinstance(make_steps(model, caches, DecodeMode(), torch.zeros(1, dtype=torch.long), 2, False), EagerSteps)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        make_steps(model, caches, DecodeMode(), torch.zeros(1, dtype=torch.long), 2, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("label,kernel", [("mha", "auto"), ("mla", "auto"), ("mla", "torch"), ("mla-naive", "auto")])
def test_cuda_graph_replay_agrees_with_eager_decoding(label, kernel):
    cfg, model, mla = tiny_model(label, **{"model.dtype": "bf16", "model.kv_lora_rank": 64,
                                           "model.qk_rope_head_dim": 16} if label.startswith("mla") else {})
    model = model.to("cuda", torch.bfloat16)
    mode = DecodeMode(mla, kernel)
    eager, _ = _run(EagerSteps, model, cfg, mode, 4, 40, 24, device="cuda", dtype=torch.bfloat16)
    graph, _ = _run(make_steps, model, cfg, mode, 4, 40, 24, device="cuda", dtype=torch.bfloat16, cuda_graph=True)
    # bf16 logits of a random model have near-ties; greedy tokens may part after one, so compare the
    # first steps exactly and the rest by agreement rate
    assert torch.equal(graph[:, :4], eager[:, :4])
    assert (graph == eager).float().mean() > 0.9


@pytest.mark.parametrize("label", ["mha", "mla"])
def test_compiled_static_step_reproduces_the_eager_reference(label):
    """torch.compile of the static step (the CPU inductor where a C compiler is present) gives the eager
    reference's tokens; MLA's compiled step calls the latent kernel as the custom operator (kernel
    'triton', which on a CPU runs the operator's reference body) and the trace has no graph break."""
    cfg, model, mla = tiny_model(label)
    backend = "inductor" if shutil.which("cc") or shutil.which("gcc") else "aot_eager"
    eager, _ = _run(EagerSteps, model, cfg, DecodeMode(mla, "torch"), 2, 7, 6)
    compiled, _ = _run(make_steps, model, cfg, DecodeMode(mla, "triton" if mla else "auto"), 2, 7, 6,
                       cuda_graph=False, compile=True, backend=backend)
    assert torch.equal(compiled, eager)


def test_compiled_step_records_its_compile_and_has_no_graph_break():
    cfg, model, mla = tiny_model("mla")
    caches = make_caches(cfg, 1, 8, dtype=torch.float32, device="cpu", mla_mode=mla)
    st = make_steps(model, caches, DecodeMode(mla, "triton"), torch.zeros(1, dtype=torch.long), 2, False,
                    compile=True, backend="aot_eager")
    assert st.compiled and st.graph_breaks == 0 and st.compile_s > 0
    assert int(st.pos) == 2  # the compile's own step is undone: the next step runs at the same position


@pytest.mark.parametrize("tuning", [True, False])
def test_the_compile_sees_coordinate_descent_tuning_as_asked(tuning):
    import torch._inductor.config as inductor_config

    seen = []

    def backend(gm, example_inputs):  # what Inductor would read, at the moment it would compile
        seen.append(inductor_config.coordinate_descent_tuning)
        return gm.forward

    cfg, model, mla = tiny_model("mha")
    caches = make_caches(cfg, 1, 8, dtype=torch.float32, device="cpu", mla_mode=mla)
    before = inductor_config.coordinate_descent_tuning
    st = make_steps(model, caches, DecodeMode(mla, "auto"), torch.zeros(1, dtype=torch.long), 2, False,
                    compile=True, backend=backend, tuning=tuning)
    assert seen and set(seen) == {tuning} and st.tuning is tuning
    assert inductor_config.coordinate_descent_tuning == before  # patched for the compile only
    assert make_steps(model, caches, DecodeMode(mla, "auto"), torch.zeros(1, dtype=torch.long), 2,
                      False).tuning is None


@pytest.mark.parametrize("pdl", [True, False])
def test_the_compile_sees_programmatic_dependent_launch_as_asked(monkeypatch, pdl):
    """With ``pdl`` (on a device that has it: faked here) Inductor generates its kernels for PDL and
    scaletool's kernels launch with it while the step compiles; both settings are restored after."""
    import torch._inductor.config as inductor_config

    from scaletool.kernels import pdl as pdl_kernels

    monkeypatch.setattr(pdl_kernels, "supported", lambda device: True)
    seen = []

    def backend(gm, example_inputs):
        seen.append((inductor_config.triton.enable_pdl, pdl_kernels.launch(torch.device("cpu"))["USE_PDL"]))
        return gm.forward

    cfg, model, mla = tiny_model("mla")
    caches = make_caches(cfg, 1, 8, dtype=torch.float32, device="cpu", mla_mode=mla)
    before = inductor_config.triton.enable_pdl
    st = make_steps(model, caches, DecodeMode(mla, "auto"), torch.zeros(1, dtype=torch.long), 2, False,
                    compile=True, backend=backend, pdl=pdl)
    assert seen and set(seen) == {(pdl, pdl)} and st.pdl is pdl
    assert inductor_config.triton.enable_pdl == before and pdl_kernels.launch(torch.device("cpu"))["USE_PDL"] is False
    monkeypatch.undo()
    assert make_steps(model, caches, DecodeMode(mla, "auto"), torch.zeros(1, dtype=torch.long), 2, False,
                      compile=True, backend="aot_eager", pdl=True).pdl is False  # no PDL on a CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("how", [{"compile": True}, {"compile": True, "gemv": True}, {"split": 2},
                                 {"compile": True, "gemv": True, "pdl": True}, {"pdl": True}],
                         ids=["compiled", "compiled-gemv", "split-2", "compiled-gemv-pdl", "pdl"])
@pytest.mark.parametrize("label", ["mha", "mla"])
def test_graph_replay_agrees_with_eager_decoding(label, how):
    """The step captured in the CUDA graph against eager decoding: compiled (the MLA kernel inside it as the
    custom operator), its projections through cuBLAS or the Triton GEMV (scaletool::gemv); or eager kernels
    with the batch in two parts on two streams."""
    cfg, model, mla = tiny_model(label, **{"model.dtype": "bf16", "model.kv_lora_rank": 64,
                                           "model.qk_rope_head_dim": 16} if label == "mla" else {})
    model = model.to("cuda", torch.bfloat16)
    mode = DecodeMode(mla, "auto")
    eager, _ = _run(EagerSteps, model, cfg, mode, 6, 40, 24, device="cuda", dtype=torch.bfloat16)
    graph, _ = _run(make_steps, model, cfg, mode, 6, 40, 24, device="cuda", dtype=torch.bfloat16, cuda_graph=True,
                    **how)
    assert all(vars(m).get("_scaletool_gemv", False) == how.get("gemv", False) for m in model.modules()
               if type(m) is torch.nn.Linear and m.bias is None)
    assert torch.equal(graph[:, :4], eager[:, :4])
    assert (graph == eager).float().mean() > 0.9


@pytest.mark.parametrize("label", ["mha", "mla"])
def test_a_batch_decoded_in_parts_gives_the_whole_batchs_tokens_and_caches(label):
    """split=N decodes rows in N parts over row views of the caches (on CUDA, N streams in one graph);
    every part's tokens and cache entries equal the whole batch's, with rows that differ."""
    cfg, model, mla = tiny_model(label)
    mode = DecodeMode(mla, "torch")
    runs = {}
    for split in (1, 2, 3, 9):  # 9 > batch: one part per sequence
        caches = make_caches(cfg, 5, 24, dtype=torch.float32, device="cpu", mla_mode=mla)
        prompt = torch.randint(cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
        logits = prefill(model, prompt, caches, mode=mode)
        replicate_first_row(caches, 9, 5)
        token = (logits.argmax(-1) + torch.arange(5)) % cfg.vocab_size  # five different next tokens
        st = make_steps(model, caches, mode, token, 9, False, split=split) if split > 1 else \
            GraphSteps(model, caches, mode, token, 9, capture=False)
        out = []
        for _ in range(6):
            st.step()
            out.append(st.token.clone())
        runs[split] = (torch.stack(out, 1), caches, st.split)
    whole, whole_caches, _ = runs[1]
    assert len({tuple(r) for r in whole.tolist()}) > 1
    for split, (tokens, caches, parts) in runs.items():
        assert parts == min(split, 5) and torch.equal(tokens, whole), split
        for a, b in zip(caches.buffers(), whole_caches.buffers()):
            torch.testing.assert_close(a, b)


def test_cache_rows_are_views_and_split_refuses_compile():
    from scaletool.model.cache import cache_rows

    cfg, model, mla = tiny_model("mla")
    caches = make_caches(cfg, 4, 8, dtype=torch.float32, device="cpu", mla_mode=mla)
    part = cache_rows(caches, 1, 3)
    for whole, rows in zip(caches.buffers(), part.buffers()):
        assert rows.shape[0] == 2 and rows.data_ptr() == whole[1].data_ptr()
        rows.fill_(7.0)
        assert (whole[1:3] == 7).all() and (whole[0] == 0).all() and (whole[3] == 0).all()
    with pytest.raises(ValueError, match="separate CUDA streams"):
        make_steps(model, caches, DecodeMode(mla, "torch"), torch.zeros(4, dtype=torch.long), 2, False,
                   compile=True, split=2)


@pytest.mark.parametrize("label", list(VARIANTS))
def test_joined_projections_decode_the_same_tokens_and_caches(label):
    """Transformer.join_projections (q/k/v, MLA's two input projections, SwiGLU's gate and up as one GEMM
    each) keeps the parameter count and decodes what the separate projections decode, in every layout."""
    cfg, model, mla = tiny_model(label, **{"model.qkv_bias": True} if label == "gqa" else {})
    mode = DecodeMode(mla, "torch")
    plain, c_plain = _run(GraphSteps, model, cfg, mode, 3, 9, 12, capture=False)
    n = model.num_params()
    joined = model.join_projections()
    assert joined == 2 * cfg.n_layers and model.num_params() == n
    assert model.join_projections() == 0  # already joined
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    assert names & {"wqkv", "w_in"} and "w13" in names and not names & {"wq", "wk", "wv", "wkv_a", "w1", "w3"}
    same, c_same = _run(GraphSteps, model, cfg, mode, 3, 9, 12, capture=False)
    assert torch.equal(same, plain)
    for a, b in zip(c_plain.buffers(), c_same.buffers()):
        torch.testing.assert_close(a, b)
