"""fluxinductor's settings: the only place in Python that reads ``FLUXINDUCTOR_*`` environment variables.

Three kinds, each declared once below with its type, default and one line of documentation
(``python -m fluxinductor.settings --markdown`` writes ``docs/settings.md`` from these declarations):

* **User environment variables** (:data:`ENV_VARS`, six of them), read once when this module is imported into
  :data:`current`, a frozen :class:`Settings`.  A bad value raises :class:`SettingsError` there, naming the variable
  and the values it accepts.
* **Per-compile options**, ``torch.compile(model, backend="flux", options={...})`` keys (:data:`COMPILE_OPTIONS`):
  ``tp_group``, ``split_all_reduce``, ``fuse_matmul_sums``, ``cuda_graphs``.  Their process-wide defaults are fields
  of :data:`current` too, set from Python with :func:`configure` (no environment variable).
* **Kernel tuning** for developers (:class:`Tuning`, :data:`tuning`), set with :func:`set_tuning` (benchmarks and
  tools take ``--tuning key=value[,key=value]`` and call it on every rank).  Every rank must use the same tuning:
  the kernels check that the ranks agree where a disagreement would hang.

Readers on the fused ops' per-call path read ``settings.current.<field>`` / ``settings.tuning.<field>``: two
attribute lookups, no parsing.  :func:`configure`, :func:`set_tuning` and :func:`override` replace those objects
(they never mutate them), :func:`reload` reads the environment again (tests: ``monkeypatch.setenv`` then
``reload()``).  :func:`compute_hash` digests all of it for the pass manager's ``uuid()``, so inductor's FX graph
cache never serves a graph rewritten under other settings.

``cuda_graphs`` (the per-compile option and its default, on): whether the fused ops may be captured in CUDA graphs
with the rest of the graph.  Per compile, off means a compile with CUDA graphs on is left to plain inductor (no
rewrite, no partition).  What it cannot make per compile is
the run-time side: under any CUDA graph capture a fused op runs its kernels only if :func:`kernels_under_capture`
says so, and that is per process (the process-wide default, or any compile of this process that asked for
``cuda_graphs=True``); elsewhere the op decomposes while captured.  A user's own ``torch.cuda.graph`` around a
compiled model is governed by that process-wide answer alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple, Union

PREFIX = "FLUXINDUCTOR_"


class SettingsError(ValueError):
    """A setting has a value it does not accept (the message names it and the accepted values)."""


# ---------------------------------------------------------------------------------------------------
# Value parsing shared by the environment, configure() and set_tuning().
# ---------------------------------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise SettingsError(f"{name}={value!r}: expected one of {'/'.join(_TRUE)} (on) or {'/'.join(_FALSE[:-1])} or "
                        "empty (off)")


def _parse_choice(name: str, value: Any, choices: Tuple[Any, ...], aliases: Optional[Dict[str, Any]] = None) -> Any:
    if isinstance(value, str):
        key = value.strip().lower()
        if aliases and key in aliases:
            return aliases[key]
        for choice in choices:
            if str(choice) == key:
                return choice
    elif value in choices and not isinstance(value, bool):
        return value
    raise SettingsError(f"{name}={value!r}: expected one of {', '.join(map(str, choices))}")


def _parse_number(name: str, value: Any, kind: type, low: Optional[float] = None, high: Optional[float] = None) -> Any:
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        number = kind(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        number = None
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise SettingsError(f"{name}={value!r}: expected {'an integer' if kind is int else 'a number'} {bounds}")
    return number


def _optional(parse):
    """``parse`` that also takes None (and, from a string, ``none`` or empty) as "unset"."""

    def parse_optional(name: str, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            return None
        return parse(name, value)

    return parse_optional


def _choice(*choices, aliases: Optional[Dict[str, Any]] = None):
    return lambda name, value: _parse_choice(name, value, choices, aliases)


def _int(low: Optional[int] = None, high: Optional[int] = None):
    return lambda name, value: _parse_number(name, value, int, low, high)


def _float(low: Optional[float] = None):
    return lambda name, value: _parse_number(name, value, float, low)


def _path(name: str, value: Any) -> Optional[str]:
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise SettingsError(f"{name}={value!r}: expected a folder path")
    return os.fspath(value)


def _knob(default: Any, parse, doc: str, type_name: str, env: bool = False) -> Any:
    """A dataclass field with its parser and one line of documentation (docs/settings.md)."""
    return field(default=default, metadata={"parse": parse, "doc": doc, "type": type_name, "env": env})


# ---------------------------------------------------------------------------------------------------
# User settings: the six environment variables and the per-compile options' process-wide defaults.
# ---------------------------------------------------------------------------------------------------

SPLIT_ALL_REDUCE_MODES = ("exact", "replicated", "off")
DISPATCH_MODES = ("auto", "fused", "decomposed")


@dataclass(frozen=True)
class Settings:
    """What a user chooses.  Fields with ``env=True`` in their metadata are read from ``FLUXINDUCTOR_<NAME>``."""

    disable: bool = _knob(False, _parse_bool, "`backend=\"flux\"` compiles exactly as `backend=\"inductor\"` "
                          "(1/true/yes/on; 0/false/no/off or empty: fluxinductor is on).", "bool", env=True)
    log: bool = _knob(False, _parse_bool, "Log every rewrite, skip (with its reason) and run-time fallback.", "bool",
                      env=True)
    dispatch: str = _knob("auto", _choice(*DISPATCH_MODES, aliases={"": "auto"}),
                          "Per call: `auto` the path the measured cost model found fastest, `fused` the fused kernel "
                          "wherever it is eligible, `decomposed` never the fused kernel.", "str", env=True)
    tuning_dir: Optional[str] = _knob(None, _path, "Folder of the cost model's tables, instead of the packaged "
                                      "`fluxinductor/tuning/`.", "path", env=True)
    timeout_s: float = _knob(10.0, _float(low=1e-3), "Seconds a fused kernel waits for a peer before the call fails "
                             "(and the waits trap) instead of hanging.", "float", env=True)
    assume_nvlink: bool = _knob(False, _parse_bool, "Take every pair of a group's GPUs as NVLink peers without asking "
                                "NVML (one host, one GPU per rank).", "bool", env=True)
    split_all_reduce: str = _knob(
        "exact", _choice(*SPLIT_ALL_REDUCE_MODES, aliases={"1": "exact", "on": "exact", "true": "exact",
                                                           "0": "off", "false": "off", "": "off"}),
        "`exact` splits `all_reduce(matmul)` into a fused reduce-scatter and an all-gather through row-wise ops; "
        "`replicated` also slices replicated activations (the residual stream); `off` leaves all-reduces alone.",
        "str")
    fuse_matmul_sums: bool = _knob(True, _parse_bool, "Fuse `sum_i a_i @ W_i -> reduce_scatter` as one matmul over "
                                   "`cat(a_i)` and `cat(W_i)` (copies those operands every step).", "bool")
    cuda_graphs: bool = _knob(True, _parse_bool, "The fused ops are captured in CUDA graphs with the rest of the "
                              "graph (`mode=\"reduce-overhead\"`); off, such compiles are left to plain inductor.",
                              "bool")


# The per-compile options (torch.compile(..., options={...})) that fluxinductor takes out of the options before the
# rest become inductor config patches; each but tp_group has its default in Settings.
COMPILE_OPTIONS = {
    "tp_group": ("group name, ProcessGroup, 1-D DeviceMesh or a list of them", "all groups",
                 "Fuse only the collectives of these process groups (overrides `fluxinductor.set_tp_group`)."),
    "split_all_reduce": ('"exact", "replicated" or "off"', None, None),
    "fuse_matmul_sums": ("bool", None, None),
    "cuda_graphs": ("bool", None, "Also decides, for the whole process, whether fused ops captured in a CUDA graph may "
                    "run their kernels (`settings.kernels_under_capture`)."),
}


def env_var(name: str) -> str:
    """``"timeout_s"`` -> ``"FLUXINDUCTOR_TIMEOUT_S"``."""
    return PREFIX + name.upper()


ENV_VARS = tuple(env_var(f.name) for f in dataclasses.fields(Settings) if f.metadata["env"])


# ---------------------------------------------------------------------------------------------------
# Kernel tuning (developers).
# ---------------------------------------------------------------------------------------------------

AG_VARIANTS = (0, 1, 2, 3, 4, 5, 6, 7)  # csrc/ag_gemm/ag_gemm.h Variant; 3, 4, 5 and 7 only in tuning builds
GEMM_RS_PUSH_MODES = ("store", "copy", "split")
GEMM_RS_MAX_BANDS = 32  # csrc/gemm_rs/gemm_rs.h kGemmRsMaxBands


@dataclass(frozen=True)
class Tuning:
    """Kernel-tuning knobs, measured defaults.  Every rank must use the same values."""

    ag_variant: Optional[int] = _knob(None, _optional(_choice(*AG_VARIANTS)),
                                      "AG+GEMM kernel variant for bf16 with a K-contiguous weight (csrc/ag_gemm/ag_gemm.h "
                                      "Variant; 3, 4, 5, 7 need a tuning build); None: 0 or 6 per shape.",
                                      "int or None")
    ag_chunks: int = _knob(2, _int(1, 16), "AG+GEMM row chunks per rank's shard, each with its own arrival flag.",
                           "int")
    ag_group_rows: int = _knob(8, _int(1), "AG+GEMM tile order: the most cluster rows per group.", "int")
    ag_k_chunks: int = _knob(4, _int(1, 16), "AG+GEMM problems of one wave of tiles: column blocks per shard "
                             "(1: row chunks for every shape).", "int")
    ag_tail_split: int = _knob(4, _int(1), "AG+GEMM: the most parts a partial last wave's tile is split into "
                               "along K (1: off).", "int")
    tail_split_waves: int = _knob(1, _int(1, 4), "How many waves a split tail may take (AG+GEMM and the split "
                                  "GEMM+RS transport).", "int")
    gemm_rs_push: Optional[str] = _knob(None, _optional(_choice(*GEMM_RS_PUSH_MODES)),
                                        "GEMM+RS transport for every call (`store`, `copy`, `split`); None: the cost "
                                        "model's choice per shape.", "str or None")
    gemm_rs_bands: int = _knob(4, _int(1, GEMM_RS_MAX_BANDS), "GEMM+RS copy transport: bands per row segment.", "int")
    gemm_rs_tail_split: int = _knob(4, _int(1), "Split GEMM+RS transport: the most parts a partial last wave's tile "
                                    "is split into along K (1: off; ping-pong GEMMs take at most 3).", "int")
    gemm_rs_split_config: Optional[int] = _knob(None, _optional(_choice(0, 1, 2)),
                                                "Split GEMM+RS transport's GEMM configuration (0 cooperative "
                                                "128x256, 2 ping-pong 128x192, 1 tuning builds); None: the cost "
                                                "model's per shape.", "int or None")
    gemm_rs_config: int = _knob(0, _int(0, 6), "GEMM+RS kernel configuration (1..6 only in tuning builds).", "int")
    gemm_rs_swizzle: Optional[int] = _knob(None, _optional(_choice(1, 2, 4, 8)),
                                           "GEMM+RS tile-order swizzle inside a segment; None: the measured default "
                                           "per segment size.", "int or None")
    gemm_rs_raster: Optional[int] = _knob(None, _optional(_choice(0, 1, 2)),
                                          "GEMM+RS raster order (0 heuristic, 1 along M, 2 along N); None: the "
                                          "measured default per segment size.", "int or None")
    asynctp: bool = _knob(False, _parse_bool, "Offer PyTorch's async-TP ops to the `auto` dispatcher (experimental).",
                          "bool")
    calibrate: bool = _knob(True, _parse_bool, "Under `auto` dispatch, time the fused paths against the sequential one "
                            "at the first call of a shape no tuning table measured, and keep the fastest "
                            "(fluxinductor/calibration.py); off: the estimate (a similar shape's table row, or the "
                            "roofline) decides alone.", "bool")
    calibration_dir: Optional[str] = _knob(None, _path, "Folder of the calibration cache (one JSON per device and "
                                           "world size); None: `$XDG_CACHE_HOME/fluxinductor` or "
                                           "`~/.cache/fluxinductor`.", "path or None")
    emulate_nodes: int = _knob(0, _int(0), "GPUs per emulated node: ranks in consecutive groups of this many are "
                               "taken as nodes, which runs the inter-node (NVSHMEM) path on one host "
                               "(fluxinductor/kernels/internode.py; tests and benchmarks); 0: nodes are hosts.", "int")
    peer_check_timeout_s: float = _knob(600.0, _float(low=1e-3), "Seconds a rank waits for its peers at a group's "
                                        "first fused call (the peers may still be compiling).", "float")

    def __post_init__(self) -> None:
        # Hashed once: the kernels key their per-launch caches by this object.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


# ---------------------------------------------------------------------------------------------------
# The state, and how to change it.
# ---------------------------------------------------------------------------------------------------


def _validated(cls, values: Dict[str, Any], what: str, name_of=lambda name: name):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    parsed = {}
    for name, value in values.items():
        if name not in fields:
            raise SettingsError(f"unknown {what} {name!r}; expected one of {', '.join(fields)}")
        parsed[name] = fields[name].metadata["parse"](name_of(name), value)
    return parsed


def from_environment(environ: Optional[Dict[str, str]] = None) -> Settings:
    """A :class:`Settings` from ``environ`` (default ``os.environ``): the six variables, the other fields at their
    defaults.  Raises :class:`SettingsError` on a bad value; warns about a ``FLUXINDUCTOR_*`` variable it does not
    read (a removed or renamed setting must not be ignored silently)."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in dataclasses.fields(Settings):
        if f.metadata["env"] and env_var(f.name) in environ:
            values[f.name] = environ[env_var(f.name)]
    _check_unknown(environ)
    return Settings(**_validated(Settings, values, "setting", env_var))


