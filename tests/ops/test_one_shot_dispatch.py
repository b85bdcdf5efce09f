"""matmul_all_reduce's choice of path (fluxinductor/ops.py ``_all_reduce_plan``): one-shot, split or sequential, on
CPU with the GPU-only pieces replaced by fakes (the NVLink check and the one-shot kernel's eligibility, the split veto,
the measured choice).  The one-shot kernel itself: tests/gpu/test_one_shot.py.

* CPU tensors and the decomposed dispatch never take the one-shot path; the split and sequential paths are as before
  (the op's numerics over gloo: tests/ops/test_ops.py);
* ``fused``: one-shot for small outputs (or where the split cannot run), the split above;
* ``auto``: the measured choice among the candidates that can run (split only where not vetoed), asked once per call
  signature; without ``calibration.choose_measured`` the ``fused`` size rule; under CUDA graph capture only a
  remembered plan, else sequential;
* the kernel module's eligibility reasons on CPU (no extension, no CUDA tensors, dtypes, N).
"""

from __future__ import annotations

import pytest
import torch

from fluxinductor import dispatch, ops
from fluxinductor.kernels import one_shot, symm

GROUP = "fake-group"


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    ops.clear_plans()
    monkeypatch.setattr(ops, "_group", lambda name: object())
    yield
    ops.clear_plans()


def _plan(rows=8, k=64, n=8192, world=2, dtype=torch.bfloat16, bias=False):
    a = torch.zeros(rows, k, dtype=dtype)
    w = torch.zeros(k, n, dtype=dtype)
    b = torch.zeros(n, dtype=dtype) if bias else None
    return ops._all_reduce_plan(a, a, w, b, "sum", GROUP, None, world, rows)


def _one_shot_eligible(monkeypatch, veto=None):
    monkeypatch.setattr(ops, "_one_shot_reason", lambda *args: None)
    monkeypatch.setattr(dispatch, "split_all_reduce_veto", lambda a, w, world: veto)


def test_cpu_and_decomposed_never_take_the_one_shot_path(flux_settings):
    a, w = torch.zeros(3, 8), torch.zeros(8, 16)
    flux_settings(dispatch="fused")
    assert ops._one_shot_reason(a, w, None, "sum", GROUP, None, "fused") == "cpu tensors have no one-shot all-reduce"
    assert ops._one_shot_reason(a, w, None, "sum", GROUP, None, "decomposed") == "FLUXINDUCTOR_DISPATCH=decomposed"
    assert _plan(rows=4, n=16, dtype=torch.float32) == ("split", None)  # as before: the dispatcher declines on CPU
    assert _plan(rows=3, n=16, dtype=torch.float32) == ("sequential", "3 rows do not split over 2 ranks")


@pytest.mark.parametrize("rows,world,expected", [
    (8, 2, "oneshot"),      # 128 KiB
    (256, 2, "oneshot"),    # 4 MiB of bf16 read from one peer
    (512, 2, "split"),      # 8 MiB
    (256, 8, "split"),      # 7 peers x 4 MiB
    (32, 8, "oneshot"),     # 7 peers x 512 KiB
    (513, 2, "oneshot"),    # large, but the rows do not split: one-shot rather than sequential
])
def test_fused_takes_the_one_shot_path_for_small_outputs(flux_settings, monkeypatch, rows, world, expected):
    flux_settings(dispatch="fused")
    _one_shot_eligible(monkeypatch)
    assert _plan(rows=rows, world=world)[0] == expected


def test_fused_without_the_one_shot_kernel_keeps_the_old_paths(flux_settings, monkeypatch):
    flux_settings(dispatch="fused")
    monkeypatch.setattr(ops, "_one_shot_reason", lambda *args: "no NVLink between the group's GPUs")
    monkeypatch.setattr(dispatch, "split_all_reduce_veto", lambda a, w, world: None)
    assert _plan(rows=8) == ("split", None)
    assert _plan(rows=7) == ("sequential", "7 rows do not split over 2 ranks")


def test_auto_without_calibration_uses_the_size_rule(flux_settings, monkeypatch):
    flux_settings(dispatch="auto")
    _one_shot_eligible(monkeypatch, veto="the added all-gather costs more")
    monkeypatch.setattr(ops, "_choose_measured", lambda: None)
    assert _plan(rows=64) == ("oneshot", None)
    assert _plan(rows=1024) == ("sequential", "the added all-gather costs more")


def test_auto_measures_once_per_signature_with_the_candidates_that_can_run(flux_settings, monkeypatch):
    flux_settings(dispatch="auto")
    asked = []

    def choose(**kwargs):
        asked.append(kwargs)
        return "oneshot", "measured"

    monkeypatch.setattr(ops, "_choose_measured", lambda: choose)
    _one_shot_eligible(monkeypatch, veto="vetoed")
    assert _plan(rows=64, k=7168) == ("oneshot", None)
    assert _plan(rows=64, k=7168) == ("oneshot", None)  # remembered: measured once
    (call,) = asked
    assert {k: call[k] for k in ("op", "group_name", "world", "m", "k", "n", "dtype")} == {
        "op": "matmul_all_reduce", "group_name": GROUP, "world": 2, "m": 64, "k": 14336, "n": 8192,
        "dtype": torch.bfloat16}
    assert list(call["candidates"]) == ["sequential", "oneshot"]  # vetoed: no split candidate
    assert all(callable(fn) for fn in call["candidates"].values())

    _one_shot_eligible(monkeypatch, veto=None)
    assert _plan(rows=128)[0] == "oneshot"
    assert list(asked[-1]["candidates"]) == ["sequential", "oneshot", "split"]


