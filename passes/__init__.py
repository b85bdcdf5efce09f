"""fluxinductor's FX graph passes (installed as ``fluxinductor.passes``).

One rewrite per file; :class:`FluxPassManager` runs them in a stated order as inductor's
``post_grad_custom_post_pass``.  The graph invariants every pass keeps are in README.md beside this file.
"""

from fluxinductor.passes.manager import FluxPassManager

__all__ = ["FluxPassManager"]
