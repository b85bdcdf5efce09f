"""CPU smoke test of benchmarks/bench_ops.py: 2 gloo ranks under torchrun, tiny shapes, every output checked.

The GPU-only contenders (async-TP, the fused kernel, the kernel without communication) must be recorded
as unavailable with a reason, every measured contender must have positive times and a small error, the
tuning table it emits must be readable by the cost model, and the table must be the last thing printed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from fluxinductor import cost_model, tuning_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_ops.py")
MEASURED_ON_CPU = ("gemm", "comm", "nccl_seq", "auto")
UNAVAILABLE_ON_CPU = ("asynctp", "fused", "fused_copy", "fused_split", "fused_split2", "fused_nocomm", "split_nocomm",
                      "split2_nocomm")


def _run(tmp_path, world: int, extra=()):
    out = tmp_path / "ops_cpu"  # passed as ops_cpu.json, which names the JSON itself (harness.output_prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUXINDUCTOR_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLUXINDUCTOR_GIT_SHA="test-sha",
               FLUXINDUCTOR_TUNING_DIR=str(tmp_path / "tuning"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", SCRIPT,
           "--device", "cpu", "--quick", "--warmup", "1", "--iters", "3", "--out", str(out) + ".json",
           "--emit-tuning", str(tmp_path / "tuning" / "{device_key}_tp{world}.json"), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"bench_ops failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert not os.path.exists(str(out) + ".json.json")
    with open(str(out) + ".json") as f:
        return json.load(f), proc.stdout, out


def test_bench_ops_cpu_two_ranks(flux_settings, tmp_path, monkeypatch):
    data, stdout, out = _run(tmp_path, 2, ("--settle-s", "0.05"))

    env = data["environment"]
    for field in ("device", "world", "torch", "cuda", "nccl", "git_sha", "timestamp", "dtype", "timer", "iters"):
        assert field in env, field
    assert env["world"] == 2 and env["backend"] == "gloo" and env["timer"] == "perf_counter"
    assert env["git_sha"]  # from git, or FLUXINDUCTOR_GIT_SHA where there is no git
    assert data["complete"] is True

    # Only the first shape of the interleaved phase settles (auto runs alone, after it).
    assert env["settle_s"] == 0.05
    settled = data["results"][0]["settle"]
    assert settled["rounds"] >= 1 and settled["s"] >= 0.05 and "stopped" not in settled
    assert all("settle" not in r for r in data["results"][1:])
    assert "settled: " in stdout

    ops = {(r["op"], r["M"], r["K"], r["N"]) for r in data["results"]}
    assert len(ops) == 4 and {op for op, *_ in ops} == {"AG+GEMM", "GEMM+RS"}
    tol = data["tolerance"]
    for r in data["results"]:
        c = r["contenders"]
        assert set(c) == set(MEASURED_ON_CPU + UNAVAILABLE_ON_CPU)
        for name in MEASURED_ON_CPU:
            rec = c[name]
            assert rec["error"] is None, (name, rec["error"])
            assert rec["ms"] > 0 and len(rec["iter_ms"]) == 2 and all(len(t) == 3 for t in rec["iter_ms"])
            assert all(t > 0 for ranks in rec["iter_ms"] for t in ranks)
            assert rec["ms"] == pytest.approx(max(rec["rank_median_ms"]))
            assert 0 <= rec["rel_err"] <= tol and rec["rel_ok"] is True
        for name in UNAVAILABLE_ON_CPU:
            assert c[name]["ms"] is None and "unavailable" in c[name]["error"], (name, c[name])
        assert "fell back" in c["fused"]["error"]
        assert c["auto"]["path"].startswith("decomposed")
        assert r["E"]["auto"] is not None and r["speedup_vs_nccl_seq"]["auto"] > 0
        assert r["E"]["fused"] is None and r["speedup_vs_asynctp"]["auto"] is None

    # The table is printed last: its legend line ends stdout, and every result row is in it.
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith("E = 1 - (T - T_gemm)")
    table_rows = [ln for ln in lines if ln.startswith(("AG+GEMM", "GEMM+RS"))]
    assert len(table_rows) == 4

    # The emitted tuning table: one row per op and shape, never "fused" (nothing fused was measured).
    path = tmp_path / "tuning" / "cpu_tp2.json"
    table = cost_model.load_table(str(path))
    assert table["world"] == 2 and table["device_key"] == "cpu" and len(table["entries"]) == 4
    assert all(e["choice"] == "sequential" and e["sequential_ms"] > 0 for e in table["entries"])
    flux_settings(tuning_dir=str(tmp_path / "tuning"))
    choice, reason = cost_model.choose("all_gather_matmul", "cpu", 2, 64, 40, 48, "float32")
    assert choice == "sequential" and "unavailable" in reason

    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(str(out) + ".png") > 1000
    else:
        assert "plot skipped" in stdout


def test_bench_ops_cli_rejects_unknown_contender(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "x"), "--contenders", "nope"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown contender" in proc.stderr


def _bench_ops():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import bench_ops
    finally:
        sys.path.pop(0)
    return bench_ops


def test_split_columns_keep_the_faster_configuration_ties_by_k():
    """The tuning row's split transport: the configuration faster by more than the cost model's noise margin (one that
    failed its check or did not run is out); within the margin 2 (ping-pong) at short K per rank, 0 (cooperative)
    from SPLIT_SHORT_K on; both times stay in the row."""

    def columns(t0, t2, ok0=True, ok2=True, k_per_rank=None):
        c = {"fused_split": {"ms": t0, "rel_ok": ok0}, "fused_split2": {"ms": t2, "rel_ok": ok2}}

        def ok(name):
            return c[name]["rel_ok"] if c[name]["ms"] is not None else None

        return tuning_table.split_columns(c, ok, k_per_rank)

    assert columns(1.00, 0.97) == {"fused_split_ms": 0.97, "fused_split_ok": True, "split_config": 2,
                                   "fused_split_config_ms": {"0": 1.00, "2": 0.97}}
    assert columns(1.00, 0.995, k_per_rank=4096)["split_config"] == 2  # within the margin, short K: ping-pong
    assert columns(1.00, 1.005, k_per_rank=4096)["split_config"] == 2
    assert columns(1.00, 0.995, k_per_rank=14336)["split_config"] == 0  # within the margin, long K: cooperative
    assert columns(1.00, 0.995)["split_config"] == 0
    assert columns(1.00, 1.05, k_per_rank=4096)["split_config"] == 0
    assert columns(1.00, 0.90, ok2=False)["split_config"] == 0  # configuration 2 failed its check
    assert columns(None, 0.90, ok0=None)["split_config"] == 2  # 0 did not run
    # Only configuration 0 measured (older runs): no split_config in the row.
    assert tuning_table.split_columns({"fused_split": {"ms": 1.0, "rel_ok": True}},
                                   lambda name: True if name == "fused_split" else None) == {
        "fused_split_ms": 1.0, "fused_split_ok": True}


def test_parse_shapes():
    bench_ops = _bench_ops()
    default = bench_ops.DEFAULT_SHAPES
    assert bench_ops.parse_shapes(None, default) == default
    assert bench_ops.parse_shapes("*x8192x28672", default) == [
        (8192, 8192, 28672), (2048, 8192, 28672), (16384, 8192, 28672), (512, 8192, 28672), (3072, 8192, 28672)]
    assert bench_ops.parse_shapes("1024x8192x8192,6144x8192x28672", default) == [
        (1024, 8192, 8192), (6144, 8192, 28672)]
    assert (4096, 49152, 12288) in default and len(default) == 8


def test_parse_work_op_prefixes_and_flux_preset():
    bench_ops = _bench_ops()
    default = bench_ops.DEFAULT_SHAPES
    ops = ("ag_gemm", "gemm_rs")
    everything = bench_ops.parse_work(None, default, ops)
    assert everything == [(op, s) for op in ops for s in default]
    # a prefix restricts a shape to one op; output stays grouped by op, without duplicates
    assert bench_ops.parse_work("rs:1x2x3,5x6x7,ag:1x2x3,5x6x7", default, ops) == [
        ("ag_gemm", (5, 6, 7)), ("ag_gemm", (1, 2, 3)), ("gemm_rs", (1, 2, 3)), ("gemm_rs", (5, 6, 7))]
    assert bench_ops.parse_work("ag:*x8192x8192", default, ops) == [("ag_gemm", (1024, 8192, 8192))]
    flux = bench_ops.parse_work("flux", default, ops)
    assert len(flux) == 10
    assert ("ag_gemm", (4096, 12288, 49152)) in flux and ("gemm_rs", (4096, 49152, 12288)) in flux
    assert ("gemm_rs", (4096, 12288, 49152)) not in flux
    assert bench_ops.parse_work("flux", default, ("gemm_rs",)) == [p for p in flux if p[0] == "gemm_rs"]
    with pytest.raises(SystemExit):
        bench_ops.parse_work("xx:1x2x3", default, ops)


# ---------------------------------------------------------------------------------------------------
# measure(): the error paths a GPU run can hit, exercised on 2 gloo ranks with fake contenders.
# ---------------------------------------------------------------------------------------------------


class _FakeProblem:
    op = "ag_gemm"

    def __init__(self, rank: int):
        import torch

        self.rank = rank
        self.ref = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))

    def contender(self, name: str):
        import torch

        from fluxinductor.log import record_fallback

        ref = self.ref
        if name == "ok":
            return (lambda: ref.clone()), ref
        if name == "raises_on_rank1":
            def fn():
                if self.rank == 1:
                    raise RuntimeError("kernel refused")
                return ref.clone()
            return fn, ref
        if name == "wrong_shape":
            return (lambda: ref[:4].clone()), ref
        if name == "nan":
            return (lambda: torch.full_like(ref, float("nan"))), ref
        if name == "fused":  # a dispatch that ran the fused path: no fallback recorded
            return (lambda: ref + 1e-6), ref
        if name == "auto":  # a dispatch that fell back
            def fn():
                record_fallback("all_gather_matmul", "cost model: sequential")
                return ref.clone()
            return fn, ref
        raise ValueError(name)


def _measure_fake_contenders(rank, world, interleaved=False):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_ops
    import torch
    import torch.distributed as dist

    ctx = bench_ops.Ctx.__new__(bench_ops.Ctx)
    ctx.rank, ctx.world, ctx.local_rank = rank, world, rank
    ctx.is_cuda, ctx.device, ctx.dtype, ctx.backend = False, torch.device("cpu"), torch.float32, "gloo"
    ctx.group, ctx.group_name = dist.group.WORLD, dist.group.WORLD.group_name
    ctx.warmup, ctx.iters, ctx.b_layout, ctx.seed, ctx.broken = 1, 3, "t", 0, None
    problem = _FakeProblem(rank)
    if interleaved:
        records, settled = bench_ops.measure_interleaved(
            ctx, problem, ("ok", "raises_on_rank1", "wrong_shape", "nan", "fused", "auto"), rounds=2, settle_s=0.05)
        return {**records, "settled": settled}
    return {name: bench_ops.measure(ctx, problem, name)
            for name in ("ok", "raises_on_rank1", "wrong_shape", "nan", "fused", "auto", "ok")}


@pytest.mark.parametrize("interleaved", [False, True])
def test_measure_error_paths_on_two_ranks(interleaved):
    from _dist import run_ranks

    results = run_ranks(_measure_fake_contenders, 2, interleaved, timeout=120)
    for res in results:  # every rank returns the same agreed record
        ok = res["ok"]
        assert ok["error"] is None and ok["ms"] > 0 and ok["rel_err"] == 0.0
        assert len(ok["iter_ms"]) == 2 and len(ok["iter_ms"][0]) == 3
        assert res["raises_on_rank1"]["ms"] is None
        assert res["raises_on_rank1"]["error"].startswith("rank(s) [1]:")
        assert "kernel refused" in res["raises_on_rank1"]["error"]
        assert "output shape (4, 6), expected (8, 6)" in res["wrong_shape"]["error"]
        assert res["nan"]["rel_err"] == float("inf")
        assert res["fused"]["error"] is None and res["fused"]["path"] == "fused" and res["fused"]["ms"] > 0
        assert res["auto"]["error"] is None and res["auto"]["path"].startswith("decomposed: cost model")
        if interleaved:  # the contenders that passed their check ran untimed first, on every rank alike
            assert res["settled"]["rounds"] >= 1 and res["settled"]["s"] >= 0.05 and "stopped" not in res["settled"]
            assert res["settled"] == results[0]["settled"]


def test_round_sizes():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_ops

    assert bench_ops.round_sizes(20, 4) == [5, 5, 5, 5]
    assert bench_ops.round_sizes(3, 2) == [2, 1]
    assert bench_ops.round_sizes(2, 4) == [1, 1]      # never an empty round
    assert bench_ops.round_sizes(5, 0) == [5]


def test_bench_ops_cli_rejects_malformed_tuning(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "x"), "--tuning", "ag_variant"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "'ag_variant' is not key=value" in proc.stderr
