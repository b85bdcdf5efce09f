"""The peer check's NVML queries on a real GPU (fluxinductor/kernels/peers.py; tests/kernels/test_peers.py has the logic).

The bus id that CUDA reports through torch must name the same GPU in NVML, or every group would fall back with
"NVML does not see the GPU".  Where two GPUs are visible, NVML must answer for the pair.  The two-rank verdict is
checked on 2 GPUs by tests/gpu/run_ag_gemm_2rank.py.
"""

from __future__ import annotations

import pytest
import torch

from fluxinductor.kernels import peers


@pytest.mark.gpu
def test_nvml_finds_each_visible_gpu_by_the_bus_id_cuda_reports():
    bus_ids = [peers.identity(torch.device("cuda", i)).bus_id for i in range(torch.cuda.device_count())]
    assert len(set(bus_ids)) == len(bus_ids), bus_ids
    for bus in bus_ids:
        linked, detail = peers.nvml_nvlink(bus, bus)  # NVML found the GPU and answered (a GPU is no peer of itself)
        assert linked is not None, detail
    for i in range(1, len(bus_ids)):
        linked, detail = peers.nvml_nvlink(bus_ids[0], bus_ids[i])
        assert linked is not None, detail
        if linked:  # NVLink implies peer access
            assert torch.cuda.can_device_access_peer(0, i)


@pytest.mark.gpu
def test_nvlink_peer_count_agrees_with_the_pair_queries():
    """The compile-time check (``local_nvlink_reason``) counts what the group's check asks pair by pair: every visible
    GPU NVLinked to GPU 0 is among the host's NVLink peers NVML counts for it."""
    bus_ids = [peers.identity(torch.device("cuda", i)).bus_id for i in range(torch.cuda.device_count())]
    count, detail = peers.nvml_nvlink_peers(bus_ids[0])
    assert count is not None, detail
    linked = sum(bool(peers.nvml_nvlink(bus_ids[0], bus)[0]) for bus in bus_ids[1:])
    assert count >= linked, detail
    assert (peers.local_nvlink_reason(torch.device("cuda", 0)) is None) == (count > 0)


@pytest.mark.gpu
def test_identity_names_this_host():
    ident = peers.identity(torch.device("cuda", 0))
    import socket

    assert ident.host.split("/")[0] == socket.gethostname()
    assert len(ident.host.split("/")[1]) > 8  # the boot id was read


def _verdict_on_one_gpu(rank, world):
    import torch.distributed as dist

    from fluxinductor.kernels import peers

    device = torch.device("cuda", 0)
    return peers.group_reason(dist.group.WORLD.group_name, device), peers.identity(device).bus_id


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_decompose_alike():
    """Two gloo ranks on GPU 0, with the real identities and NVML: both refuse the group for the shared GPU (the
    kernels' flags and buffers would collide)."""
    from tests._dist import run_ranks

    (v0, bus), (v1, _) = run_ranks(_verdict_on_one_gpu, 2, timeout=120)
    assert v0 == v1 == f"ranks 0 and 1 share the GPU at {bus}"