# Read by setup.py (build time) and the benchmarks (their own), not by the library.
BUILD_ENV_VARS = {
    "FLUXINDUCTOR_BUILD_EXTENSION": ("bool", "1", "`0` installs without compiling the CUDA extension (the ops run "
                                     "decomposed)."),
    "FLUXINDUCTOR_REQUIRE_EXTENSION": ("bool", "0", "`1` makes a failed extension build fail the install."),
    "FLUXINDUCTOR_BUILD_JOBS": ("int", "CPU count", "Parallel compile jobs of the extension build."),
}
_OTHER_READERS = set(BUILD_ENV_VARS) | {"FLUXINDUCTOR_GIT_SHA"}


def _check_unknown(environ) -> None:
    known = set(ENV_VARS) | _OTHER_READERS
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    if unknown:
        tuning_fields = {f.name for f in dataclasses.fields(Tuning)}
        settings_fields = {f.name for f in dataclasses.fields(Settings)}
        hint = []
        for k in unknown:
            name = k[len(PREFIX):].lower()
            if name in tuning_fields:
                k += f" (now fluxinductor.settings.set_tuning({name}=...))"
            elif name in settings_fields:
                k += f" (now the torch.compile option {name!r}, default fluxinductor.settings.configure({name}=...))"
            hint.append(k)
        warnings.warn(f"fluxinductor ignores these environment variables: {'; '.join(hint)}; it reads "
                      f"{', '.join(ENV_VARS)}", stacklevel=3)


