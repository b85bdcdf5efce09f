"""Settings that change what the passes do.

Everything here that a pass reads is folded into the pass manager's ``uuid()`` (see
``fluxinductor.passes.manager``), so inductor's FX graph cache never serves a graph rewritten under
other settings.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Optional, Union

import torch.distributed as dist

_tp_group_names: Optional[frozenset] = None
_FS_ENCODING = sys.getfilesystemencoding()


def env(name: str, default: Optional[str] = None) -> Optional[str]:
    """``os.environ.get(name, default)`` for the settings the fused ops read at every call.  On POSIX it looks the
    name up in ``os.environ``'s own bytes mapping, which every change through ``os.environ`` updates: a miss costs
    ~0.1 us there against ~0.9 us through ``os.environ.get`` (encoding the key, raising and catching KeyError), and a
    fused call reads ten or twenty such settings."""
    data = getattr(os.environ, "_data", None)
    if os.name == "nt" or not isinstance(data, dict):  # os.environ keeps bytes keys only on POSIX
        return os.environ.get(name, default)
    value = data.get(name.encode(_FS_ENCODING, "surrogateescape"))
    return default if value is None else value.decode(_FS_ENCODING, "surrogateescape")


def disabled() -> bool:
    """``FLUXINDUCTOR_DISABLE=1``: ``backend="flux"`` compiles exactly as ``backend="inductor"``."""
    return os.environ.get("FLUXINDUCTOR_DISABLE", "0") not in ("", "0")


def fuse_matmul_sums() -> bool:
    """``FLUXINDUCTOR_FUSE_MATMUL_SUMS``: fuse ``sum_i a_i @ W_i -> reduce_scatter`` as one matmul over
    ``cat(a_i)`` and ``cat(W_i)``, which copies those activations and weights every step."""
    return os.environ.get("FLUXINDUCTOR_FUSE_MATMUL_SUMS", "1") not in ("", "0")


def split_all_reduce() -> str:
    """``FLUXINDUCTOR_SPLIT_ALL_REDUCE``: ``exact`` (the default, also ``1``) splits ``all_reduce(matmul)`` into a
    reduce-scatter fused with the matmul and an all-gather, carrying the rows sharded only through row-wise ops whose
    other operands are weights or scalars (exactly the graph's arithmetic); ``replicated`` also slices replicated
    activations of the same rows (the residual stream, a replicated gradient) to this rank's rows, which assumes they
    hold the same values on every rank, as DTensor's ``Replicate`` and tensor-parallel training do; ``0`` turns the
    split off (``fluxinductor.passes.all_reduce_split``)."""
    value = os.environ.get("FLUXINDUCTOR_SPLIT_ALL_REDUCE", "exact").strip().lower()
    if value in ("", "0", "off", "false"):
        return "off"
    if value in ("1", "exact", "on", "true"):
        return "exact"
    if value == "replicated":
        return "replicated"
    raise ValueError(f"FLUXINDUCTOR_SPLIT_ALL_REDUCE={value!r}: expected exact, replicated or 0")


def capture_kernels() -> bool:
    """``FLUXINDUCTOR_CUDA_GRAPHS=1``: the fused kernels run inside CUDA graphs (``mode="reduce-overhead"``, or
    ``torch.cuda.graph`` around a compiled model) instead of between captured partitions.  Read when fluxinductor's
    ops are registered (the ops' ``cudagraph_unsafe`` tag, which makes inductor partition the graph around them,
    follows it) and at every call under capture.  Off by default until a two-GPU run has checked the captured
    protocol across processes (the kernels' logic is checked with every rank on one GPU)."""
    return env("FLUXINDUCTOR_CUDA_GRAPHS", "0").strip() not in ("", "0")


def _group_name(group: Union[str, "dist.ProcessGroup", object]) -> str:
    if isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    # A one-dimensional DeviceMesh (e.g. mesh["tp"]).
    get_group = getattr(group, "get_group", None)
    if get_group is not None:
        return get_group().group_name
    raise TypeError(f"expected a group name, ProcessGroup or 1-D DeviceMesh, got {type(group).__name__}")


def set_tp_group(groups: Union[None, str, object, Iterable]) -> None:
    """Restrict fusion to the collectives of these process groups (the tensor-parallel group).

    ``None`` (the default) lets every group's collectives be fused.  Accepts group names,
    ``ProcessGroup`` objects, 1-D ``DeviceMesh`` objects, or an iterable of them.
    """
    global _tp_group_names
    if groups is None:
        _tp_group_names = None
        return
    if isinstance(groups, (str, dist.ProcessGroup)) or hasattr(groups, "get_group"):
        groups = [groups]
    _tp_group_names = frozenset(_group_name(g) for g in groups)


def tp_group_names() -> Optional[frozenset]:
    """The group names fusion is restricted to, or ``None`` for all groups."""
    return _tp_group_names


def group_allowed(group_name: str) -> bool:
    return _tp_group_names is None or group_name in _tp_group_names


def cache_key() -> str:
    """The settings the passes read, as a string for the pass manager's uuid."""
    names = "*" if _tp_group_names is None else ",".join(sorted(_tp_group_names))
    return f"disabled={disabled()};tp_groups={names};cuda_graphs={capture_kernels()}"
