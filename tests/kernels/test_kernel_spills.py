"""The AG+GEMM kernels that run by default compile without register spills: variant 0 (128x256 tiles, every shape but
one) and variant 6 (256x160, the 4096 x 14336 per-rank problem).

Their consumer warp groups hold large fp32 accumulators, which leaves ptxas little room: one `__trap()` in the tile
wait's timeout path (a8d68af) made variant 6 spill 1.3 KB and run 4.7x slower on 2xH200, and variant 0 spill 32-44
bytes, unseen by every correctness test (docs/design_ag_gemm.md).  This compiles their translation units as
the build does (CMakeLists.txt's flags) with ptxas's report and fails on any spill.  Needs nvcc (CI's machine has it)
and the nvidia-cutlass headers (the test extras install the wheel)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isdir(path) else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.skipif(_cutlass_include() is None, reason="the nvidia-cutlass wheel's headers are not installed")
@pytest.mark.parametrize("unit", ["ag_gemm/instances_bf16.cu", "ag_gemm/instances_bf16_256x160.cu"])
def test_default_ag_gemm_kernels_have_no_spills(unit, tmp_path):
    cmd = ["nvcc", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "--expt-extended-lambda",
           "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1", "-I", os.path.join(ROOT, "csrc"),
           "-I", os.path.join(ROOT, "csrc", "include"), "-I", _cutlass_include(), "-Xptxas=-v",
           "-c", os.path.join(ROOT, "csrc", unit), "-o", str(tmp_path / "unit.o")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    report = run.stdout + run.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, "ptxas printed no spill report:\n" + report[-2000:]
    assert all(s == ("0", "0") for s in spills), f"a kernel of csrc/{unit} spills registers:\n" + report[-3000:]