current: Settings = from_environment()
tuning: Tuning = Tuning()
_generation = 0  # changes of current or tuning (tests and caches)
_cuda_graphs_compiled = False  # a compile of this process asked for cuda_graphs=True (kernels_under_capture)


def _changed() -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """A number that changes whenever :data:`current` or :data:`tuning` does (caches keyed by the settings)."""
    return _generation


def reload() -> Settings:
    """Read the environment again, as at import: :data:`current` from it, :data:`tuning` back to its defaults.
    Raises :class:`SettingsError` on a bad value (then nothing changes)."""
    global current, tuning, _cuda_graphs_compiled
    fresh = from_environment()
    current, tuning, _cuda_graphs_compiled = fresh, Tuning(), False
    _changed()
    return current


def configure(**values: Any) -> Settings:
    """Set fields of :data:`current` for this process (e.g. ``configure(split_all_reduce="replicated")``), validated.
    Returns the new :data:`current`."""
    global current
    current = dataclasses.replace(current, **_validated(Settings, values, "setting"))
    _changed()
    return current


def set_tuning(**values: Any) -> Tuning:
    """Set kernel-tuning fields (e.g. ``set_tuning(ag_variant=5, gemm_rs_push="copy")``), validated; strings are
    parsed as ``--tuning`` gives them.  Returns the new :data:`tuning`."""
    global tuning
    tuning = dataclasses.replace(tuning, **_validated(Tuning, values, "tuning field"))
    _changed()
    return tuning


