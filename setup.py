"""Install fluxinductor; build the CUDA extension ``fluxinductor._C`` through CMake where its kernels can run.

``fluxinductor.passes`` lives in ``passes/`` at the top of the tree.  The extension (CUTLASS sm90a kernels, csrc/)
takes minutes to compile, so it is built only where it can be used: with nvcc, and a torch built with CUDA
(``torch.version.cuda`` set).  Without them the package installs in seconds without it and the ops run their
decomposition; one line says why and how to build it anyway.  Build-time switches:

- ``FLUXINDUCTOR_BUILD_EXTENSION=1`` builds it whatever torch is installed (nvcc still needed); ``=0`` never builds it.
- ``FLUXINDUCTOR_REQUIRE_EXTENSION=1`` builds it and turns a failed or skipped build into an error (CI sets it where
  nvcc exists, so a broken build cannot land).
- ``FLUXINDUCTOR_BUILD_JOBS``: parallel compile jobs (default: the CPU count).
- ``CMAKE_ARGS``: extra CMake arguments, e.g. ``-DFLUXINDUCTOR_KERNEL_TUNING=ON`` for the tuning variants
  (csrc/tuning/).

pip shows a build's output only with ``-v``; so that a user without it still learns what is being built (or why
not) and sees the compile progress, those lines also go to the terminal (/dev/tty) when there is one.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# For the announced estimate only: the default build's compile time summed over its translation units, in minutes of
# one core (about 11 minutes on an otherwise idle 2-core x86 machine), and its longest unit (csrc/gemm_rs/gemm_rs.cu),
# which bounds the time however many cores there are.  A loaded machine takes longer.
_BUILD_CORE_MINUTES = 20
_LONGEST_UNIT_MINUTES = 6


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str):
    """A boolean build switch: True, False, or None when unset or empty; anything else is an error."""
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return None
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of 1/true/yes/on or 0/false/no/off")


def _require_extension() -> bool:
    return bool(_flag("FLUXINDUCTOR_REQUIRE_EXTENSION"))


class _Terminal:
    """Lines for the user: to stderr (pip -v shows it) and to the terminal, which pip's captured output never
    reaches (nothing when there is none, e.g. in CI)."""

    def __init__(self):
        try:
            self._tty = open("/dev/tty", "w")  # noqa: SIM115 - kept open for the build's progress lines
        except OSError:
            self._tty = None
        # The first line leaves pip's "Building ... -" line; the others start by overwriting its spinner's character.
        self._line_start = "\n"

    def say(self, line: str, tty: bool = True) -> None:
        print(line, file=sys.stderr, flush=True)
        if tty and self._tty is not None:
            try:
                self._tty.write(self._line_start + line + "\n")
                self._tty.flush()
                self._line_start = "\r"
            except OSError:
                self._tty = None


def _nvcc():
    """nvcc's path, or None."""
    found = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return found if os.path.exists(found) else None


def _installed_torch_cuda():
    """(found, torch.version.cuda) of the torch that will import the package, or (False, None) when none is found.

    pip's build isolation hides the installed packages from this process (torch is not a build requirement: it is the
    user's choice of build), so when torch does not import here, ask the same interpreter without the isolation's
    PYTHONPATH, which is how the installed package will run."""
    try:
        import torch

        return True, torch.version.cuda
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    try:
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"], env=env,
                               capture_output=True, text=True, timeout=120, cwd="/")
    except (OSError, subprocess.SubprocessError):
        return False, None
    if probe.returncode != 0:
        return False, None
    cuda = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "None"
    return True, None if cuda == "None" else cuda


def _gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return "GPU" in subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False


def _should_build():
    """(build, why): whether to build the extension, and the reason in words."""
    wanted = _flag("FLUXINDUCTOR_BUILD_EXTENSION")
    if _require_extension():
        if wanted is False:
            raise ValueError("FLUXINDUCTOR_REQUIRE_EXTENSION=1 and FLUXINDUCTOR_BUILD_EXTENSION=0 contradict each "
                             "other")
        return True, "FLUXINDUCTOR_REQUIRE_EXTENSION=1"
    if wanted is not None:
        return wanted, f"FLUXINDUCTOR_BUILD_EXTENSION={os.environ['FLUXINDUCTOR_BUILD_EXTENSION'].strip()}"
    if _nvcc() is None:
        return False, "nvcc is not on PATH (nor in $CUDA_HOME/bin)"
    found, cuda = _installed_torch_cuda()
    if found:
        if cuda is None:
            return False, ("the installed torch is a CPU build (torch.version.cuda is None), so the kernels could "
                           "not run")
        return True, f"nvcc found, torch built with CUDA {cuda}"
    if _gpu_present():
        return True, "nvcc found, no torch found at build time, a GPU found by nvidia-smi -L"
    return False, "no torch found at build time and no GPU (nvidia-smi -L)"


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: str):
        super().__init__(name, sources=[])
        self.source_dir = source_dir


