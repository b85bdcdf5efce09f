"""CPU smoke test of benchmarks/bench_model.py: 2 gloo ranks under torchrun, tiny configs, fp32.

Runs (each a subprocess with a hard timeout; compile time on 2 cores dominates):

1. the sequence-parallel MLP, every mode (nocomm included), forward and forward+backward, with one mode made to
   fail on every rank (``BENCH_MODEL_INJECT_ERROR``): the failure is recorded and the other modes still run;
2. a decode-style step (plain TP, one Llama layer, one position of 8 sequences, forward, reduce-overhead) of
   inductor, async-TP, flux and nocomm in 3 rounds: the rounds rotate the modes' order, G is reported against the
   no-communication replica, the times are host exposed;
3. one Llama-style decoder layer, forward+backward, eager and ``backend="flux"`` (and plain TP, autocast, compile
   mode variants).

Checked: the JSON's fields, positive per-rank per-step times in every round, nothing compiled while timed, flux
fused counts while compiling the forward and the backward (flux_fused's own: it has compiled code of its own),
every error against eager small, and the table printed last.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_model.py")
AG_MM, MM_RS = "all_gather_matmul", "matmul_reduce_scatter"
FP32_ERROR = 1e-4
TIMEOUT_S = 400  # compile-bound; generous so a loaded 2-core machine does not fail it


def _run(tmp_path, name: str, args, inject: str = ""):
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLUXINDUCTOR_", "TORCHELASTIC_", "BENCH_MODEL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLUXINDUCTOR_GIT_SHA="test-sha",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
               # Scalar C++ kernels compile ~4x faster; the test is about the benchmark, not codegen.
               TORCHINDUCTOR_VEC_ISA_OK="0")
    if inject:
        env["BENCH_MODEL_INJECT_ERROR"] = inject
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT,
           "--device", "cpu", "--quick", "--out", str(out), "--contender-timeout", "300", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"bench_model failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(str(out) + ".json") as f:
        return json.load(f), proc.stdout


def _check_common(data: dict, stdout: str, n_rows: int) -> None:
    env = data["environment"]
    for field in ("device", "world", "backend", "dtype", "torch", "cuda", "nccl", "python", "git_sha",
                  "timestamp", "argv"):
        assert field in env, field
    assert env["device"] == "cpu" and env["world"] == 2 and env["backend"] == "gloo" and env["dtype"] == "float32"
    assert env["git_sha"]  # from git, or FLUXINDUCTOR_GIT_SHA where there is no git
    s = data["settings"]
    assert s["config"] == "small" and s["warmup"] == 1 and s["iters"] == 3
    assert s["timing"].startswith("perf_counter") and s["fx_graph_cache"] is False
    assert s["host_exposed"] is True and s["hidden_host"] is None and s["dynamo"]["automatic_dynamic_shapes"] is False
    assert data["complete"] is True and len(data["results"]) == n_rows
    # The table is printed last: its legend ends stdout, one row per result.
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith("ms = steady-state time per step")
    rows = [ln for ln in lines if ln.startswith(("mlp ", "llama2 "))]
    assert len(rows) == n_rows, rows


def _check_measured(r: dict, rounds: int = 2, iters: int = 3) -> None:
    where = f"{r['model']} {r['phase']} {r['mode']}"
    assert r["error"] is None, (where, r["error"])
    assert r["ms"] > 0 and r["first_call_s"] > 0 and r["host_exposed"] is True, where
    # Every rank's every step of every round; a step's time is the slowest rank's, ms the median over all steps.
    assert len(r["iter_ms"]) == 2 and all(len(t) == rounds * iters and all(v > 0 for v in t) for t in r["iter_ms"]), \
        where
    assert r["ms"] == pytest.approx(statistics.median(max(col) for col in zip(*r["iter_ms"]))), where
    sp = r["spread"]
    assert sp["n"] == rounds * iters and sp["min_ms"] <= sp["p10_ms"] <= r["ms"] <= sp["p90_ms"] <= sp["max_ms"], where
    assert len(r["round_median_ms"]) == rounds and all(t > 0 for t in r["round_median_ms"]), where
    assert r["compiles_while_timed"] == 0, where  # every mode's compiled code stayed valid through the rounds
    # Each compiled mode compiles its own graph (none inherits another's cached code); eager compiles nothing.
    assert (r["graphs_compiled_first_call"] == 0) if r["mode"] == "eager" else (r["graphs_compiled_first_call"] >= 1)
    assert "hidden_host_ms" not in r  # CUDA only
    assert len(r["rank_first_call_s"]) == 2
    if r["mode"] in ("eager", "nocomm"):  # the reference itself; the replica (other weights, partial sums)
        assert "errors" not in r
        return
    keys = {"output", "grad_input", "grad_params"} if r["phase"] == "fwd_bwd" else {"output"}
    assert set(r["errors"]) == keys, (where, r["errors"])
    assert 0 <= r["max_error"] <= FP32_ERROR and r["error_ok"] is True, (where, r["errors"])
    assert all(0 < e["norm_rel"] <= e["max_rel"] * 10 for e in r["errors"].values()), (where, r["errors"])


def _no_collectives(r: dict, n_graphs: int) -> None:
    census = r["graph_census"]
    assert len(census) == n_graphs and all(not g for g in census), census


def _check_flux(r: dict, n_layers: int) -> None:
    where = f"{r['model']} {r['phase']} {r['mode']}"
    rs = r["rewrite_stats"]
    assert rs["fused_forward"].get(AG_MM, 0) >= n_layers and rs["fused_forward"].get(MM_RS, 0) >= n_layers, (where, rs)
    if r["phase"] == "fwd_bwd":
        assert rs["fused_backward"].get(AG_MM, 0) >= n_layers, (where, rs)
        assert rs["fused_backward"].get(MM_RS, 0) >= n_layers, (where, rs)
    else:
        assert rs["fused_backward"] == {}, (where, rs)
    assert r["rewrite_stats_per_rank_equal"] is True
    # On CPU every fused-op call runs the decomposition, and says so.
    assert r["path"].startswith("decomposed") and "cpu" in r["path"], (where, r["path"])
    assert sum(rs["fallbacks_first_call"].get(AG_MM, {}).values()) >= 1


def test_bench_model_cpu_mlp_all_modes(tmp_path):
    data, stdout = _run(tmp_path, "mlp", ["--models", "mlp"], inject="flux_fused:fwd")
    modes = ("eager", "inductor", "nocomm", "flux", "flux_fused", "asynctp")
    _check_common(data, stdout, n_rows=12)
    assert data["settings"]["rounds"] == 2  # --quick
    rows = {(r["phase"], r["mode"]): r for r in data["results"]}
    assert set(rows) == {(p, m) for p in ("fwd", "fwd_bwd") for m in modes}
    # Compiled in this order: eager first (the reference), fluxinductor before async-TP.
    assert tuple(r["mode"] for r in data["results"][:6]) == modes

    failed = rows[("fwd", "flux_fused")]
    assert failed["ms"] is None and "injected by BENCH_MODEL_INJECT_ERROR" in failed["error"]
    # The failed mode sits out the rounds; the others rotate.
    orders = {(rd["model"], rd["phase"]): rd["order"] for rd in data["rounds"]}
    assert orders[("mlp", "fwd")] == [["eager", "inductor", "nocomm", "flux", "asynctp"],
                                      ["inductor", "nocomm", "flux", "asynctp", "eager"]]
    assert orders[("mlp", "fwd_bwd")][1] == list(modes[1:]) + ["eager"]
    for key, r in rows.items():
        if key == ("fwd", "flux_fused"):
            continue
        _check_measured(r)
        n_graphs = 2 if r["phase"] == "fwd_bwd" else 1
        if r["mode"] in ("flux", "flux_fused"):
            _check_flux(r, n_layers=1)
        if r["mode"] in ("inductor", "asynctp"):
            # One post-grad graph per compiled graph, collectives still there (nothing fuses on CPU).
            census = r["graph_census"]
            assert len(census) == n_graphs, census
            assert not any("symm_mem" in k for g in census for k in g)
            assert any("all_gather" in k for k in census[0]) and any("reduce_scatter" in k for k in census[0])
        if r["mode"] == "nocomm":
            _no_collectives(r, n_graphs)
        assert r["speedup_vs_eager"] > 0
    assert any("symmetric memory" in n for n in rows[("fwd", "asynctp")]["notes"])
    assert "ERROR RuntimeError: injected" in stdout
    # Sequence parallel: the replica's gathers and reduce-scatters are local stand-ins, and the JSON says so.
    assert data["settings"]["nocomm"]["exact"] == {"mlp": False}
    gains = {(g["model"], g["phase"]): g for g in data["gain"]}
    assert "reduce-scatter" in gains[("mlp", "fwd")]["nocomm_approximation"]
    assert set(gains[("mlp", "fwd")]["modes"]) == {"asynctp", "flux", "flux_fused"}
    assert gains[("mlp", "fwd")]["modes"]["flux_fused"]["G"] is None  # it failed
    assert rows[("fwd_bwd", "flux_fused")]["gain_rounds"] and "G mlp fwd_bwd:" in stdout


def test_bench_model_cpu_decode_rounds_gain(tmp_path):
    # A decode-style step (plain TP, one position of 8 sequences, forward, reduce-overhead) in 3 rounds.
    modes = ["inductor", "nocomm", "flux", "asynctp"]  # compile order
    data, stdout = _run(tmp_path, "decode", [
        "--models", "llama2", "--layers", "1", "--tp", "plain", "--seq", "1", "--batch", "8", "--phases", "fwd",
        "--modes", "inductor,asynctp,flux,nocomm", "--compile-mode", "reduce-overhead", "--rounds", "3",
        "--settle-s", "0.01"])
    _check_common(data, stdout, n_rows=4)
    s = data["settings"]
    assert s["rounds"] == 3 and s["compile_mode"] == "reduce-overhead" and s["models"]["llama2"]["seq"] == 1
    rows = {r["mode"]: r for r in data["results"]}
    assert [r["mode"] for r in data["results"]] == modes
    for r in rows.values():
        _check_measured(r, rounds=3)
    # The order rotates by one each round: every mode leads once, and each round is the last one shifted.
    (entry,) = data["rounds"]
    assert (entry["model"], entry["phase"]) == ("llama2", "fwd")
    assert entry["order"] == [modes[r:] + modes[:r] for r in range(3)]
    # Before the rounds every mode ran untimed rounds (at least one: the settle outlasts 0.01 s), their times dropped.
    assert s["settle_s"] == 0.01 and entry["settle"]["rounds"] >= 1 and entry["settle"]["s"] >= 0.01
    assert "stopped" not in entry["settle"]
    # When each mode's round began: in the round's order, after the settle.
    starts = [[rnd[m] for m in order] for rnd, order in zip(entry["start_s"], entry["order"])]
    flat = [t for rnd in starts for t in rnd]
    assert flat == sorted(flat) and len(set(flat)) == len(flat) and flat[0] > 0
    # nocomm: the same per-rank work, no collective (plain TP: exact).
    _no_collectives(rows["nocomm"], 1)
    assert s["nocomm"]["exact"] == {"llama2": True} and s["nocomm"]["approximation"] == {"llama2": None}
    # G per phase, host exposed, from the medians and per round.
    (g,) = data["gain"]
    ind, noc = rows["inductor"]["ms"], rows["nocomm"]["ms"]
    assert g["host_exposed"] is True and g["inductor_ms"] == ind and g["nocomm_ms"] == noc
    assert g["comm_ms"] == pytest.approx(ind - noc) and g["nocomm_approximation"] is None
    assert set(g["modes"]) == {"flux", "asynctp"}
    for mode in ("flux", "asynctp"):
        want = (ind - rows[mode]["ms"]) / (ind - noc) if ind > noc else None
        assert g["modes"][mode]["G"] == (pytest.approx(want) if want is not None else None), g
        assert rows[mode]["gain"] == g["modes"][mode]["G"] and len(g["modes"][mode]["G_rounds"]) == 3
    assert rows["flux"]["rewrite_stats"]["fused_forward"].get("all_reduce_split", 0) >= 2
    assert "G llama2 fwd: communication cost" in stdout and "rounds llama2 fwd: " in stdout


def test_bench_model_cpu_llama_layer(tmp_path):
    # B = 2: [B, S/w, H] sequence shards behind a batch dim, which the passes rewrite rows-first (attention and MLP).
    data, stdout = _run(tmp_path, "llama", ["--models", "llama2", "--layers", "1", "--phases", "fwd_bwd",
                                            "--modes", "eager,flux", "--batch", "2"])
    _check_common(data, stdout, n_rows=2)
    assert data["settings"]["models"]["llama2"]["layers"] == 1 and data["settings"]["models"]["llama2"]["batch"] == 2
    eager, flux = data["results"]
    assert (eager["mode"], flux["mode"]) == ("eager", "flux")
    _check_measured(eager)
    _check_measured(flux)
    # One layer: attention (one gather feeds Q, K, V; o) and MLP (one gather feeds w1, w3; w2).
    _check_flux(flux, n_layers=2)
    assert flux["errors"]["grad_params"]["worst"].startswith("layers.0.")


def test_bench_model_cpu_autocast_mlp(tmp_path):
    # fp32 weights and inputs, bf16 autocast: the backward's fp32 reduce-scatter of a bf16 matmul is fused too.
    data, stdout = _run(tmp_path, "autocast", ["--models", "mlp", "--phases", "fwd_bwd", "--modes", "eager,flux",
                                               "--autocast", "bf16"])
    assert data["environment"]["autocast"] == "bfloat16" and data["environment"]["dtype"] == "float32"
    assert data["settings"]["tolerance_norm_rel"] == 2e-2 and "autocast bfloat16" in stdout
    eager, flux = data["results"]
    assert flux["error"] is None and flux["error_ok"] is True, flux["errors"]  # CPU decomposes: same arithmetic
    _check_flux(flux, n_layers=1)
    assert flux["rewrite_stats"]["skipped_backward"].get(MM_RS, {}) == {}, flux["rewrite_stats"]


def test_bench_model_cli_rejects_unknown_mode(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "x"), "--modes", "nope"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown mode 'nope'" in proc.stderr


def test_bench_model_cpu_plain_tp_llama_layer(tmp_path):
    # Plain TP (replicated activations, an all-reduce after wo and w2, and after the Q/K/V and w1/w3 input gradients):
    # the all-reduce split fuses every all-reduce's reduce-scatter half (exact, the default), eager's numerics.
    data, stdout = _run(tmp_path, "plain", ["--models", "llama2", "--layers", "1", "--phases", "fwd_bwd",
                                            "--modes", "eager,flux", "--tp", "plain"])
    _check_common(data, stdout, n_rows=2)
    assert data["settings"]["tp"] == "plain"
    eager, flux = data["results"]
    _check_measured(eager)
    _check_measured(flux)
    rs = flux["rewrite_stats"]
    # Each all-reduce counts once, as all_reduce_split; its reduce-scatter half runs as the fused op.
    assert rs["fused_forward"].get("all_reduce_split", 0) >= 2 and rs["fused_backward"].get("all_reduce_split", 0) >= 2
    assert rs["fused_forward"].get(MM_RS, 0) == 0 and rs["fallbacks_first_call"].get(MM_RS), rs
    assert rs["fused_forward"].get(AG_MM, 0) == 0  # exact: the gathers land before the residual adds
    assert flux["rewrite_stats_per_rank_equal"] is True


def test_bench_model_cpu_compile_mode(tmp_path):
    # --compile-mode reaches torch.compile for inductor and flux alike (on CPU reduce-overhead has no CUDA graphs to
    # take, so the graphs are the default's: the fused patterns still rewritten, eager's numerics) and is recorded.
    data, stdout = _run(tmp_path, "mode", ["--models", "mlp", "--phases", "fwd", "--modes", "eager,inductor,flux",
                                           "--compile-mode", "reduce-overhead"])
    assert data["settings"]["compile_mode"] == "reduce-overhead" and "compile mode reduce-overhead" in stdout
    eager, inductor, flux = data["results"]
    for r in (eager, inductor, flux):
        _check_measured(r)
    _check_flux(flux, n_layers=1)


def test_bench_model_cpu_tokens_sweep(tmp_path):
    # --tokens: each size a row of its own ("llama2@N"), every contender built once and compiled per size (flux's
    # passes rewrite every size's graph); sequence parallel skips a size the ranks cannot split.
    data, stdout = _run(tmp_path, "sweep", ["--models", "llama2", "--layers", "1", "--phases", "fwd",
                                            "--modes", "inductor,flux,nocomm", "--tokens", "8,3,4", "--rounds", "2"])
    s = data["settings"]
    assert s["tokens"] == [3, 4, 8] and s["tokens_skipped"] == [3]
    assert s["models"]["llama2"]["seq"] == 8 and s["models"]["llama2"]["batch"] == 1  # built for the largest
    rows = {(r["model"], r["mode"]): r for r in data["results"]}
    assert set(rows) == {(f"llama2@{n}", m) for n in (4, 8) for m in ("inductor", "flux", "nocomm")}
    for (label, mode), r in rows.items():
        _check_measured(r, rounds=2)
        if mode == "flux":
            assert r["error_ok"] is True, (label, r["errors"])  # against eager at this size
            assert r["rewrite_stats"]["fused_forward"].get(AG_MM, 0) >= 1, (label, r["rewrite_stats"])
    assert {g["model"] for g in data["gain"]} == {"llama2@4", "llama2@8"}
    assert all(g["nocomm_approximation"] for g in data["gain"])  # sequence parallel: the replica's stand-ins
    assert "llama2@3: skipped" in stdout and "G llama2@8 fwd:" in stdout
    if importlib.util.find_spec("matplotlib") is not None:  # the sweep's plot: one panel per JSON and phase
        png = tmp_path / "sweep.png"
        proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "plot_model.py"),
                               str(tmp_path / "sweep.json"), "--out", str(png)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "(1 panels)" in proc.stdout and png.stat().st_size > 0, proc.stderr[-2000:]


def test_bench_model_cpu_tokens_sweep_dynamic(tmp_path):
    # --dynamic: plain TP, one graph per mode serves every size after the first (no compile at the later sizes).
    data, stdout = _run(tmp_path, "dyn", ["--models", "llama2", "--layers", "1", "--phases", "fwd", "--tp", "plain",
                                          "--modes", "inductor,flux", "--tokens", "2,4,8", "--dynamic", "--rounds", "2"])
    assert data["settings"]["dynamic"] is True and " dynamic " in stdout
    rows = {(r["model"], r["mode"]): r for r in data["results"]}
    for mode in ("inductor", "flux"):
        assert rows[("llama2@2", mode)]["graphs_compiled_first_call"] >= 1
        for n in (4, 8):
            r = rows[(f"llama2@{n}", mode)]
            assert r["error"] is None and r["graphs_compiled_first_call"] == 0, (n, mode, r.get("error"))
            if mode == "flux":
                assert r["error_ok"] is True, r["errors"]


def test_bench_model_cli_rejects_tokens_without_llama(tmp_path):
    for extra in (["--models", "mlp"], ["--models", "llama2", "--seq", "8"], ["--models", "llama2", "--tokens", "0"]):
        args = ["--tokens", "4"] + extra if "--tokens" not in extra else extra
        proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "x"), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "--tokens" in proc.stderr, (extra, proc.stderr[-500:])


def _bench_model_module():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_model_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hidden_host_sleep_outlasts_the_enqueue():
    """The hidden-host sleep is sized from the host's enqueue at the fastest clock seen, never below --sleep-cycles,
    and the record says how many steps it covered."""
    from types import SimpleNamespace

    bm = _bench_model_module()
    ctx = SimpleNamespace(sleep_cycles=1000, sleep_ms=2.0, sleep_rate=0.0, hidden_cycles=0)  # idle: 500 per ms
    assert bm.hidden_sleep_cycles(ctx, 0.1) == 1000  # a short enqueue: the floor
    assert bm.hidden_sleep_cycles(ctx, 4.0) == int(1.5 * 4.0 * 500)  # the idle rate before any sleep ran
    assert bm.hidden_sleep_cycles(ctx, 1.0) == int(1.5 * 4.0 * 500)  # never shorter within a phase
    ctx.sleep_rate = 2000.0  # a sleep ran faster under load
    assert bm.hidden_sleep_cycles(ctx, 4.0) == int(1.5 * 4.0 * 2000)
    ctx = SimpleNamespace(sleep_cycles=1000, sleep_ms=None, sleep_rate=0.0, hidden_cycles=0)
    assert bm.hidden_sleep_cycles(ctx, 4.0) == 1000  # no rate known: the floor

    local = {"exposed": [[2.0, 3.0]], "host": [[1.0, 1.0]], "hidden": [[1.5, 1.6]], "hidden_host": [[0.5, 0.9]],
             "sleeps": [[0.8, 0.7]], "fallbacks": {}, "compiles": 0, "profile_top": None}
    ctx = SimpleNamespace(gather=lambda d: [local, local])
    cont = SimpleNamespace(exposed=local["exposed"], host=local["host"], hidden=local["hidden"],
                           hidden_host=local["hidden_host"], sleeps=local["sleeps"], fallbacks={}, compiles=0,
                           profile_top=None, is_flux=False)
    record = {}
    bm.summarize(ctx, cont, record)
    assert record["hidden_host_sleep_ms"] == statistics.median([0.8, 0.7, 0.8, 0.7])
    assert record["hidden_host_covered"] == 0.5  # 0.8 > 0.5 covered, 0.7 < 0.9 not, on both ranks
    assert record["hidden_host_ms"] == statistics.median([1.5, 1.6])
