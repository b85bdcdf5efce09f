"""The self-calibrating cost model: the roofline estimate where no table answers, measured rows, and the run-time
measurement that every rank agrees on (fluxinductor/calibration.py), on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from _dist import run_ranks
from fluxinductor import calibration, cost_model, settings

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
H100 = "NVIDIA H100 80GB HBM3"
TUNING = os.path.join(os.path.dirname(cost_model.__file__), "tuning")


@pytest.fixture(autouse=True)
def _fresh():
    calibration.forget()
    cost_model.clear_cache()
    yield
    calibration.forget()
    cost_model.clear_cache()


def test_roofline_sequential_at_decode_sizes_fused_at_training_sizes():
    rates = cost_model.nominal_rates(H100)
    for op in (AG, RS):
        for world in (2, 4, 8):
            seq, fused = cost_model.roofline_ms(op, world, 64, 8192, 8192, torch.bfloat16, rates)
            assert fused > seq, (op, world)
            seq, fused = cost_model.roofline_ms(op, world, 8192, 8192, 28672, torch.bfloat16, rates)
            assert fused < 0.97 * seq, (op, world)
    # At a fixed (K, N) the gain rises with M while the fixed overhead fades, and stays positive once the GEMM hides
    # the collective (then the communication's share, less the fused GEMM's slowdown).
    gains = []
    for m in (128, 512, 2048, 8192):
        seq, fused = cost_model.roofline_ms(AG, 2, m, 8192, 28672, torch.bfloat16, rates)
        gains.append((seq - fused) / seq)
    assert gains[0] < cost_model.MIN_GAIN < min(gains[1:]), gains


@pytest.mark.parametrize("world", [2, 4])
def test_roofline_picks_what_the_committed_h200_tables_measured(world):
    """With nominal rates, the estimate's fused-or-sequential verdict matches the measured choice on >= 90% of rows."""
    with open(os.path.join(TUNING, f"nvidia_h200_tp{world}.json")) as f:
        table = json.load(f)
    rates = cost_model.nominal_rates("NVIDIA H200")
    agree = 0
    for r in table["entries"]:
        seq, fused = cost_model.roofline_ms(r["op"], world, r["m"], r["k"], r["n"], torch.bfloat16, rates)
        estimated = (seq - fused) / seq > cost_model.MIN_GAIN
        agree += estimated == (r["choice"] != "sequential")
    assert agree >= 0.9 * len(table["entries"]), (agree, len(table["entries"]))


def test_nominal_rates_by_device_name():
    assert cost_model.nominal_rates("NVIDIA H200").source == "nominal H200 SXM"
    assert cost_model.nominal_rates("NVIDIA H100 80GB HBM3").source == "nominal H100 SXM"
    assert cost_model.nominal_rates("NVIDIA H20").source == "nominal H20"
    assert cost_model.nominal_rates("NVIDIA H100 NVL").source == "nominal H100 PCIe/NVL"
    assert cost_model.nominal_rates("NVIDIA A100-SXM4-80GB").source == "nominal, device not known"


