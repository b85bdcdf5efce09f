"""The dispatcher's async-TP path: bias handling and what it returns, with PyTorch's ops replaced by fakes
(the real ops need CUDA and symmetric memory; benchmarks/bench_ops.py's ``auto`` contender runs them)."""

from __future__ import annotations

import pytest
import torch

from fluxinductor import dispatch


@pytest.fixture
def fake_asynctp(monkeypatch):
    calls = []

    def fake_ag(shard, weights, gather_dim, group_name, *, return_A=True):
        calls.append(("ag", gather_dim, group_name, return_A))
        full = torch.cat([shard, shard], dim=gather_dim)  # as if both of 2 ranks held this shard
        return (full if return_A else None), [full @ w for w in weights]

    def fake_rs(a, weight, reduce_op, scatter_dim, group_name):
        calls.append(("rs", reduce_op, scatter_dim, group_name))
        partial = a @ weight  # both of 2 ranks hold the same partial; rank 0 keeps the first half
        total = 2 * partial if reduce_op == "sum" else partial
        return total.narrow(scatter_dim, 0, a.shape[scatter_dim] // 2)

    monkeypatch.setattr(dispatch, "_asynctp_ops", lambda: (fake_ag, fake_rs))
    monkeypatch.setattr(dispatch, "_asynctp_group", lambda name: None)
    return calls


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_asynctp_reduce_scatter_adds_the_bias_as_every_rank_would(fake_asynctp, reduce_op):
    torch.manual_seed(0)
    a, w, bias = torch.randn(8, 5), torch.randn(5, 6), torch.randn(6)
    out = dispatch._asynctp_matmul_reduce_scatter(a, w, bias, reduce_op, 0, "g", 2)
    per_rank = a @ w + bias  # the reference: each of 2 ranks adds the bias, then the reduction
    ref = (2 * per_rank if reduce_op == "sum" else per_rank)[:4]
    torch.testing.assert_close(out, ref)
    assert fake_asynctp == [("rs", reduce_op, 0, "g")]


@pytest.mark.parametrize("return_gathered", [True, False])
def test_asynctp_all_gather_matmul_biases_and_gathered_output(fake_asynctp, return_gathered):
    torch.manual_seed(1)
    shard = torch.randn(3, 4)
    weights, biases = [torch.randn(4, 5), torch.randn(4, 2)], [torch.randn(5), None]
    outs, gathered = dispatch._asynctp_all_gather_matmul(shard, weights, biases, 0, "g", return_gathered)
    full = torch.cat([shard, shard])
    torch.testing.assert_close(outs[0], full @ weights[0] + biases[0])
    torch.testing.assert_close(outs[1], full @ weights[1])
    if return_gathered:
        torch.testing.assert_close(gathered, full)
    else:
        assert gathered.numel() == 0
    assert fake_asynctp == [("ag", 0, "g", return_gathered)]


def test_asynctp_is_opt_in(flux_settings, monkeypatch):
    flux_settings(asynctp=False)
    assert dispatch._asynctp_ops() is None
    flux_settings(asynctp="0")
    assert dispatch._asynctp_ops() is None
    flux_settings(asynctp="1")
    assert dispatch._asynctp_ops() is dispatch._asynctp_registered()