@pytest.mark.parametrize("answer,expected", [
    ("sequential", ("sequential", "measured: times")),
    ("split", ("split", None)),
    ("nonsense", ("sequential", "calibration chose 'nonsense', not one of ['oneshot', 'sequential', 'split']")),
])
def test_auto_follows_the_measured_choice(flux_settings, monkeypatch, answer, expected):
    flux_settings(dispatch="auto")
    monkeypatch.setattr(ops, "_choose_measured", lambda: lambda **kwargs: (answer, "times"))
    _one_shot_eligible(monkeypatch)
    assert _plan(rows=64) == expected


def test_capture_reuses_the_eager_plan_and_never_measures(flux_settings, monkeypatch):
    flux_settings(dispatch="auto")
    calls = []
    monkeypatch.setattr(ops, "_choose_measured", lambda: lambda **kwargs: calls.append(1) or ("oneshot", ""))
    _one_shot_eligible(monkeypatch)
    monkeypatch.setattr(symm, "capturing", lambda: True)
    assert _plan(rows=64) == ("sequential", "CUDA graph capture before an eager call measured the paths of this call")
    assert calls == [] and ops._all_reduce_plans == {}  # nothing remembered from a capture
    monkeypatch.setattr(symm, "capturing", lambda: False)
    assert _plan(rows=64) == ("oneshot", None)
    monkeypatch.setattr(symm, "capturing", lambda: True)
    assert _plan(rows=64) == ("oneshot", None)
    assert calls == [1]
    # A remembered one-shot plan the capture cannot run (e.g. the buffer is too small) runs sequential.
    monkeypatch.setattr(ops, "_one_shot_reason", lambda *args: "CUDA graph capture before an eager call of this size")
    assert _plan(rows=64) == ("sequential", "CUDA graph capture before an eager call of this size")


def test_capture_runs_a_sequential_plan_on_the_one_shot_kernel_where_it_can(flux_settings, monkeypatch):
    # The sequential path costs ~1 ms more per call inside a captured graph: a captured call whose eager plan is
    # sequential takes the one-shot kernel where it can run and the output is small; eager calls keep the plan.
    flux_settings(dispatch="auto")
    monkeypatch.setattr(ops, "_choose_measured", lambda: lambda **kwargs: ("sequential", "a tie"))
    _one_shot_eligible(monkeypatch)
    assert _plan(rows=32) == ("sequential", "measured: a tie")
    assert _plan(rows=1024) == ("sequential", "measured: a tie")  # 16 MiB: more than the one-shot path takes
    monkeypatch.setattr(symm, "capturing", lambda: True)
    assert _plan(rows=32) == ("oneshot", None)
    assert _plan(rows=1024) == ("sequential", "measured: a tie")
    monkeypatch.setattr(ops, "_one_shot_reason", lambda *args: "CUDA graph capture before an eager call of this size")
    assert _plan(rows=32) == ("sequential", "measured: a tie")
    monkeypatch.setattr(symm, "capturing", lambda: False)
    _one_shot_eligible(monkeypatch)
    assert _plan(rows=32) == ("sequential", "measured: a tie")  # eager: the measured plan
    flux_settings(dispatch="decomposed")
    monkeypatch.setattr(symm, "capturing", lambda: True)
    assert ops._captured_one_shot(torch.zeros(32, 64), torch.zeros(64, 8192), None, "sum", GROUP, None,
                                  "decomposed", 2, 32) is False


def test_kernel_module_reasons_on_cpu(monkeypatch):
    a, w = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    reason = one_shot.unsupported_reason(a, w, None, "sum", GROUP)
    assert isinstance(reason, str) and reason  # no extension here, or CPU tensors
    monkeypatch.setattr(one_shot, "_extension", lambda: object())
    assert one_shot.unsupported_reason(a, w, None, "sum", GROUP) == "tensors are not on a CUDA device"
    assert one_shot.shape_reason(8192, torch.bfloat16) is None
    assert one_shot.shape_reason(8200, torch.bfloat16) is None
    assert "multiple of 16" in one_shot.shape_reason(4100, torch.bfloat16)
    assert one_shot.shape_reason(4100, torch.float32) is None
    assert "takes bf16, fp16 or fp32" in one_shot.shape_reason(8192, torch.int32)
    assert one_shot.shape_reason(8192, torch.bfloat16, torch.float32) is None
    assert "writes" in one_shot.shape_reason(8192, torch.float32, torch.bfloat16)
    assert one_shot.small_enough(256, 8192, torch.bfloat16, 2) and not one_shot.small_enough(257, 8192,
                                                                                            torch.bfloat16, 2)
