"""fluxinductor.settings: the environment is read and checked once, bad values name the variable and the accepted
values, tuning is validated when set, every setting reaches the pass manager's cache key, and docs/settings.md is
what the module generates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fluxinductor import settings

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def environment(monkeypatch):
    """Set FLUXINDUCTOR_* variables and read them again (settings.reload); the settings in force before are back
    after the test."""
    for name in list(os.environ):
        if name.startswith(settings.PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings, "current", settings.current)
    monkeypatch.setattr(settings, "tuning", settings.tuning)
    monkeypatch.setattr(settings, "_cuda_graphs_compiled", settings._cuda_graphs_compiled)

    def read(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(settings.env_var(name), value)
        return settings.reload()

    return read


def test_exactly_six_user_environment_variables():
    assert settings.ENV_VARS == ("FLUXINDUCTOR_DISABLE", "FLUXINDUCTOR_LOG", "FLUXINDUCTOR_DISPATCH",
                                 "FLUXINDUCTOR_TUNING_DIR", "FLUXINDUCTOR_TIMEOUT_S", "FLUXINDUCTOR_ASSUME_NVLINK")


def test_defaults(environment):
    current = environment()
    assert (current.disable, current.log, current.dispatch, current.tuning_dir, current.timeout_s,
            current.assume_nvlink) == (False, False, "auto", None, 10.0, False)
    assert (current.split_all_reduce, current.fuse_matmul_sums, current.cuda_graphs) == ("exact", True, True)


@pytest.mark.parametrize("value, disabled", [("1", True), ("true", True), ("YES", True), ("on", True), (" 1 ", True),
                                             ("0", False), ("false", False), ("no", False), ("Off", False),
                                             ("", False)])
def test_disable_parsing(environment, value, disabled):
    """FLUXINDUCTOR_DISABLE=false / no / off / 0 / empty mean fluxinductor is on."""
    assert environment(disable=value).disable is disabled


@pytest.mark.parametrize("name, value, message", [
    ("disable", "maybe", r"FLUXINDUCTOR_DISABLE='maybe': expected one of 1/true/yes/on \(on\) or 0/false/no/off"),
    ("log", "2", r"FLUXINDUCTOR_LOG='2': expected one of 1/true/yes/on"),
    ("dispatch", "bogus", r"FLUXINDUCTOR_DISPATCH='bogus': expected one of auto, fused, decomposed"),
    ("timeout_s", "soon", r"FLUXINDUCTOR_TIMEOUT_S='soon': expected a number >= 0.001"),
    ("timeout_s", "0", r"FLUXINDUCTOR_TIMEOUT_S='0': expected a number >= 0.001"),
    ("assume_nvlink", "sure", r"FLUXINDUCTOR_ASSUME_NVLINK='sure': expected one of"),
])
def test_bad_value_raises_at_reload_naming_the_variable(environment, name, value, message):
    before = settings.current
    with pytest.raises(settings.SettingsError, match=message):
        environment(**{name: value})
    assert settings.current is before  # nothing changed


def test_bad_value_raises_at_import():
    """FLUXINDUCTOR_DISPATCH=bogus is an error when fluxinductor is imported, not at the first fused call."""
    env = dict(os.environ, FLUXINDUCTOR_DISPATCH="bogus")
    out = subprocess.run([sys.executable, "-c", "import fluxinductor"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert "SettingsError: FLUXINDUCTOR_DISPATCH='bogus': expected one of auto, fused, decomposed" in out.stderr


def test_values_are_normalized(environment):
    current = environment(dispatch=" Fused ", timeout_s="2.5", tuning_dir="/tmp/tables", log="on")
    assert (current.dispatch, current.timeout_s, current.tuning_dir, current.log) == ("fused", 2.5, "/tmp/tables",
                                                                                       True)
    assert environment(dispatch="").dispatch == "auto"


def test_variables_no_longer_read_are_reported(environment, monkeypatch):
    monkeypatch.setenv("FLUXINDUCTOR_AG_VARIANT", "5")
    monkeypatch.setenv("FLUXINDUCTOR_CUDA_GRAPHS", "1")
    monkeypatch.setenv("FLUXINDUCTOR_AG_ARRIVAL", "0")
    monkeypatch.setenv("FLUXINDUCTOR_BUILD_JOBS", "2")  # setup.py's: not reported
    with pytest.warns(UserWarning) as caught:
        environment()
    message = str(caught[0].message)
    assert "FLUXINDUCTOR_AG_VARIANT (now fluxinductor.settings.set_tuning(ag_variant=...))" in message
    assert "FLUXINDUCTOR_CUDA_GRAPHS (now the torch.compile option 'cuda_graphs'" in message
    assert "FLUXINDUCTOR_AG_ARRIVAL" in message and "BUILD_JOBS" not in message


def test_configure_and_override(environment):
    environment()
    settings.configure(split_all_reduce="replicated", fuse_matmul_sums="0")
    assert (settings.current.split_all_reduce, settings.current.fuse_matmul_sums) == ("replicated", False)
    with settings.override(dispatch="decomposed", ag_variant=6):
        assert settings.current.dispatch == "decomposed" and settings.tuning.ag_variant == 6
        assert settings.current.split_all_reduce == "replicated"
    assert settings.current.dispatch == "auto" and settings.tuning.ag_variant is None
    with pytest.raises(settings.SettingsError, match="unknown setting 'dispatch_mode'; expected one of disable"):
        settings.configure(dispatch_mode="fused")
    with pytest.raises(settings.SettingsError, match="fuse_matmul_sums='sometimes'"):
        settings.configure(fuse_matmul_sums="sometimes")


def test_set_tuning_validation(environment):
    environment()
    tuning = settings.set_tuning(ag_variant="5", gemm_rs_push="copy", gemm_rs_bands=8, asynctp="1",
                                 gemm_rs_swizzle=None, peer_check_timeout_s="30")
    assert tuning is settings.tuning
    assert (tuning.ag_variant, tuning.gemm_rs_push, tuning.gemm_rs_bands, tuning.asynctp, tuning.gemm_rs_swizzle,
            tuning.peer_check_timeout_s) == (5, "copy", 8, True, None, 30.0)
    settings.set_tuning(ag_variant="none")
    assert settings.tuning.ag_variant is None and settings.tuning.gemm_rs_push == "copy"  # the others stay
    for kw, message in [(dict(ag_varient=5), r"unknown tuning field 'ag_varient'; expected one of ag_variant"),
                        (dict(ag_variant=8), r"ag_variant=8: expected one of 0, 1, 2, 3, 4, 5, 6, 7"),
                        (dict(gemm_rs_push="pigeon"), r"gemm_rs_push='pigeon': expected one of store, copy, split"),
                        (dict(gemm_rs_bands=33), r"gemm_rs_bands=33: expected an integer \[1, 32\]"),
                        (dict(ag_chunks=1.5), r"ag_chunks=1.5: expected an integer"),
                        (dict(gemm_rs_swizzle=3), r"gemm_rs_swizzle=3: expected one of 1, 2, 4, 8"),
                        (dict(asynctp="perhaps"), r"asynctp='perhaps'")]:
        before = settings.tuning
        with pytest.raises(settings.SettingsError, match=message):
            settings.set_tuning(**kw)
        assert settings.tuning is before


def test_parse_tuning():
    assert settings.parse_tuning("ag_variant=5, gemm_rs_push=copy,") == {"ag_variant": "5", "gemm_rs_push": "copy"}
    assert settings.parse_tuning("") == {}
    with pytest.raises(settings.SettingsError, match="--tuning item 'ag_variant': expected key=value"):
        settings.parse_tuning("ag_variant")
    with pytest.raises(settings.SettingsError, match="unknown tuning field 'bogus'"):
        settings.parse_tuning("bogus=1")


def test_tuning_hash_is_its_values():
    """The kernels key per-launch caches by the tuning object: equal values hash and compare equal."""
    a, b = settings.Tuning(ag_variant=5), settings.Tuning(ag_variant=5)
    assert hash(a) == hash(b) and a == b and a != settings.Tuning()


@pytest.mark.parametrize("change", [dict(dispatch="fused"), dict(tuning_dir="/elsewhere"), dict(timeout_s=3),
                                    dict(split_all_reduce="replicated"), dict(fuse_matmul_sums=False),
                                    dict(cuda_graphs=False), dict(ag_variant=5), dict(gemm_rs_push="split"),
                                    dict(asynctp=True)])
def test_uuid_changes_when_a_setting_changes(environment, change):
    from fluxinductor.passes import FluxPassManager

    environment()
    before_hash, before_uuid = settings.compute_hash(), FluxPassManager().uuid()
    with settings.override(**change):
        assert settings.compute_hash() != before_hash
        assert FluxPassManager().uuid() != before_uuid
    assert settings.compute_hash() == before_hash and FluxPassManager().uuid() == before_uuid


def test_uuid_changes_with_the_tp_group(environment):
    from fluxinductor.passes import FluxPassManager

    environment()
    before = settings.compute_hash()
    try:
        settings.set_tp_group("tp")
        assert settings.compute_hash() != before and settings.tp_group_names() == frozenset({"tp"})
        assert settings.group_allowed("tp") and not settings.group_allowed("dp")
        assert FluxPassManager(frozenset({"tp"})).uuid() != FluxPassManager(None).uuid()
    finally:
        settings.set_tp_group(None)
    assert settings.compute_hash() == before


def test_docs_settings_md_is_up_to_date():
    """docs/settings.md is `python -m fluxinductor.settings --markdown`'s output (regenerate it with that)."""
    with open(os.path.join(_ROOT, "docs", "settings.md")) as f:
        assert f.read() == settings.markdown()
    out = subprocess.run([sys.executable, "-m", "fluxinductor.settings", "--markdown"], capture_output=True, text=True,
                         timeout=300, cwd=_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == settings.markdown()


def test_docs_cover_every_knob():
    text = settings.markdown()
    for name in settings.ENV_VARS + tuple(settings.BUILD_ENV_VARS):
        assert f"`{name}`" in text
    for name in settings.COMPILE_OPTIONS:
        assert f"`{name}`" in text
    for field in settings.dataclasses.fields(settings.Tuning):
        assert f"`{field.name}`" in text