class CMakeBuild(build_ext):
    def build_extensions(self) -> None:
        terminal = _Terminal()
        build, why = _should_build()
        if not build:
            terminal.say(f"fluxinductor: not building the CUDA kernels ({why}); the ops will run decomposed. "
                         "To build them anyway: FLUXINDUCTOR_BUILD_EXTENSION=1 pip install -e .")
            self.extensions = []
            return
        built = []
        for ext in self.extensions:
            try:
                self._build(ext, why, terminal)
                built.append(ext)
            except Exception as e:  # noqa: BLE001 - any failure means "install without the extension"
                if _require_extension():
                    raise
                terminal.say(f"fluxinductor: not building the CUDA kernels ({e}); the ops will run decomposed")
        # What was not built is not installed (editable installs copy every listed extension).
        self.extensions = built

    def _build(self, ext: CMakeExtension, why: str, terminal: _Terminal) -> None:
        nvcc = _nvcc()
        if nvcc is None:
            raise RuntimeError("nvcc not found")
        import pybind11

        out_dir = os.path.abspath(os.path.dirname(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCUTLASS_INCLUDE_DIR={_cutlass_include()}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-GNinja",
        ] + extra
        jobs = int(os.environ.get("FLUXINDUCTOR_BUILD_JOBS", "") or os.cpu_count() or 2)
        tuning = any(re.fullmatch(r"-DFLUXINDUCTOR_KERNEL_TUNING(:BOOL)?=(ON|1|TRUE|YES)", a, re.I) for a in extra)
        minutes = max(_LONGEST_UNIT_MINUTES, -(-_BUILD_CORE_MINUTES // max(1, jobs))) * (2 if tuning else 1)
        what = "CUTLASS, sm90a" + (", with the tuning variants" if tuning else "")
        terminal.say(f"fluxinductor: building the CUDA kernels ({what}; {why}): about {minutes} minutes with {jobs} "
                     "jobs.  FLUXINDUCTOR_BUILD_EXTENSION=0 skips them")
        start = time.monotonic()
        self._run(["cmake", ext.source_dir] + cmake_args, build_dir, terminal, progress=False)
        self._run(["cmake", "--build", ".", "-j", str(jobs)], build_dir, terminal, progress=True)
        elapsed = int(time.monotonic() - start)
        terminal.say(f"fluxinductor: built the CUDA kernels in {elapsed // 60}m{elapsed % 60:02d}s")

    @staticmethod
    def _run(cmd, cwd: str, terminal: _Terminal, progress: bool) -> None:
        """Runs ``cmd``, its output to stderr; with ``progress``, ninja's "[i/n] Building ..." lines to the terminal
        too, shortened to the source file."""
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = []
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-40:]
            step = re.match(r"\[(\d+/\d+)\] (?:Building \w+ object|Linking \w+ \w+ module) "
                            r".*?(csrc/\S+?|\S+\.so)(?:\.o)?$", line)
            if progress and step:
                terminal.say(f"fluxinductor: [{step.group(1)}] {step.group(2)}")
            else:
                terminal.say(line, tty=False)
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}):\n" + "\n".join(tail[-15:]))


def _cutlass_include() -> str:
    import cutlass_library  # from the nvidia-cutlass wheel

    return os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")


setup(
    name="fluxinductor",
    version="0.1.0",
    description="torch.compile backend that fuses tensor-parallel collectives into GEMMs",
    packages=["fluxinductor", "fluxinductor.passes"],
    package_dir={"fluxinductor": "fluxinductor", "fluxinductor.passes": "passes"},
    package_data={"fluxinductor": ["tuning/*.json"]},
    python_requires=">=3.10",
    # torch is not pinned here: install the build for your machine first (see README.md).
    install_requires=["torch>=2.8", "numpy"],
    extras_require={"test": ["pytest>=7", "numpy", "nvidia-cutlass==4.2.0.0", "ruff", "transformers", "accelerate"], "bench": ["matplotlib"], "internode": ["nvidia-nvshmem-cu13"],
                    "clients": ["transformers", "accelerate", "torchtitan"]},
    ext_modules=[CMakeExtension("fluxinductor._C", HERE)] if os.path.isdir(os.path.join(HERE, "csrc")) else [],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={"torch_dynamo_backends": ["flux = fluxinductor.backend:flux_backend"]},
    zip_safe=False,
)
