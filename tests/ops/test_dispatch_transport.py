"""The GEMM+RS transport the cost model picks reaches the kernel: ``fused_copy`` runs the fused kernel with
the copy-engine transport, ``fused`` with NVLink stores, and ``settings.tuning.gemm_rs_push`` still overrides both
(kernel module and cost model replaced by fakes: the real ones need Hopper GPUs)."""

from __future__ import annotations

import types

import pytest
import torch

from fluxinductor import dispatch


@pytest.fixture
def fake_kernels(flux_settings, monkeypatch):
    calls = []

    def matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, *, checked=False, transport="store",
                              split_config_choice=None, batch_rows=0, more=(), out_dtype=None):
        calls.append({"checked": checked, "transport": transport})
        if out_dtype is not None:
            calls[-1]["out_dtype"] = out_dtype
        if split_config_choice is not None:
            calls[-1]["split_config"] = split_config_choice
        if batch_rows:
            calls[-1]["batch_rows"] = batch_rows
        if more:
            calls[-1]["slabs"] = [tuple(w_i.shape) for _, w_i in more]
        full = (a2d @ weight + sum(a_i @ w_i for a_i, w_i in more)).to(out_dtype or a2d.dtype)
        if batch_rows:  # rank 0's block of every batch, as the kernel reads a batch-major operand
            return full.view(-1, 2, batch_rows, full.shape[-1])[:, 0].reshape(-1, full.shape[-1])
        return full[: a2d.shape[0] // dispatch._world_size(group_name)]

    from fluxinductor.kernels import gemm_rs

    module = types.SimpleNamespace(unsupported_reason=lambda *args: None, matmul_reduce_scatter=matmul_reduce_scatter,
                                   split_reason=gemm_rs.split_reason, split_configs=gemm_rs.split_configs,
                                   slabs_reason=gemm_rs.slabs_reason, batch_major_reason=gemm_rs.batch_major_reason)
    monkeypatch.setattr(dispatch, "_kernels_for", lambda op, operand: module)
    monkeypatch.setattr(dispatch, "_world_size", lambda group_name: 2)
    monkeypatch.setattr(dispatch, "_peers_reason", lambda group_name, device: None)  # tests/kernels/test_peers.py
    monkeypatch.setattr(dispatch, "_device_name", lambda index: "a device with no tuning table")
    flux_settings(dispatch="auto")
    return calls


@pytest.mark.parametrize("choice, transport", [("fused", "store"), ("fused_copy", "copy"), ("fused_split", "split")])
def test_cost_model_choice_picks_the_transport(fake_kernels, monkeypatch, choice, transport):
    seen = {}

    def says(op, device, world, m, k, n, dtype, fused_eligible=True, split_eligible=True, **_):
        seen["paths"] = dispatch.overlapped_paths(op, fused_eligible, split_eligible)
        return choice, f"cost model chose {choice}: test"

    monkeypatch.setattr(dispatch, "_cost_model_says", says)
    a, w = torch.randn(8, 4), torch.randn(8, 4).t()  # K-major, as a transposed nn.Linear weight
    out = dispatch.matmul_reduce_scatter(a, w, None, "sum", 0, "g")
    torch.testing.assert_close(out, (a @ w)[:4])
    assert fake_kernels == [{"checked": True, "transport": transport}]
    assert seen["paths"][:3] == ("fused", "fused_copy", "fused_split")


@pytest.mark.parametrize("choice", ["fused_split", "sequential"])
def test_sum_as_k_slabs_offers_only_the_split_transport(fake_kernels, monkeypatch, choice):
    """A sum of matmuls (``more_a``, ``more_weights``) is weighed on its concatenated K with the split transport the
    only fused path (its K slabs); where the cost model picks it the kernel gets every term, rows-first, else the
    call decomposes."""
    seen = {}

    def says(op, device, world, m, k, n, dtype, fused_eligible=True, split_eligible=True, slabs=False, **_):
        seen.update(k=k, slabs=slabs)
        return choice, f"cost model chose {choice}: test"

    monkeypatch.setattr(dispatch, "_cost_model_says", says)
    a, a2 = torch.randn(2, 4, 64), torch.randn(2, 4, 72)
    w, w2 = torch.randn(64, 16), torch.randn(72, 16)
    out = dispatch.matmul_reduce_scatter(a, w, None, "sum", 1, "g", more_a=[a2], more_weights=[w2])
    assert seen == {"k": 2 * (64 + 72), "slabs": True}
    if choice == "sequential":
        assert out is None and fake_kernels == []
        return
    full = a @ w + a2 @ w2
    torch.testing.assert_close(out, full[:, :2])
    assert fake_kernels == [{"checked": True, "transport": "split", "slabs": [(72, 16)]}]


@pytest.mark.parametrize("seq,contiguous", [(8, True), (2 * 128, True), (2 * 128, False)])
def test_batch_major_sum_as_k_slabs(fake_kernels, monkeypatch, seq, contiguous):
    """A sum of matmuls over [B, S, K_i] operands scattered on S with B > 1: where each rank's blocks are whole 128-row
    tiles (S = 256 at world 2) and every operand is contiguous, every term goes to the kernel batch-major, as it is (no
    permute, the result [B, S/w, N] straight from the kernel); otherwise every term rows-first."""
    monkeypatch.setattr(dispatch, "_cost_model_says", lambda *a, **k: ("fused_split", "cost model chose fused_split"))
    a = torch.randn(2, seq, 64)
    a2 = torch.randn(2, seq, 72) if contiguous else torch.randn(seq, 2, 72).transpose(0, 1)
    w, w2 = torch.randn(64, 16), torch.randn(72, 16)
    out = dispatch.matmul_reduce_scatter(a, w, None, "sum", 1, "g", more_a=[a2], more_weights=[w2])
    full = a @ w + a2 @ w2
    torch.testing.assert_close(out, full[:, :seq // 2])
    call = {"checked": True, "transport": "split", "slabs": [(72, 16)]}
    if seq == 256 and contiguous:
        call["batch_rows"] = seq // 2
    assert fake_kernels == [call]


@pytest.mark.parametrize("world,n_major,eligible", [(2, True, True), (2, False, False), (4, True, False)])
def test_fp32_result_offers_the_split_transport_where_it_writes_fp32(fake_kernels, monkeypatch, world, n_major,
                                                                      eligible):
    """Autocast's fp32 reduction of bf16 partials: the split transport is offered at two ranks with an N-major weight
    (the backward's grad @ W), where its own GEMM stores fp32; elsewhere it writes bf16 only and is not offered.  A sum
    of such terms goes to the split transport's K slabs there and decomposes elsewhere."""
    seen = []

    def says(op, device, world, m, k, n, dtype, fused_eligible=True, split_eligible=True, slabs=False, **_):
        seen.append((split_eligible, slabs))
        return ("fused_split" if split_eligible else "fused_copy"), "test"

    monkeypatch.setattr(dispatch, "_cost_model_says", says)
    monkeypatch.setattr(dispatch, "_world_size", lambda group_name: world)
    a = torch.randn(8 * world, 64, dtype=torch.bfloat16)
    w = torch.randn(64, 16, dtype=torch.bfloat16) if n_major else torch.randn(16, 64, dtype=torch.bfloat16).t()
    dispatch.matmul_reduce_scatter(a, w, None, "sum", 0, "g", torch.float32)
    assert seen == [(eligible, False)]
    assert fake_kernels[-1]["transport"] == ("split" if eligible else "copy")
    assert fake_kernels[-1]["out_dtype"] == torch.float32
    a2, w2 = torch.randn(8 * world, 72, dtype=torch.bfloat16), torch.randn(72, 16, dtype=torch.bfloat16)
    if not n_major:
        w2 = torch.randn(16, 72, dtype=torch.bfloat16).t()
    calls = len(fake_kernels)
    out = dispatch.matmul_reduce_scatter(a, w, None, "sum", 0, "g", torch.float32, more_a=[a2], more_weights=[w2])
    if eligible:
        assert fake_kernels[calls:] == [{"checked": True, "transport": "split", "out_dtype": torch.float32,
                                         "slabs": [(72, 16)]}]
        assert out.dtype == torch.float32
    else:
        assert out is None and len(fake_kernels) == calls


def test_sum_not_slab_shaped_decomposes(fake_kernels, monkeypatch):
    """Terms the split GEMMs cannot take as K slabs (a first K not a multiple of 64) decompose without asking the cost
    model."""
    monkeypatch.setattr(dispatch, "_cost_model_says", lambda *a, **k: pytest.fail("the cost model was asked"))
    a, a2 = torch.randn(8, 72), torch.randn(8, 64)
    out = dispatch.matmul_reduce_scatter(a, torch.randn(72, 16), None, "sum", 0, "g", more_a=[a2],
                                         more_weights=[torch.randn(64, 16)])
    assert out is None and fake_kernels == []


@pytest.fixture
def rs_table(flux_settings, tmp_path, monkeypatch):
    """A measured table in which the split transport wins one GEMM+RS shape and the other transports lose to
    NCCL-then-cuBLAS there (as 4096x57344x8192 in the packaged TP=2 table), on a device named as the table's."""
    from fluxinductor import cost_model

    rows = [dict(op="matmul_reduce_scatter", m=64, k=64, n=n, fused_ms=2.89, fused_copy_ms=2.85, fused_split_ms=2.50,
                 sequential_ms=2.64) for n in (8, 12)]
    flux_settings(tuning_dir=str(tmp_path))
    cost_model.clear_cache()
    table = cost_model.make_table("NVIDIA H200", 2, torch.float32, rows, source={"test": True})
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp2.json"), table, merge=False)
    monkeypatch.setattr(dispatch, "_device_name", lambda index: "NVIDIA H200")
    yield
    cost_model.clear_cache()


def test_split_is_offered_only_for_calls_it_takes(fake_kernels, rs_table):
    """The forward's x @ W.t() (K-major weight) and the backward's grad @ W (N-major) both take the split transport
    where it measured fastest.  A call it cannot take (N not a multiple of 8) has the cost model choose among the
    other paths (here NCCL-then-cuBLAS, which both beat), instead of the kernel falling back to the copy transport
    where that loses."""
    a = torch.randn(64, 32)
    for weight in (torch.randn(8, 32).t(), torch.randn(32, 8)):
        out = dispatch.matmul_reduce_scatter(a, weight, None, "sum", 0, "g")
        torch.testing.assert_close(out, (a @ weight)[:32])
    assert fake_kernels == [{"checked": True, "transport": "split"}] * 2
    assert dispatch.matmul_reduce_scatter(a, torch.randn(32, 12), None, "sum", 0, "g") is None  # sequential
    assert len(fake_kernels) == 2
    assert dispatch.overlapped_paths("matmul_reduce_scatter", split_eligible=False) == ("fused", "fused_copy")
    assert dispatch.overlapped_paths("all_gather_matmul", split_eligible=False) == ("fused",)


def test_stores_and_split_transports_under_capture(flux_settings, monkeypatch):
    """Under CUDA graph capture the cost model chooses between the fused kernel with NVLink stores, for GEMM+RS the
    split transport where it can take the call (the transports a replay can repeat), and the decomposition (not the
    copy transport, nor async-TP)."""
    from fluxinductor.kernels import symm

    flux_settings(asynctp="1")
    monkeypatch.setattr(dispatch, "_asynctp_registered", lambda: ("ag", "rs"))
    monkeypatch.setattr(symm, "capturing", lambda: True)
    assert dispatch.overlapped_paths("matmul_reduce_scatter") == ("fused", "fused_split")
    assert dispatch.overlapped_paths("matmul_reduce_scatter", split_eligible=False) == ("fused",)
    assert dispatch.overlapped_paths("all_gather_matmul") == ("fused",)
    assert dispatch.overlapped_paths("matmul_reduce_scatter", fused_eligible=False) == ()


def test_sequential_choice_runs_no_kernel(fake_kernels, monkeypatch):
    monkeypatch.setattr(dispatch, "_cost_model_says", lambda *a, **k: ("sequential", "cost model chose sequential"))
    assert dispatch.matmul_reduce_scatter(torch.randn(8, 4), torch.randn(4, 6), None, "sum", 0, "g") is None
    assert fake_kernels == []


def test_tuning_overrides_the_transport(flux_settings):
    from fluxinductor.kernels import gemm_rs

    assert gemm_rs.push_mode() == "store" and gemm_rs.push_mode("copy") == "copy"
    flux_settings(gemm_rs_push="store")
    assert gemm_rs.push_mode("copy") == "store"
    flux_settings(gemm_rs_push="copy")
    assert gemm_rs.push_mode("store") == "copy"
    with pytest.raises(ValueError, match=r"gemm_rs_push='pigeon': expected one of store, copy, split"):
        flux_settings(gemm_rs_push="pigeon")
    assert gemm_rs.push_mode("store") == "copy"


def test_split_reason():
    """The split transport takes two or more ranks, a weight with a contiguous dim (K-major as in the forward, N-major
    as in the backward's grad @ W) and N a multiple of 8; anything else gets a reason (and the kernel module runs the
    copy transport instead)."""
    from fluxinductor.kernels import gemm_rs

    k_major = torch.randn(64, 32).t()  # [K=32, N=64] view of a Linear weight
    assert gemm_rs.split_reason(2, k_major, None) is None
    assert gemm_rs.split_reason(2, k_major, torch.zeros(64)) is None
    assert gemm_rs.split_reason(4, k_major, None) is None
    assert "2 or more ranks" in gemm_rs.split_reason(1, k_major, None)
    assert gemm_rs.split_reason(2, torch.randn(32, 64), None) is None  # N-major
    assert "contiguous" in gemm_rs.split_reason(2, torch.randn(32, 128)[:, ::2], None)
    assert "multiple of 8" in gemm_rs.split_reason(2, torch.randn(60, 32).t(), None)
    assert "aligned" in gemm_rs.split_reason(2, k_major, torch.zeros(65)[1:])
    assert "out" in gemm_rs.split_reason(2, k_major, None, torch.zeros(8, 72, dtype=torch.bfloat16)[:, 4:68])


def test_captured_split_needs_an_eager_call_of_its_size():
    """A call under CUDA graph capture runs the split transport only where an eager split call has grown the outbox
    to the call's [M, N] (a capture may not allocate it) and the split transport can take the call at all."""
    from types import SimpleNamespace

    from fluxinductor.kernels import gemm_rs

    a, weight = torch.randn(64, 32), torch.randn(32, 16)
    out = torch.empty(32, 16)
    state = SimpleNamespace(world=2, copy=None)
    assert "no eager split call" in gemm_rs.captured_split_reason(state, a, weight, None, out)
    state.copy = SimpleNamespace(outbox=torch.empty(64 * 16 * 4 - 1, dtype=torch.uint8))
    assert "no eager split call" in gemm_rs.captured_split_reason(state, a, weight, None, out)
    state.copy.outbox = torch.empty(64 * 16 * 4, dtype=torch.uint8)
    assert gemm_rs.captured_split_reason(state, a, weight, None, out) is None
    assert "multiple of 8" in gemm_rs.captured_split_reason(state, a, torch.randn(32, 12), None, torch.empty(32, 12))


def test_ag_k_chunk_bounds_and_choice(flux_settings):
    """AG+GEMM's column blocks (the kernel's ceil(K tiles / blocks) split) and when one-wave problems use them
    (``settings.tuning.ag_k_chunks``, default 4; 1 turns it off)."""
    from fluxinductor.kernels import ag_gemm

    flux_settings(ag_k_chunks=1)
    assert ag_gemm.use_k_chunks(1024, 4096, 132, 8 << 20) == 1  # off: row chunks even for one wave
    flux_settings(ag_k_chunks=4)
    assert ag_gemm.k_chunk_bounds(264, 3) == [(0, 128), (128, 256), (256, 264)]
    assert ag_gemm.k_chunk_bounds(128, 4) == [(0, 64), (64, 128), (128, 128), (128, 128)]
    mb = 1 << 20
    assert ag_gemm.use_k_chunks(1024, 4096, 132, 8 * mb) == 4                          # 128 tiles: one wave
    assert ag_gemm.use_k_chunks(2048, 4096, 132, 8 * mb) == 1                          # two waves: row chunks
    assert ag_gemm.use_k_chunks(1024, 4096, 132, 2 * mb) == 2                          # blocks of >= 1 MB
    assert ag_gemm.use_k_chunks(258, 512, 132, 129 * 2048) == 1                        # too small to split


def test_transport_notes_are_logged_once_and_are_not_fallbacks(caplog):
    """A GEMM+RS call that takes another transport than the one asked for still runs the fused kernel: it is logged
    once, not counted as a fallback (rewrite_stats' fallbacks are calls that did not run the kernel)."""
    import logging

    from fluxinductor import log

    before = log.rewrite_stats()["fallbacks"]
    message = "matmul_reduce_scatter runs the copy transport instead of split: test reason"
    with caplog.at_level(logging.INFO, logger="fluxinductor"):
        log.note_once(message)
        log.note_once(message)
    assert [r.getMessage() for r in caplog.records].count(message) == 1
    assert log.rewrite_stats()["fallbacks"] == before


def test_split_config_from_the_table_reaches_the_kernel(flux_settings, fake_kernels, tmp_path, monkeypatch):
    """A table row that recorded the split GEMMs' faster configuration (split_config) hands it to the kernel for
    its shape and the shapes nearest it (above the measured Ms too, when calibration is off); rows without one
    (older tables) leave the kernel's default."""
    from fluxinductor import cost_model

    rows = [dict(op="matmul_reduce_scatter", m=m, k=64, n=8, fused_ms=2.9, fused_split_ms=2.5, sequential_ms=2.6,
                 split_config=config) for m, config in ((64, 0), (256, 2))]
    rows.append(dict(op="matmul_reduce_scatter", m=64, k=64, n=16, fused_ms=2.9, fused_split_ms=2.5, sequential_ms=2.6))
    flux_settings(tuning_dir=str(tmp_path), calibrate=False)
    cost_model.clear_cache()
    table = cost_model.make_table("NVIDIA H200", 2, torch.float32, rows, source={"test": True})
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp2.json"), table, merge=False)
    monkeypatch.setattr(dispatch, "_device_name", lambda index: "NVIDIA H200")
    try:
        for m_rows, expected in ((64, 0), (256, 2), (512, 2), (96, 0)):
            a = torch.randn(m_rows, 32)
            dispatch.matmul_reduce_scatter(a, torch.randn(32, 8), None, "sum", 0, "g")
            assert fake_kernels[-1] == {"checked": True, "transport": "split", "split_config": expected}, m_rows
        # The N=16 row has no configuration: the nearest-flops rule finds the N=8 rows (N within a factor 2).
        assert cost_model.split_config_from_table(table, 64, 64, 16) == 0
        assert cost_model.split_config_from_table(table, 64, 4096, 4096) is None  # nothing near
        assert cost_model.split_config("NVIDIA H100", 2, 64, 64, 8, torch.float32) is None  # no table
    finally:
        cost_model.clear_cache()