def test_sum_per_term_by_the_roofline():
    """A reduce-scatter of a sum of matmuls: one op per term where the concatenation's copy costs more than a second
    collective hidden under each term's GEMM (the gate/up input gradient of a Llama layer, hidden 8192, FFN 28672,
    4096 tokens), concatenated where the terms' GEMMs are too short to hide a collective each (Q/K/V's)."""
    rates = cost_model.nominal_rates("NVIDIA H200")
    bf16 = torch.bfloat16
    for world in (2, 4):
        gate_up = [28672, 28672]
        weights = sum(k // world for k in gate_up) * 8192 * 2
        assert cost_model.sum_per_term(world, 4096, gate_up, 8192, bf16, weights, rates)
        assert not cost_model.sum_per_term(world, 4096, gate_up, 8192, bf16, 0, rates)  # nothing to copy
        qkv = [8192, 1024, 1024]
        weights = sum(k // world for k in qkv) * 8192 * 2
        assert not cost_model.sum_per_term(world, 4096, qkv, 8192, bf16, weights, rates)


def test_decide_estimates_only_where_no_table_answers():
    on_table = cost_model.decide(AG, "NVIDIA H200", 2, 4096, 8192, 28672, torch.bfloat16)
    assert not on_table.estimated and on_table.path == "fused"
    below = cost_model.decide(AG, "NVIDIA H200", 2, 64, 8192, 28672, torch.bfloat16)
    assert not below.estimated and below.path == "sequential"  # the table's no-extrapolation rule still holds
    no_table = cost_model.decide(AG, H100, 2, 8192, 8192, 28672, torch.bfloat16)
    assert no_table.estimated and no_table.path == "fused" and "roofline (nominal" in no_table.reason
    assert cost_model.decide(AG, H100, 2, 64, 8192, 28672, torch.bfloat16).path == "sequential"
    assert cost_model.decide(AG, H100, 2, 8192, 8192, 28672, torch.float32).path == "sequential"
    # choose() keeps answering from the tables alone.
    assert cost_model.choose(AG, H100, 2, 8192, 8192, 28672, torch.bfloat16)[0] == "sequential"


def test_hidden_table_means_estimates(monkeypatch, tmp_path):
    monkeypatch.setenv("FLUXINDUCTOR_TUNING_DIR", str(tmp_path))
    settings.reload()
    try:
        d = cost_model.decide(RS, "NVIDIA H200", 2, 4096, 28672, 8192, torch.bfloat16)
        assert d.estimated and d.path == "fused"
    finally:
        monkeypatch.delenv("FLUXINDUCTOR_TUNING_DIR")
        settings.reload()


def test_calibrated_rows_answer_at_their_m_and_between_not_elsewhere():
    row = {"op": RS, "k": 8192, "n": 8192, "dtype": "bfloat16"}
    cost_model.add_calibrated_row(H100, 2, dict(row, m=2048, sequential_ms=1.0, fused_ms=0.8, fused_copy_ms=0.9))
    cost_model.add_calibrated_row(H100, 2, dict(row, m=8192, sequential_ms=4.0, fused_ms=4.2, fused_copy_ms=4.1))
    paths = ("fused", "fused_copy")
    exact = cost_model.decide(RS, H100, 2, 2048, 8192, 8192, torch.float16, paths)
    assert (exact.path, exact.estimated) == ("fused", False) and "calibrated" in exact.reason
    assert cost_model.decide(RS, H100, 2, 8192, 8192, 8192, torch.bfloat16, paths).path == "sequential"
    between = cost_model.decide(RS, H100, 2, 4096, 8192, 8192, torch.bfloat16, paths)
    assert not between.estimated and "interpolated" in between.reason
    # Another (K, N), or M outside the measured range: the roofline again, never a neighbour's row.
    assert cost_model.decide(RS, H100, 2, 16384, 8192, 8192, torch.bfloat16, paths).estimated
    assert cost_model.decide(RS, H100, 2, 2048, 8192, 4096, torch.bfloat16, paths).estimated
    # Rows of another world size or dtype family do not count; measured rates change the estimate's source.
    assert cost_model.decide(RS, H100, 4, 2048, 8192, 8192, torch.bfloat16, paths).estimated
    cost_model.set_measured_rates(H100, 2, cost_model.Rates(500.0, 100.0, 0.05, "measured"))
    assert "roofline (measured" in cost_model.decide(RS, H100, 2, 16384, 8192, 8192, torch.bfloat16, paths).reason
    assert cost_model.calibration_digest() != "([], [])"


def test_a_row_above_the_range_or_of_a_similar_shape_is_a_seed():
    """The table decides where it measured the call's (K, N) around its M; a row above the measured Ms or of a similar
    shape only seeds an estimate (the first call measures the shape), until a calibrated row of the shape answers."""
    bf16, h200 = torch.bfloat16, "NVIDIA H200"
    assert not cost_model.decide(RS, h200, 2, 4096, 8192, 8192, bf16).estimated  # a row of the shape
    assert not cost_model.decide(RS, h200, 2, 6144, 8192, 28672, bf16).estimated  # between two rows' Ms
    above = cost_model.decide(RS, h200, 2, 32768, 8192, 28672, bf16)
    assert above.estimated and above.path == "fused_split" and "above the range" in above.reason
    similar = cost_model.decide(RS, h200, 2, 16384, 5120, 4096, bf16)
    assert similar.estimated and similar.path == "fused_split" and "a seed" in similar.reason
    assert cost_model.split_config(h200, 2, 16384, 5120, 4096, bf16) == 0  # the similar row's configuration
    # What the pass weighs comes from the seed too, until the shape is measured.
    assert cost_model.saving_ms(RS, h200, 2, 16384, 5120, 4096, bf16, "fused_split") > 0
    cost_model.add_calibrated_row(h200, 2, {"op": RS, "m": 16384, "k": 5120, "n": 4096, "dtype": "bfloat16",
                                            "choice": "fused", "sequential_ms": 1.0, "fused_ms": 0.8,
                                            "fused_split_ms": 0.9, "split_config": 2})
    measured = cost_model.decide(RS, h200, 2, 16384, 5120, 4096, bf16)
    assert (measured.path, measured.estimated) == ("fused", False) and "calibrated" in measured.reason
    assert cost_model.split_config(h200, 2, 16384, 5120, 4096, bf16) == 2
    assert cost_model.saving_ms(RS, h200, 2, 16384, 5120, 4096, bf16, "fused_split") == pytest.approx(0.1)
    # The table's own rows are not overridden by a calibrated row of their shape.
    cost_model.add_calibrated_row(h200, 2, {"op": RS, "m": 4096, "k": 8192, "n": 8192, "dtype": "bfloat16",
                                            "sequential_ms": 1.0, "fused_ms": 2.0, "split_config": 2})
    assert cost_model.decide(RS, h200, 2, 4096, 8192, 8192, bf16).path == "fused_split"


def test_split_configuration_kept_where_it_wins_ties_by_k():
    assert calibration._split_config({"0": 1.0, "2": 0.9}) == 2
    assert calibration._split_config({"0": 0.9, "2": 1.0}, 4096) == 0
    assert calibration._split_config({"0": 0.9}, 4096) == 0
    # Within MIN_GAIN: ping-pong below SPLIT_SHORT_K per rank, cooperative from it on (and where K is not given).
    for k_per_rank, kept in ((4096, 2), (8191, 2), (8192, 0), (24576, 0), (None, 0)):
        assert calibration._split_config({"0": 1.0, "2": 0.995}, k_per_rank) == kept, k_per_rank
        assert calibration._split_config({"0": 0.995, "2": 1.0}, k_per_rank) == kept, k_per_rank
    assert calibration._fold({"sequential": 2.0, "fused_split@0": 1.0, "fused_split@2": 0.995}, 4096)[0] == {
        "sequential": 2.0, "fused_split": 0.995}
    with pytest.raises(ValueError, match="per configuration"):
        calibration._fold({"fused@2": 1.0})


def test_split_veto_uses_the_roofline_without_a_table():
    assert cost_model.split_all_reduce_veto(H100, 2, 64, 8192, 8192, torch.bfloat16) is not None
    assert cost_model.split_all_reduce_veto(H100, 2, 16384, 28672, 8192, torch.bfloat16) is None


# ---------------------------------------------------------------------------------------------------
# Measurement on 2 gloo ranks.
# ---------------------------------------------------------------------------------------------------


def _sleeper(seconds: float, calls: list, name: str):
    def run():
        calls.append(name)
        time.sleep(seconds)

    return run


def _measure_job(rank, world, cache, fused_s, prewrite_rank):
    import torch.distributed as dist

    from fluxinductor import calibration, settings

    if prewrite_rank >= 0:  # a cache folder per rank, as on two hosts (or one read before the other wrote)
        cache = os.path.join(cache, f"rank{rank}")
    settings.set_tuning(calibration_dir=cache)
    group_name = dist.group.WORLD.group_name
    device = torch.device("cpu")
    if prewrite_rank == rank:  # a cache only this rank has: the ranks must still agree (all measure)
        os.makedirs(cache, exist_ok=True)
        with open(calibration.cache_path("cpu", world), "w") as f:
            json.dump({"format": 1, "entries": [{"op": RS, "m": 64, "k": 32, "n": 16, "dtype": "float32",
                                                 "sequential_ms": 1.0, "fused_ms": 50.0}]}, f)
    calls: list = []
    candidates = {"sequential": _sleeper(0.02, calls, "sequential"), "fused": _sleeper(fused_s, calls, "fused")}
    first = calibration.choose_measured(RS, device, group_name, world, 64, 32, 16, torch.float32, candidates)
    measured_calls = len(calls)
    dist.barrier()
    calibration.forget()  # a new process: only the disk cache is left
    again = calibration.choose_measured(RS, device, group_name, world, 64, 32, 16, torch.float32, candidates)
    return first, again, measured_calls, len(calls) - measured_calls, cost_model.decide(
        RS, "cpu", world, 64, 32, 16, torch.float32).estimated


@pytest.mark.parametrize("fused_s, expected", [(0.005, "fused"), (0.04, "sequential")])
def test_ranks_measure_once_agree_and_reuse_the_disk_cache(tmp_path, fused_s, expected):
    results = run_ranks(_measure_job, 2, str(tmp_path), fused_s, -1, timeout=120)
    for (path, reason), (path2, _), measured, reread, _ in results:
        assert path == expected and path2 == expected, reason
        assert measured == 2 * (1 + calibration.ROUNDS)  # one warm-up and ROUNDS timed calls per candidate
        assert reread == 0  # the cached times, agreed, and nothing run
    with open(calibration.cache_path("cpu", 2).replace(calibration.cache_dir(), str(tmp_path))) as f:
        (row,) = json.load(f)["entries"]
    assert row["choice"] == expected and row["sequential_ms"] > 15
    # what the first call's measurement cost: every warm-up and timed call of both candidates, and the agreement
    calls_s = (1 + calibration.ROUNDS) * (0.02 + fused_s)
    assert calls_s <= row["calibration_s"] < calls_s + 30


def test_a_cache_on_one_rank_only_makes_both_measure(tmp_path):
    results = run_ranks(_measure_job, 2, str(tmp_path), 0.005, 1, timeout=120)
    for (path, reason), _, measured, _, _ in results:
        assert path == "fused", reason  # rank 1's stale "fused 50 ms" was not believed
        assert measured == 2 * (1 + calibration.ROUNDS)


def _rates_job(rank, world, cache):
    import torch.distributed as dist

    from fluxinductor import calibration, settings

    settings.set_tuning(calibration_dir=cache)
    group_name = dist.group.WORLD.group_name
    first = calibration.ensure_rates(torch.device("cpu"), group_name, world)
    dist.barrier()
    calibration.forget()  # a new process: only the disk cache is left
    again = calibration.ensure_rates(torch.device("cpu"), group_name, world)
    return first.source, again.source, (first.matmul_tflops, first.link_gbps, first.latency_ms), (
        again.matmul_tflops, again.link_gbps, again.latency_ms)


def test_rates_are_measured_once_with_their_cost_and_read_back(tmp_path):
    results = run_ranks(_rates_job, 2, str(tmp_path), timeout=120)
    for first, again, measured, reread in results:
        assert (first, again) == ("measured", "measured (cached)")
        assert all(v > 0 for v in measured) and reread == pytest.approx(measured)
    assert results[0][2] == results[1][2]  # agreed: the slowest rank's numbers on both
    with open(calibration.cache_path("cpu", 2).replace(calibration.cache_dir(), str(tmp_path))) as f:
        rates = json.load(f)["rates"]
    assert 0 < rates["measured_s"] < 60 and rates["matmul_tflops"] == pytest.approx(results[0][2][0])


def _dispatch_job(rank, world, cache, fused_s):
    import torch.distributed as dist

    from fluxinductor import calibration, dispatch, settings

    settings.set_tuning(calibration_dir=cache)
    dispatch._device_name.cache_clear()
    dispatch._device_name = lambda index: H100  # the CPU stands in for an H100 with no table
    calibration._device_name = lambda device: H100
    # The rate probes run (and are agreed and cached), but report an H100's numbers: gloo on a CPU is no NVLink.
    calibration._measure_rates = lambda device, group, world, timer: [700.0 + rank, 200.0, 0.04]
    calls: list = []

    def run_path(path):
        return _sleeper(0.03 if path == "sequential" else fused_s, calls, path)

    device = torch.device("cpu")
    group_name = dist.group.WORLD.group_name
    big = dispatch._cost_model_says(AG, device, world, 16384, 8192, 28672, torch.bfloat16, group_name=group_name,
                                    run_path=run_path)
    n_big = len(calls)
    small = dispatch._cost_model_says(AG, device, world, 64, 8192, 28672, torch.bfloat16, group_name=group_name,
                                      run_path=run_path)
    rates = cost_model.rates_for(H100, world)
    return (big, n_big, small, len(calls) - n_big, (rates.source, rates.matmul_tflops),
            os.path.exists(calibration.cache_path(H100, world)))


def _split_configs_job(rank, world, cache, device_name, shape):
    import torch.distributed as dist

    from fluxinductor import calibration, dispatch, settings

    settings.set_tuning(calibration_dir=cache)
    dispatch._device_name.cache_clear()
    dispatch._device_name = lambda index: device_name
    calibration._device_name = lambda device: device_name
    calibration._measure_rates = lambda device, group, world, timer: [700.0, 200.0, 0.04]
    calls: list = []
    seconds = {"sequential": 0.05, "fused": 0.045, "fused_copy": 0.045, calibration.split_candidate(0): 0.04,
               calibration.split_candidate(2): 0.02}

    def run_path(path):
        return _sleeper(seconds[path], calls, path)

    device = torch.device("cpu")
    estimate = cost_model.decide(RS, device_name, world, *shape, torch.bfloat16)
    path, reason = dispatch._cost_model_says(RS, device, world, *shape, torch.bfloat16,
                                             fused_eligible=True, split_eligible=True,
                                             group_name=dist.group.WORLD.group_name, run_path=run_path,
                                             split_configs=(0, 2))
    dist.barrier()  # rank 0 writes the cache
    with open(calibration.cache_path(device_name, world)) as f:
        (row,) = json.load(f)["entries"]
    assert estimate.estimated, estimate
    return path, reason, sorted(set(calls)), cost_model.split_config(device_name, world, *shape, torch.bfloat16), row


@pytest.mark.parametrize("device_name, shape", [
    (H100, (16384, 8192, 28672)),  # no table: the roofline's estimate
    ("NVIDIA H200", (16384, 5120, 4096)),  # the packaged table's similar row (configuration 0) seeds it
])
def test_calibration_times_each_split_configuration_and_keeps_the_fastest(tmp_path, device_name, shape):
    results = run_ranks(_split_configs_job, 2, str(tmp_path), device_name, shape, timeout=180)
    for path, reason, called, config, row in results:
        assert path == "fused_split" and "fused_split@2" in reason, reason
        assert called == ["fused", "fused_copy", "fused_split@0", "fused_split@2", "sequential"]
        assert config == 2  # the dispatcher runs the faster configuration
        assert row["split_config"] == 2 and row["choice"] == "fused_split"
        assert row["fused_split_ms"] == pytest.approx(row["fused_split_config_ms"]["2"])
        assert row["fused_split_config_ms"]["0"] > row["fused_split_ms"]


@pytest.mark.parametrize("fused_s, expected", [(0.01, "fused"), (0.05, "sequential")])
def test_dispatcher_measures_where_the_roofline_leaves_a_fused_path(tmp_path, fused_s, expected):
    results = run_ranks(_dispatch_job, 2, str(tmp_path), fused_s, timeout=180)
    for (big, why_big), n_big, (small, why_small), n_small, source, cached in results:
        assert big == expected and why_big.startswith(f"calibration chose {expected}"), why_big
        assert n_big == 2 * (1 + calibration.ROUNDS)
        # Decode-sized: the roofline with the measured rates rules the fused path out; nothing is timed.
        assert small == "sequential" and "roofline (measured" in why_small and n_small == 0, why_small
        assert source == ("measured", 700.0) and cached  # the slowest rank's rates, on every rank
