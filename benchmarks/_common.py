"""What the benchmark scripts share: dtypes by name, the broken-context error, the git revision, JSON output."""

from __future__ import annotations

import json
import math
import os
import subprocess
from typing import List, Optional, Sequence, Tuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ContextBroken(RuntimeError):
    """A CUDA error left the context unusable: no further GPU work or collective can run."""


def git_sha() -> Tuple[Optional[str], Optional[bool]]:
    """(commit, dirty): ``FLUXINDUCTOR_GIT_SHA`` when set (the device copy's .git may lag the working tree it
    was given), else the checkout's."""
    if os.environ.get("FLUXINDUCTOR_GIT_SHA"):
        return os.environ["FLUXINDUCTOR_GIT_SHA"], None
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if sha.returncode == 0 and sha.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10)
            return sha.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("FLUXINDUCTOR_GIT_SHA") or None, None


def sanitize(o):
    """``o`` with inf/nan (not JSON) as strings and every dict key a string."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [sanitize(v) for v in o]
    return o


def parse_problems(text: Optional[str], default: Sequence[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """"M,K,N;M,K,N" as a list of integer tuples, or ``default`` when ``text`` is empty."""
    return list(default) if not text else [tuple(int(x) for x in s.split(",")) for s in text.split(";")]


def write_json(path: str, data: dict) -> None:
    """Write ``data`` (sanitized) to ``path`` atomically, so a run killed mid-write leaves the last good file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(sanitize(data), f, indent=1, allow_nan=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def init_gpu_ranks() -> Tuple[int, int, torch.device, str]:
    """Rank setup of the torchrun GPU diagnostics: NCCL initialised on this rank's GPU, the world group
    registered with torch symmetric memory, ``torch.ops.fluxinductor`` and ``torch.ops.symm_mem`` loaded.
    Returns (rank, world, device, group name)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    from torch.distributed import _symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

    import fluxinductor  # noqa: F401 - registers torch.ops.fluxinductor
    from fluxinductor.kernels.symm import _enable_group

    _enable_group(group_name)
    return rank, world, device, group_name

