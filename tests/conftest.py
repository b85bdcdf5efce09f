"""Shared test set-up.

* Every test process gets its own empty ``TORCHINDUCTOR_CACHE_DIR``, so no test is served a graph an
  earlier run compiled (the multi-rank jobs of ``tests/_dist.py`` get a fresh one per job as well).
* ``tests/`` is on ``sys.path`` so the tests in every folder below it import the shared helpers (``_dist``,
  ``_pass_graphs``, ``_codegen``, ``_llama_tp``) by name.  pytest puts each test module's own folder there too, and
  spawned ranks inherit the path, so they import the test modules by name (basenames are unique across folders).
* Tests marked ``gpu`` skip, with the reason shown, where CUDA is not available.
* The dispatcher's remembered decisions (``fluxinductor.dispatch._plans``) are forgotten before each test: tests
  replace its pieces (cost model, kernel module) with fakes, and a decision made with one test's fakes must not
  serve the next.
* ``flux_settings(**fields)`` (a fixture) sets fields of ``fluxinductor.settings.current`` and ``.tuning`` for one
  test; both are put back after it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

_CACHE_DIR = tempfile.mkdtemp(prefix="fluxinductor-pytest-cache-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE_DIR
# The tests run several single-threaded ranks side by side on a small machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Scalar C++ kernels compile ~4x faster (no vectorized ATen headers); the tests check graphs and ops.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


@pytest.fixture(autouse=True)
def _fresh_dispatch_decisions():
    from fluxinductor import dispatch

    dispatch.clear_plans()
    yield


@pytest.fixture
def flux_settings(monkeypatch):
    """``flux_settings(dispatch="fused", ag_variant=5, ...)``: fluxinductor's settings for this test only (user
    settings and tuning fields alike, validated as :func:`fluxinductor.settings.override` does)."""
    from fluxinductor import settings

    # monkeypatch restores the objects these names hold now; the calls below only replace them.
    monkeypatch.setattr(settings, "current", settings.current)
    monkeypatch.setattr(settings, "tuning", settings.tuning)
    user_fields = {f.name for f in dataclasses.fields(settings.Settings)}

    def apply(**values):
        settings.configure(**{k: v for k, v in values.items() if k in user_fields})
        settings.set_tuning(**{k: v for k, v in values.items() if k not in user_fields})

    return apply


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest hook signature
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest hook signature
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is available on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker: every test under tests/gpu/ has "gpu" keywords
            item.add_marker(skip_gpu)
