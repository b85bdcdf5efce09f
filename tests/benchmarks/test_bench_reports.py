"""What the README's tables are printed from: benchmarks/report.py's default-path table, and bench_ops's
per-contender dispatch mode and kernel tuning, and the --tuning parser, all without a GPU."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench_module():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        yield lambda name: __import__(name)
    finally:
        sys.path.pop(0)


def _row(op, m, k, n, **ms):
    return {"op": op, "M": m, "K": k, "N": n, "contenders": {name: {"ms": t} for name, t in ms.items()}}


def test_default_path_table_uses_the_chosen_paths_own_time(bench_module, capsys):
    report = bench_module("report")
    bench = {"results": [
        _row("GEMM+RS", 8192, 8192, 28672, gemm=1.0, nccl_seq=2.0, asynctp=1.5, fused_nocomm=1.1, fused=1.8,
             fused_copy=1.4),
        _row("GEMM+RS", 4096, 49152, 12288, gemm=1.0, nccl_seq=1.2, asynctp=1.1, fused_nocomm=1.2, fused=1.3),
        _row("GEMM+RS", 4096, 12288, 49152, gemm=1.0, nccl_seq=2.0, asynctp=1.5, fused_nocomm=1.1, fused=1.6,
             fused_copy=1.7, fused_split=1.2),
        _row("AG+GEMM", 4096, 8192, 8192, gemm=0.2, nccl_seq=0.4, asynctp=0.3, fused_nocomm=0.2, fused=0.25),
        _row("GEMM+RS", 1024, 8192, 8192, gemm=0.05, nccl_seq=0.1, asynctp=0.1, fused_nocomm=0.06, fused=0.09),
        _row("GEMM+RS", 8192, 12288, 49152, gemm=1.0, nccl_seq=2.0, asynctp=1.5, fused_nocomm=1.1, fused=1.6,
             fused_split=1.2, fused_split2=1.1, split_nocomm=1.05, split2_nocomm=1.02),
    ]}
    table = {"entries": [
        {"op": "matmul_reduce_scatter", "m": 8192, "k": 8192, "n": 28672, "choice": "fused_copy"},
        {"op": "matmul_reduce_scatter", "m": 4096, "k": 49152, "n": 12288, "choice": "sequential"},
        {"op": "matmul_reduce_scatter", "m": 4096, "k": 12288, "n": 49152, "choice": "fused_split"},
        {"op": "all_gather_matmul", "m": 4096, "k": 8192, "n": 8192, "choice": "fused"},
        {"op": "matmul_reduce_scatter", "m": 1024, "k": 8192, "n": 8192, "choice": "fused_copy"},
        {"op": "matmul_reduce_scatter", "m": 8192, "k": 12288, "n": 49152, "choice": "fused_split", "split_config": 2},
    ]}
    report.fused_table(bench, table)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| GEMM") or
            line.startswith("| AG")]
    assert len(rows) == 6
    # fused_copy chosen: its own time (1.4 ms) gives E 0.60, 1.43x sequential, 1.07x async-TP; communication off is
    # the same kernel's (1.1 / 1.0)
    assert rows[0][14:18] == ["fused_copy", "0.60", "1.43x", "1.07x"] and rows[0][18].startswith("1.100")
    # sequential chosen: NCCL-sequential's time, E 0
    assert rows[1][14:17] == ["sequential", "0.00", "1.00x"]
    # fused_split chosen: its own time (1.2 ms): E 0.80, 1.67x sequential, 1.25x async-TP
    assert rows[2][10] == "1.200" and rows[2][14:18] == ["fused_split", "0.80", "1.67x", "1.25x"]
    assert rows[3][14:17] == ["fused", "0.75", "1.60x"]
    # a path this run did not time is said, not filled in with another path's time
    assert rows[4][14] == "fused_copy (not timed here)" and rows[4][15] == "-"
    # the split transport in the configuration the table keeps (2): fused_split2's time, and split2_nocomm's
    assert rows[5][14:18] == ["fused_split (2)", "0.90", "1.82x", "1.36x"] and rows[5][18].startswith("1.020")


def test_contender_settings_set_and_restore_each_contenders_dispatch_and_tuning(bench_module):
    settings = pytest.importorskip("fluxinductor.settings", reason="the settings module is not here")
    op_contenders = bench_module("op_contenders")
    with settings.override(dispatch="decomposed"):
        push, split_config = settings.tuning.gemm_rs_push, settings.tuning.gemm_rs_split_config
        with op_contenders.contender_settings("fused_copy"):
            assert settings.current.dispatch == "fused" and settings.tuning.gemm_rs_push == "copy"
        assert settings.current.dispatch == "decomposed" and settings.tuning.gemm_rs_push == push
        with op_contenders.contender_settings("fused_split2"):
            assert settings.tuning.gemm_rs_push == "split" and settings.tuning.gemm_rs_split_config == 2
        assert settings.tuning.gemm_rs_split_config == split_config
        with op_contenders.contender_settings("auto"):
            assert settings.current.dispatch == "auto" and settings.tuning.gemm_rs_push == push
        with op_contenders.contender_settings(None):
            assert settings.current.dispatch == "decomposed"
        # a contender's settings are restored when its call raises
        with pytest.raises(RuntimeError):
            with op_contenders.contender_settings("fused_copy"):
                raise RuntimeError("the kernel refused")
        assert settings.current.dispatch == "decomposed" and settings.tuning.gemm_rs_push == push


def test_parse_tuning(bench_module):
    harness = bench_module("harness")
    assert harness.parse_tuning("ag_variant=5, gemm_rs_push=copy,asynctp=true") == {
        "ag_variant": "5", "gemm_rs_push": "copy", "asynctp": "true"}
    assert harness.parse_tuning(None) == {} and harness.parse_tuning("") == {}
    with pytest.raises(ValueError, match="not key=value"):
        harness.parse_tuning("ag_variant")
