"""Run examples/sp_transformer_block.py as a user would (a subprocess, 2 CPU ranks) and check its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "sp_transformer_block.py")


def _run_example(disabled: bool) -> dict:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["FLUXINDUCTOR_DISABLE"] = "1" if disabled else "0"
    with tempfile.TemporaryDirectory(prefix="fluxinductor-example-cache-") as cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        proc = subprocess.run(
            [sys.executable, EXAMPLE], env=env, capture_output=True, text=True, timeout=300, check=False
        )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"example exited with {proc.returncode}:\n{output[-6000:]}"
    result_lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(result_lines) == 1, f"expected one RESULT line:\n{output[-6000:]}"
    result = json.loads(result_lines[0][len("RESULT ") :])
    result["stdout"] = proc.stdout
    result["stderr"] = proc.stderr
    return result


@pytest.mark.parametrize("disabled", [False, True], ids=["flux", "FLUXINDUCTOR_DISABLE=1"])
def test_example_runs_and_reports(disabled):
    result = _run_example(disabled)
    assert result["ok"], result["stdout"]
    assert result["world"] == 2 and result["device"] == "cpu" and result["dtype"] == "float32"
    for what, err in result["max_error"].items():
        assert err <= 1e-5, f"{what}: {err}"
    # No noise around the output: no deprecation warning from the ops' decomposition, no NumPy complaint.
    for noise in ("FutureWarning", "DeprecationWarning", "Failed to initialize NumPy"):
        assert noise not in result["stdout"] + result["stderr"], result["stderr"][-4000:]
    assert "fused while compiling the forward" in result["stdout"]
    assert "fused while compiling the backward" in result["stdout"]
    if disabled:
        assert result["fluxinductor_disabled"]
        assert result["fused_forward"] == {} and result["fused_backward"] == {}, result["stdout"]
        assert result["decomposed_calls"] == {}, result["stdout"]
        assert "fused while compiling the forward: nothing" in result["stdout"]
    else:
        assert sum(result["fused_forward"].values()) >= 2, result["stdout"]
        assert sum(result["fused_backward"].values()) >= 2, result["stdout"]
        # Both patterns, in both graphs, and the fused ops really ran (on CPU every call is decomposed).
        for phase in ("fused_forward", "fused_backward"):
            assert set(result[phase]) == {"all_gather_matmul", "matmul_reduce_scatter"}, result["stdout"]
        calls = result["decomposed_calls"]
        assert set(calls) == {"all_gather_matmul", "matmul_reduce_scatter"} and min(calls.values()) > 0, calls
