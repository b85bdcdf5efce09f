"""The measured cost model: table lookup, interpolation, nearest-shape rule and every "sequential" default."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fluxinductor import cost_model

DEVICE = "NVIDIA H200"


def _row(op, m, k, n, fused, seq, **extra):
    return dict(op=op, m=m, k=k, n=n, fused_ms=fused, sequential_ms=seq, **extra)


AG, RS = "all_gather_matmul", "matmul_reduce_scatter"

ROWS = [
    # K=8192, N=28672 AG: fused loses at small M, wins from M=2048 on.
    _row(AG, 512, 8192, 28672, 0.30, 0.25),  # -20%
    _row(AG, 1024, 8192, 28672, 0.45, 0.44),  # -2.3%
    _row(AG, 2048, 8192, 28672, 0.70, 0.80),  # +12.5%
    _row(AG, 4096, 8192, 28672, 1.30, 1.50),  # +13.3%
    _row(AG, 16384, 8192, 28672, 5.70, 6.10),  # +6.6%
    # A shape whose fused kernel failed its check: never chosen however fast.
    _row(AG, 4096, 12288, 49152, 1.00, 3.70, fused_ok=False),
    # A shape where the fused kernel was unavailable.
    _row(AG, 1024, 8192, 8192, None, 0.20),
    # GEMM+RS: wins by exactly the noise margin at M=2048 (not chosen), clearly at 8192.
    _row(RS, 2048, 8192, 28672, 0.99, 1.00),
    _row(RS, 8192, 8192, 28672, 3.00, 3.60),
]


@pytest.fixture
def table_dir(flux_settings, tmp_path, monkeypatch):
    flux_settings(tuning_dir=str(tmp_path))
    cost_model.clear_cache()
    table = cost_model.make_table(DEVICE, 2, torch.bfloat16, ROWS, source={"test": True})
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp2.json"), table, merge=False)
    yield tmp_path
    cost_model.clear_cache()


def choose(op, m, k, n, device=DEVICE, world=2, dtype=torch.bfloat16):
    return cost_model.choose(op, device, world, m, k, n, dtype)


def test_device_key_and_aliases():
    assert cost_model.device_key("NVIDIA H200") == "nvidia_h200"
    assert cost_model.device_key("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert cost_model.canonical_op("AG+GEMM") == AG
    assert cost_model.canonical_op("gemm_rs") == RS
    with pytest.raises(ValueError):
        cost_model.canonical_op("all_reduce_matmul")


def test_global_mkn_convention():
    # AG: shard [M/w, K], B [K, N/w]; RS: A [M, K/w], B [K/w, N].
    assert cost_model.global_mkn("all_gather_matmul", 2, 2048, 8192, 14336) == (4096, 8192, 28672)
    assert cost_model.global_mkn("matmul_reduce_scatter", 4, 4096, 2048, 8192) == (4096, 8192, 8192)


def test_no_table_means_sequential(flux_settings, tmp_path, monkeypatch):
    flux_settings(tuning_dir=str(tmp_path))
    cost_model.clear_cache()
    choice, reason = choose(AG, 4096, 8192, 28672)
    assert choice == "sequential"
    assert reason == "no tuning table for nvidia_h200 tp2"


def test_other_world_or_device_has_no_table(table_dir):
    assert choose(AG, 4096, 8192, 28672, world=4) == ("sequential", "no tuning table for nvidia_h200 tp4")
    choice, reason = choose(AG, 4096, 8192, 28672, device="NVIDIA H100 80GB HBM3")
    assert choice == "sequential" and "nvidia_h100_80gb_hbm3 tp2" in reason


def test_exact_rows(table_dir):
    assert choose(AG, 4096, 8192, 28672)[0] == "fused"
    assert choose(AG, 2048, 8192, 28672)[0] == "fused"
    choice, reason = choose(AG, 512, 8192, 28672)
    assert choice == "sequential" and "measured" in reason
    assert choose(AG, 1024, 8192, 28672)[0] == "sequential"  # fused 2% slower


def test_gain_must_exceed_noise_margin(table_dir):
    # 1% gain == MIN_GAIN: not enough.
    choice, reason = choose(RS, 2048, 8192, 28672)
    assert choice == "sequential", reason
    assert choose(RS, 8192, 8192, 28672)[0] == "fused"


def test_failed_check_and_unavailable_never_fused(table_dir):
    choice, reason = choose(AG, 4096, 12288, 49152)
    assert choice == "sequential" and "failed its check" in reason
    choice, reason = choose(AG, 1024, 8192, 8192)
    assert choice == "sequential" and "unavailable" in reason


def test_interpolation_in_log_m(table_dir):
    # Between 2048 (+12.5%) and 4096 (+13.3%): fused.
    choice, reason = choose(AG, 3072, 8192, 28672)
    assert choice == "fused" and "interpolated" in reason
    # Between 1024 (-2.3%) and 2048 (+12.5%): at the log-midpoint ~1448 the gain is ~+5%: fused;
    # just above 1024 it is still negative: sequential.
    assert choose(AG, 1448, 8192, 28672)[0] == "fused"
    assert choose(AG, 1056, 8192, 28672)[0] == "sequential"
    # Between 512 (-20%) and 1024 (-2.3%): sequential.
    assert choose(AG, 768, 8192, 28672)[0] == "sequential"


def test_interpolation_never_leans_on_a_failed_row(flux_settings, tmp_path, monkeypatch):
    flux_settings(tuning_dir=str(tmp_path))
    rows = [_row(AG, 1024, 4096, 4096, 0.1, 0.2), _row(AG, 4096, 4096, 4096, None, 0.5)]
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp2.json"), cost_model.make_table(DEVICE, 2, "bf16", rows))
    assert choose(AG, 1024, 4096, 4096)[0] == "fused"
    assert choose(AG, 2048, 4096, 4096)[0] == "sequential"


def test_above_the_measured_m_range_uses_the_end_row_and_below_it_stays_sequential(table_dir):
    choice, reason = choose(AG, 65536, 8192, 28672)
    assert choice == "fused" and "above the range" in reason
    # Below the smallest measured M nothing is extrapolated, even where the smallest row wins.
    choice, reason = choose(AG, 256, 8192, 28672)
    assert choice == "sequential" and "below the measured range" in reason


def test_decode_sizes_stay_sequential_even_next_to_a_winning_row(flux_settings, tmp_path):
    flux_settings(tuning_dir=str(tmp_path))
    rows = [_row(RS, 512, 8192, 8192, 0.1, 0.2), _row(RS, 4096, 8192, 8192, 0.3, 0.5)]
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp2.json"), cost_model.make_table(DEVICE, 2, "bf16", rows))
    assert choose(RS, 512, 8192, 8192)[0] == "fused"
    for m in (1, 8, 64, 256, 511):
        choice, reason = choose(RS, m, 8192, 8192)
        assert choice == "sequential" and "below the measured range" in reason, (m, reason)
        # Nor through the nearest-shape rule (K and N within 2x, not exact).
        choice, reason = choose(RS, m, 8192, 6144)
        assert choice == "sequential" and "below the measured range" in reason, (m, reason)


def test_nearest_by_flops_with_similar_kn(table_dir):
    # (8192, 30720) is within 2x of (8192, 28672) in K and in N but not exact: nearest flops row is M=4096.
    choice, reason = choose(AG, 4096, 8192, 30720)
    assert choice == "fused" and "nearest measured shape by flops" in reason
    # Same K*N neighbourhood, but M so small the nearest row by flops is M=512 (fused loses).
    assert choose(AG, 512, 8192, 30720)[0] == "sequential"
    # Nothing with similar K*N at all.
    choice, reason = choose(AG, 4096, 1024, 1024)
    assert choice == "sequential" and "no measured" in reason
    # The same K*N with K and N swapped is not similar: for GEMM+RS it moves 3.5x fewer bytes.
    choice, reason = choose(RS, 8192, 28672, 8192)
    assert choice == "sequential" and "no measured" in reason
    # Similar K*N but M = 64, 8x below the smallest row: below the measured range, never extrapolated.
    choice, reason = choose(AG, 64, 8192, 30720)
    assert choice == "sequential" and "below the measured range" in reason


def test_op_without_rows(flux_settings, tmp_path, monkeypatch):
    flux_settings(tuning_dir=str(tmp_path))
    rows = [_row(AG, 4096, 8192, 28672, 1.0, 2.0)]
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp2.json"), cost_model.make_table(DEVICE, 2, "bf16", rows))
    choice, reason = choose(RS, 4096, 8192, 28672)
    assert choice == "sequential" and "no matmul_reduce_scatter rows" in reason


def test_dtype_rule(table_dir):
    assert choose(AG, 4096, 8192, 28672, dtype=torch.float16)[0] == "fused"  # same rate as bf16
    assert choose(AG, 4096, 8192, 28672, dtype="bfloat16")[0] == "fused"
    choice, reason = choose(AG, 4096, 8192, 28672, dtype=torch.float32)
    assert choice == "sequential" and "float32" in reason


def test_table_reloads_when_the_file_changes(table_dir):
    path = table_dir / "nvidia_h200_tp2.json"
    assert choose(RS, 8192, 8192, 28672)[0] == "fused"
    rows = [_row(RS, 8192, 8192, 28672, 4.0, 3.6)]
    table = cost_model.make_table(DEVICE, 2, "bf16", rows)
    with open(path, "w") as f:
        json.dump(table, f)
    import os

    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a distinct mtime even on coarse clocks
    assert choose(RS, 8192, 8192, 28672)[0] == "sequential"


def test_broken_table_raises(flux_settings, tmp_path, monkeypatch):
    flux_settings(tuning_dir=str(tmp_path))
    cost_model.clear_cache()
    (tmp_path / "nvidia_h200_tp2.json").write_text('{"format": 99}')
    with pytest.raises(ValueError, match="not a fluxinductor tuning table"):
        choose(AG, 4096, 8192, 28672)


def test_make_table_and_merge(tmp_path):
    path = str(tmp_path / "t.json")
    first = cost_model.make_table(DEVICE, 2, "bf16", [_row("AG+GEMM", 4096, 8192, 28672, 1.0, 2.0),
                                                      _row("GEMM+RS", 4096, 8192, 28672, 3.0, 2.0)])
    assert [r["choice"] for r in first["entries"]] == ["fused", "sequential"]
    assert first["entries"][0]["op"] == AG
    cost_model.write_table(path, first)
    # A second run that measured only one shape replaces that row and keeps the other.
    second = cost_model.make_table(DEVICE, 2, "bf16", [_row(RS, 4096, 8192, 28672, 1.5, 2.0)])
    merged = cost_model.write_table(path, second)
    by_op = {r["op"]: r for r in merged["entries"]}
    assert by_op[RS]["fused_ms"] == 1.5 and by_op[RS]["choice"] == "fused"
    assert by_op[AG]["fused_ms"] == 1.0
    # Each row says which run measured it; a kept row whose run is not known says so (its table may be a merge).
    assert by_op[AG]["measured"] == {} and "measured" not in by_op[RS]  # tables made without a source
    old_run = {"bench_json": "a.json", "git_sha": "abc", "timestamp": "t1"}
    new_run = {"bench_json": "b.json", "git_sha": "def", "timestamp": "t2"}
    third = cost_model.make_table(DEVICE, 2, "bf16", [_row(AG, 1024, 8192, 8192, 1.0, 2.0)], {**old_run, "iters": 20})
    fourth = cost_model.make_table(DEVICE, 2, "bf16", [_row(RS, 4096, 8192, 28672, 1.2, 2.0)], new_run)
    twice = cost_model.merge_tables(cost_model.merge_tables(merged, third), fourth)
    runs = {(r["op"], r["m"]): r.get("measured") for r in twice["entries"]}
    assert runs == {(AG, 4096): {}, (AG, 1024): old_run, (RS, 4096): new_run}
    assert twice["source"] == new_run and twice["earlier_sources"] == [{**old_run, "iters": 20}]
    # Another world size is not merged into this one.
    other = cost_model.make_table(DEVICE, 4, "bf16", [_row(RS, 4096, 8192, 28672, 1.5, 2.0)])
    assert len(cost_model.merge_tables(merged, other)["entries"]) == 1
    with open(path) as f:
        assert json.load(f)["format"] == cost_model.TABLE_FORMAT


def test_gain_values():
    assert cost_model._gain(_row(AG, 1, 1, 1, 1.0, 2.0)) == pytest.approx(0.5)
    assert cost_model._gain(_row(AG, 1, 1, 1, None, 2.0)) == -math.inf
    assert cost_model._gain(_row(AG, 1, 1, 1, 1.0, None)) == -math.inf
    assert cost_model._gain(_row(AG, 1, 1, 1, 1.0, 2.0, fused_ok=False)) == -math.inf


# ---- async-TP as a third path ------------------------------------------------------------------------

ATP_ROWS = [
    # fused wins at M=2048, async-TP at M=8192; at M=4096 both lose.
    _row(RS, 2048, 8192, 28672, 0.80, 1.00, asynctp_ms=0.95),
    _row(RS, 4096, 8192, 28672, 1.60, 1.58, asynctp_ms=1.59),
    _row(RS, 8192, 8192, 28672, 3.00, 3.60, asynctp_ms=2.50),
    # async-TP fastest but its output failed the check: fused (second best) is chosen.
    _row(AG, 4096, 12288, 49152, 1.90, 2.20, asynctp_ms=1.50, asynctp_ok=False),
]


@pytest.fixture
def atp_table_dir(flux_settings, tmp_path, monkeypatch):
    flux_settings(tuning_dir=str(tmp_path))
    cost_model.clear_cache()
    table = cost_model.make_table(DEVICE, 4, torch.bfloat16, ATP_ROWS)
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp4.json"), table, merge=False)
    yield table
    cost_model.clear_cache()


def test_asynctp_is_chosen_where_it_measured_fastest(atp_table_dir):
    assert [r["choice_with_asynctp"] for r in atp_table_dir["entries"]] == ["fused", "fused", "sequential", "asynctp"]
    assert [r["choice"] for r in atp_table_dir["entries"]] == ["fused", "fused", "sequential", "fused"]
    # A near tie (async-TP ahead by less than MIN_GAIN) keeps the fused kernel.
    tie = _row(AG, 8192, 8192, 28672, 1.359, 1.596, asynctp_ms=1.351)
    assert cost_model.make_table(DEVICE, 4, "bf16", [tie])["entries"][0]["choice_with_asynctp"] == "fused"
    pick = lambda m, **kw: cost_model.choose(RS, DEVICE, 4, m, 8192, 28672, torch.bfloat16, **kw)  # noqa: E731
    choice, reason = pick(8192)
    assert choice == "asynctp" and "asynctp 2.500 ms" in reason and "fused 3.000 ms" in reason
    assert pick(2048)[0] == "fused"
    assert pick(4096)[0] == "sequential"
    # Limited to the fused kernel (async-TP unavailable or FLUXINDUCTOR_ASYNCTP=0): fused wins at 8192 too.
    assert pick(8192, paths=("fused",))[0] == "fused"
    # Fused not eligible for this call: only async-TP may be chosen (M=2048: +5% > 1%).
    assert pick(2048, paths=("asynctp",))[0] == "asynctp"
    assert pick(4096, paths=("asynctp",))[0] == "sequential"
    assert pick(8192, paths=())[0] == "sequential"


def test_asynctp_interpolates_on_its_own_and_respects_failed_checks(atp_table_dir):
    # Between M=4096 (async-TP -0.6%) and M=8192 (+30.6%): async-TP's own gain is interpolated.
    choice, reason = cost_model.choose(RS, DEVICE, 4, 6000, 8192, 28672, torch.bfloat16)
    assert choice == "asynctp" and "interpolated" in reason
    choice, reason = cost_model.choose(AG, DEVICE, 4, 4096, 12288, 49152, torch.bfloat16)
    assert choice == "fused" and "failed its check" in reason


def test_asynctp_not_for_tiny_shapes():
    # async-TP 7% faster than sequential, but the whole op takes 0.15 ms: its host-side cost is not hidden.
    tiny = _row(RS, 1024, 8192, 8192, 0.20, 0.149, asynctp_ms=0.138)
    assert cost_model._gain(tiny, "asynctp") == -math.inf
    assert cost_model.make_table(DEVICE, 2, "bf16", [tiny])["entries"][0]["choice_with_asynctp"] == "sequential"
    big = _row(RS, 4096, 8192, 8192, 0.60, 0.521, asynctp_ms=0.463)
    assert cost_model._gain(big, "asynctp") == pytest.approx((0.521 - 0.463) / 0.521)


def test_tables_without_asynctp_times_never_choose_it(table_dir):
    for m in (512, 2048, 4096, 16384):
        assert cost_model.choose(AG, DEVICE, 2, m, 8192, 28672, torch.bfloat16)[0] in ("fused", "sequential")


def test_answers_are_remembered_per_table_version(table_dir):
    path = table_dir / "nvidia_h200_tp2.json"
    first = choose(RS, 8192, 8192, 28672)
    assert first[0] == "fused"
    assert choose(RS, 8192, 8192, 28672) == first  # served from the memo
    # A rewritten table (new mtime) is read again, without clear_cache(): the memo is keyed by the file version.
    slower = [_row(RS, 8192, 8192, 28672, 3.90, 3.60)]
    data = cost_model.make_table(DEVICE, 2, torch.bfloat16, slower, source={"test": True})
    path.write_text(json.dumps(data))
    stat = path.stat()
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    choice, reason = choose(RS, 8192, 8192, 28672)
    assert choice == "sequential", reason
    # A table that disappears means "sequential" again, not a stale memo.
    path.unlink()
    assert choose(RS, 8192, 8192, 28672) == ("sequential", "no tuning table for nvidia_h200 tp2")


def test_copy_transport_is_a_path_of_its_own(flux_settings, tmp_path, monkeypatch):
    flux_settings(tuning_dir=str(tmp_path))
    cost_model.clear_cache()
    rows = [
        # the copy engine measured faster than the stores: picked by default
        _row(RS, 8192, 8192, 28672, 1.80, 2.37, fused_copy_ms=1.65, fused_copy_ok=True),
        # within MIN_GAIN of the stores: the stores (first in PATHS) keep it
        _row(RS, 4096, 12288, 49152, 1.83, 2.58, fused_copy_ms=1.82),
        # faster, but its output failed the check: never
        _row(RS, 2048, 8192, 28672, 0.48, 0.63, fused_copy_ms=0.30, fused_copy_ok=False),
    ]
    table = cost_model.make_table(DEVICE, 4, torch.bfloat16, rows)
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp4.json"), table, merge=False)
    pick = lambda m, k, n, **kw: cost_model.choose(RS, DEVICE, 4, m, k, n, torch.bfloat16, **kw)  # noqa: E731
    assert pick(8192, 8192, 28672)[0] == "fused_copy"
    assert pick(8192, 8192, 28672, paths=("fused",))[0] == "fused"  # not offered: the stores
    assert pick(4096, 12288, 49152)[0] == "fused"
    assert pick(2048, 8192, 28672)[0] == "fused"
    assert [r["choice"] for r in table["entries"]] == ["fused", "fused_copy", "fused"]  # sorted by (k, n, m)
    cost_model.clear_cache()


def _bench_result(op_key, m, k, n, **contenders):
    """One bench_ops result row: contender name -> (ms, passed its check)."""
    label = {"ag_gemm": "AG+GEMM", "gemm_rs": "GEMM+RS"}[op_key]
    return {"op": label, "op_key": op_key, "M": m, "K": k, "N": n,
            "contenders": {name: {"ms": ms, "rel_ok": ok, "error": None if ms is not None else "unavailable"}
                           for name, (ms, ok) in contenders.items()}}


def test_bench_results_round_trip_to_choose(tmp_path, flux_settings):
    """A bench_ops run's results -> table -> file -> load -> choose: each path wins where it was measured faster,
    a failed check or a missing sequential time keeps it out, and the split transport's faster configuration is
    what the dispatcher is given."""
    from fluxinductor import tuning_table

    results = [
        _bench_result("ag_gemm", 4096, 8192, 28672, nccl_seq=(1.5, True), gemm=(1.0, True), fused=(1.2, True)),
        # fused faster but wrong: never chosen
        _bench_result("ag_gemm", 4096, 12288, 49152, nccl_seq=(3.7, True), fused=(1.0, False)),
        # no sequential time: no row
        _bench_result("ag_gemm", 1024, 8192, 8192, fused=(0.1, True)),
        # the split transport wins, configuration 2 by more than the noise margin
        _bench_result("gemm_rs", 8192, 12288, 49152, nccl_seq=(2.0, True), fused=(1.8, True),
                      fused_copy=(1.9, True), fused_split=(1.5, True), fused_split2=(1.4, True)),
    ]
    data = {"environment": {"device": DEVICE, "world": 2, "dtype": "bfloat16", "git_sha": "abc", "timestamp": "t",
                            "torch": "2.x", "nccl": "2.x", "b_layout": "t", "iters": 20},
            "results": results}
    table = tuning_table.table_from_bench(data, "results/run.json")
    assert table["source"]["bench_json"] == "results/run.json" and table["source"]["git_sha"] == "abc"
    path = tuning_table.table_file(str(tmp_path), table)
    assert path == str(tmp_path / "nvidia_h200_tp2.json")
    tuning_table.write_table(path, table, merge=False)
    loaded = tuning_table.load_table(path)
    assert loaded["format"] == tuning_table.TABLE_FORMAT and len(loaded["entries"]) == 3
    rows = {(r["op"], r["m"], r["k"], r["n"]): r for r in loaded["entries"]}
    split_row = rows[(RS, 8192, 12288, 49152)]
    assert split_row["split_config"] == 2 and split_row["fused_split_ms"] == 1.4
    assert split_row["fused_split_config_ms"] == {"0": 1.5, "2": 1.4}
    assert rows[(AG, 4096, 12288, 49152)]["fused_ok"] is False

    flux_settings(tuning_dir=str(tmp_path))
    cost_model.clear_cache()
    try:
        assert choose(AG, 4096, 8192, 28672)[0] == "fused"
        assert choose(AG, 4096, 12288, 49152)[0] == "sequential"
        assert choose(RS, 8192, 12288, 49152)[0] == "fused_split"
        assert cost_model.split_config(DEVICE, 2, 8192, 12288, 49152, torch.bfloat16) == 2
    finally:
        cost_model.clear_cache()
