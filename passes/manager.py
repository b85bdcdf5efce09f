"""The pass manager inductor calls on every post-grad graph (forward and backward)."""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


class FluxPassManager(CustomGraphPass):
    """Runs fluxinductor's rewrites on a post-grad FX graph, in this order:

    1. ``all_gather_matmul``: ``all_gather -> mm`` (and the reshape/split/cat forms) into
       ``fluxinductor.all_gather_matmul``.  Runs first so a gathered tensor feeding several matmuls is
       fused once with all of them.
    2. ``matmul_reduce_scatter``: ``mm -> reduce_scatter`` into ``fluxinductor.matmul_reduce_scatter``.

    ``tp_group_names`` (a snapshot taken when the model is compiled) restricts both to those process
    groups; ``None`` allows every group.  The uuid covers the passes' source and these settings, so
    inductor's FX graph cache never returns a graph rewritten by other code or settings.
    """

    def __init__(self, tp_group_names: Optional[frozenset] = None, fuse_matmul_sums: Optional[bool] = None):
        from fluxinductor import config

        self.tp_group_names = tp_group_names
        self.fuse_matmul_sums = config.fuse_matmul_sums() if fuse_matmul_sums is None else fuse_matmul_sums

    def group_allowed(self, group_name: str) -> bool:
        return self.tp_group_names is None or group_name in self.tp_group_names

    def __call__(self, graph: torch.fx.Graph) -> None:
        from fluxinductor.passes.all_gather_matmul import fuse_all_gather_matmul
        from fluxinductor.passes.matmul_reduce_scatter import fuse_matmul_reduce_scatter

        fuse_all_gather_matmul(graph, self.group_allowed)
        fuse_matmul_reduce_scatter(graph, self.group_allowed, fuse_sums=self.fuse_matmul_sums)
        graph.lint()

    def uuid(self) -> bytes:
        import fluxinductor.ops

        here = os.path.dirname(os.path.abspath(__file__))
        # The passes, and the ops they emit (their schemas and fake implementations shape the graph).
        sources = [os.path.join(here, name) for name in sorted(os.listdir(here)) if name.endswith(".py")]
        sources.append(fluxinductor.ops.__file__)
        digest = hashlib.sha256()
        for path in sources:
            with open(path, "rb") as f:
                digest.update(os.path.basename(path).encode() + b"\0" + f.read())
        groups = "*" if self.tp_group_names is None else ",".join(sorted(self.tp_group_names))
        digest.update(f"tp_groups={groups};fuse_matmul_sums={self.fuse_matmul_sums}".encode())
        return digest.digest()