def parse_tuning(text: str) -> Dict[str, str]:
    """``"ag_variant=5,gemm_rs_push=copy"`` -> ``{"ag_variant": "5", "gemm_rs_push": "copy"}`` (for
    :func:`set_tuning`; benchmarks' and tools' ``--tuning``)."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--tuning item {item!r}: expected key=value")
        values[key.strip()] = value.strip()
    _validated(Tuning, values, "tuning field")
    return values


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Within the block, these fields of :data:`current` and :data:`tuning` take these values (tests, benchmarks'
    contenders); both are restored after it."""
    global current, tuning
    settings_fields = {f.name for f in dataclasses.fields(Settings)}
    ours = {k: v for k, v in values.items() if k in settings_fields}
    theirs = {k: v for k, v in values.items() if k not in settings_fields}
    saved = current, tuning
    try:
        configure(**ours)
        set_tuning(**theirs)
        yield
    finally:
        current, tuning = saved
        _changed()


def compile_option(options: Dict[str, Any], name: str) -> Any:
    """Pop per-compile option ``name`` from ``options`` (validated), or :data:`current`'s default."""
    if name not in options:
        return getattr(current, name)
    return _validated(Settings, {name: options.pop(name)}, "compile option", lambda n: f"options[{n!r}]")[name]


