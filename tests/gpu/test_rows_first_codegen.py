"""The rows-first rewrite of batch-first sequence-parallel activations, compiled for a GPU (triton), on one GPU.

A sequence-parallel MLP block on [B, S, H] sharded on S with B = 4 is compiled with ``backend="flux"`` in a process
whose default group is torch's fake process group of 2 ranks (its collectives do nothing, so only the generated
code is checked, not numbers).  Both ops run batch-major (each rank's blocks of 256 rows are whole tiles: dim 1, on
the tensors as they are); the triton kernel computing gelu must read the all-gather's result and write the
reduce-scatter's operand, and the residual add must read the reduce-scatter's result, with no copy kernel: the
check of tests/compile/test_compile_features.py on CPU, where shards of a few rows run both ops rows-first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _compile_and_report() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import fluxinductor
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Block(nn.Module):
        def __init__(self, hidden: int, ffn: int):
            super().__init__()
            self.w1, self.w2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

        def forward(self, x):
            return x + self.w2(F.gelu(self.w1(x)))

    mesh = init_device_mesh("cuda", (2,))
    model = Block(1024, 4096).to("cuda", torch.bfloat16)
    parallelize_module(model, mesh, {
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    x = DTensor.from_local(torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16), mesh, [Shard(1)])
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(model, backend="flux"), x)
    return {"code": codes[0], "fused": fluxinductor.rewrite_stats()["fused"]}


def test_rows_first_layout_is_fused_into_triton_kernels():
    from _codegen import check_rows_first_mlp  # tests/ (conftest puts it on sys.path; not in the child)

    env = dict(os.environ, FLUXINDUCTOR_DISPATCH="decomposed")  # rewrite every match; run without kernels
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["fused"] == {"all_gather_matmul": 1, "matmul_reduce_scatter": 1}, report["fused"]
    # S/w = 256 rows, whole tiles: both ops run batch-major on the tensors as they are.  The only kernels: the gelu,
    # the row-parallel bias divided by the world size (each rank adds its share before the sum) and the add.
    calls = check_rows_first_mlp(report["code"], gather_dim=1, scatter_dim=1)
    assert all(name.startswith("triton_") for name, _ in calls) and len(calls) == 3, calls
    assert any("div" in name for name, _ in calls), calls


if __name__ == "__main__":
    print(json.dumps(_compile_and_report()))
