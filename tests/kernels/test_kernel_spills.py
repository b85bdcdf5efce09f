"""The AG+GEMM and GEMM+RS kernels that run by default compile without register spills.

AG+GEMM: variant 0 (128x256 tiles, every shape but one) and variant 6 (256x160, the 4096 x 14336 per-rank problem).
GEMM+RS: the split transport's peer and own GEMMs (cooperative 128x256 and ping-pong 128x192, both weight layouts,
bf16 and fp16) and the fused transports' ping-pong 128x128 kernels.  The split transport's relay GEMM (more than two
ranks) is left out: its ping-pong 128x192 kernel, source C plus the per-tile count, still spills 24 bytes.

Their consumer warp groups hold large fp32 accumulators, which leaves ptxas little room, and their producer warps run
in 40 registers (where the AG+GEMM's also stores the A tiles it loads): one `__trap()` in the tile wait's timeout path
made variant 6 spill 1.3 KB and run 4.7x slower on 2xH200, and variant 0 spill 32-44
bytes, unseen by every correctness test (docs/design_ag_gemm.md); in the split own GEMM's ping-pong 128x192 kernel
(192 accumulator registers per math thread of 232), the band wait's code in the tile scheduler, run by every warp
group, made it spill 82 bytes until the waits moved into the producer warps' loads (gemm_rs/split.cuh).  This
compiles their translation units as the build does (CMakeLists.txt's flags) with ptxas's report and fails on any
spill, and on any kernel whose wgmma ptxas serialized.  Needs nvcc (CI's machine has it) and the nvidia-cutlass
headers (the test extras install the wheel)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

UNITS = [
    "ag_gemm/instances_bf16.cu",
    "ag_gemm/instances_bf16_256x160.cu",
    "gemm_rs/split_own.cu",
    "gemm_rs/split_peer.cu",
    "gemm_rs/gemm_rs.cu",
]


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isdir(path) else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.skipif(_cutlass_include() is None, reason="the nvidia-cutlass wheel's headers are not installed")
@pytest.mark.parametrize("unit", UNITS)
def test_default_kernels_have_no_spills(unit, tmp_path):
    cmd = ["nvcc", "-std=c++17", "-O3", "-DNDEBUG", "-arch=sm_90a", "--expt-relaxed-constexpr",
           "--expt-extended-lambda", "-lineinfo", "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1", "-I", os.path.join(ROOT, "csrc"),
           "-I", os.path.join(ROOT, "csrc", "include"), "-I", _cutlass_include(), "-Xptxas=-v",
           "-c", os.path.join(ROOT, "csrc", unit), "-o", str(tmp_path / "unit.o")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    report = run.stdout + run.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, "ptxas printed no spill report:\n" + report[-2000:]
    assert all(s == ("0", "0") for s in spills), f"a kernel of csrc/{unit} spills registers:\n" + report[-3000:]
    # ptxas serializes a kernel's wgmma (waits for each before the next) where a call crosses the wgmma pipeline, as
    # the device assert's call does in a build without NDEBUG.
    serialized = [line for line in report.splitlines() if "wgmma.mma_async instructions are serialized" in line]
    assert not serialized, f"ptxas serialized the wgmma of a kernel of csrc/{unit}:\n" + serialized[0][:2000]