def note_cuda_graphs_compile() -> None:
    """A compile asked for ``cuda_graphs=True``: from now on fused ops under capture may run their kernels."""
    global _cuda_graphs_compiled
    _cuda_graphs_compiled = True


def kernels_under_capture() -> bool:
    """Whether a fused op captured in a CUDA graph runs its kernels (else it decomposes while captured), and whether
    kernel state is allocated outside CUDA graph trees' pools: :data:`current`'s ``cuda_graphs``, or any compile of
    this process with ``cuda_graphs=True`` (see the module docstring)."""
    return current.cuda_graphs or _cuda_graphs_compiled


def compute_hash() -> str:
    """A digest of every setting (:data:`current`, :data:`tuning`, the tp groups) for the pass manager's uuid."""
    groups = "*" if _tp_group_names is None else ",".join(sorted(_tp_group_names))
    text = f"{current!r};{dataclasses.astuple(tuning)!r};tp_groups={groups}"
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------
# The tensor-parallel groups fusion is restricted to (fluxinductor.set_tp_group, options={"tp_group": ...}).
# ---------------------------------------------------------------------------------------------------

_tp_group_names: Optional[frozenset] = None


def _group_name(group: Any) -> str:
    import torch.distributed as dist

    if isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    get_group = getattr(group, "get_group", None)  # a one-dimensional DeviceMesh (e.g. mesh["tp"])
    if get_group is not None:
        return get_group().group_name
    raise TypeError(f"expected a group name, ProcessGroup or 1-D DeviceMesh, got {type(group).__name__}")


