"""fluxinductor: compute/communication overlap for unmodified tensor-parallel models.

``torch.compile(model, backend="flux")`` rewrites every ``all_gather -> matmul`` and
``matmul -> reduce_scatter`` of the traced forward and backward graphs into fused ops
(``torch.ops.fluxinductor.*``) that run fused GPU kernels where they win and a correct decomposition
everywhere else.
"""

from fluxinductor import settings  # noqa: I001  (first: reads and checks the environment)
from fluxinductor import ops  # noqa: F401  (registers torch.ops.fluxinductor.*)
from fluxinductor.backend import flux_backend
from fluxinductor.log import reset_rewrite_stats, rewrite_stats
from fluxinductor.settings import set_tp_group

__all__ = ["flux_backend", "rewrite_stats", "reset_rewrite_stats", "set_tp_group", "settings"]