def set_tp_group(groups: Union[None, str, object, Iterable]) -> None:
    """Restrict fusion to the collectives of these process groups (the tensor-parallel group).

    ``None`` (the default) lets every group's collectives be fused.  Accepts group names, ``ProcessGroup`` objects,
    1-D ``DeviceMesh`` objects, or an iterable of them.
    """
    global _tp_group_names
    if groups is None:
        _tp_group_names = None
        return
    import torch.distributed as dist

    if isinstance(groups, (str, dist.ProcessGroup)) or hasattr(groups, "get_group"):
        groups = [groups]
    _tp_group_names = frozenset(_group_name(g) for g in groups)
    _changed()


def tp_group_names() -> Optional[frozenset]:
    """The group names fusion is restricted to, or ``None`` for all groups."""
    return _tp_group_names


def group_allowed(group_name: str) -> bool:
    return _tp_group_names is None or group_name in _tp_group_names


# ---------------------------------------------------------------------------------------------------
# docs/settings.md
# ---------------------------------------------------------------------------------------------------


def _default_text(value: Any) -> str:
    return "unset" if value is None else f"`{value}`"


def markdown() -> str:
    """docs/settings.md: every setting with its name, type, default and one line (a test checks the file)."""
    lines = ["# Settings", "",
             "Generated by `python -m fluxinductor.settings --markdown` from `fluxinductor/settings.py`; "
             "a test checks that this file is up to date.", "",
             "## User environment variables", "",
             "Read once when fluxinductor is imported; a bad value is an error naming the variable and the values "
             "it accepts.  Any other `FLUXINDUCTOR_*` variable (a removed or renamed setting) is reported with a "
             "warning, as it is not read (the build-time ones below excepted).",
             "", "| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        if f.metadata["env"]:
            lines.append(f"| `{env_var(f.name)}` | {f.metadata['type']} | {_default_text(f.default)} | "
                         f"{f.metadata['doc']} |")
    lines += ["", "## Per-compile options", "",
              "`torch.compile(model, backend=\"flux\", options={...})`; the other keys are inductor config patches.  "
              "The process-wide default of each is `fluxinductor.settings.current.<name>`, set with "
              "`fluxinductor.settings.configure(<name>=...)`.", "",
              "| Option | Type | Default | Meaning |", "|---|---|---|---|"]
    settings_fields = {f.name: f for f in dataclasses.fields(Settings)}
    for name, (type_name, default, note) in COMPILE_OPTIONS.items():
        f = settings_fields.get(name)
        doc = f.metadata["doc"] if f is not None else note
        if f is not None and note:
            doc += " " + note
        lines.append(f"| `{name}` | {type_name} | {_default_text(f.default) if f is not None else default} | {doc} |")
    lines += ["", "## Developer tuning", "",
              "`fluxinductor.settings.set_tuning(name=value, ...)` (validated; benchmarks and tools take "
              "`--tuning name=value[,name=value]`); read as `fluxinductor.settings.tuning.<name>`.  Every rank must "
              "use the same values.", "", "| Field | Type | Default | Meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Tuning):
        lines.append(f"| `{f.name}` | {f.metadata['type']} | {_default_text(f.default)} | {f.metadata['doc']} |")
    lines += ["", "## Build-time environment variables", "", "Read by `setup.py` only.", "",
              "| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for name, (type_name, default, doc) in BUILD_ENV_VARS.items():
        lines.append(f"| `{name}` | {type_name} | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m fluxinductor.settings --markdown")
    sys.stdout.write(markdown())
