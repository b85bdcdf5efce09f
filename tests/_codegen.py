"""Reading inductor's generated code for the rows-first checks (tests/compile/test_compile_features.py on CPU,
tests/gpu/test_rows_first_codegen.py with triton)."""

from __future__ import annotations

import re
from typing import Dict, List, Set, Tuple


def kernel_calls(code: str) -> Tuple[List[Tuple[str, Set[str]]], Dict[str, str]]:
    """(kernel name, buffers it takes) for each generated kernel launched in ``call``, and the buffer aliases: a buffer
    that reuses another's memory (``bufX = reinterpret_tensor(bufY, ...)``, ``bufX = bufY``) is named by the first
    one's name."""
    body = code[code.index("def call(self, args)"):]
    first: Dict[str, str] = {}
    for new, old in re.findall(r"^\s+(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)(?:,|;|$)", body, re.M):
        first[new] = first.get(old, old)
    calls = [(name, {first.get(b, b) for b in re.findall(r"\bbuf\d+\b", args)})
             for name, args in re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)(?:\.run)?\((.*)\)$", body, re.M)]
    return calls, first


def check_rows_first_mlp(code: str, gather_dim: int = 0, scatter_dim: int = 0) -> List[Tuple[str, Set[str]]]:
    """For ``x + w2(gelu(w1(x)))`` with [B, S/w, H] sequence shards, B > 1: the all-gather is called on ``gather_dim``
    and the reduce-scatter on ``scatter_dim`` (0: rows-first; 1: batch-major, on the tensor as it is), one kernel
    computes gelu reading the all-gather's output and writing the reduce-scatter's operand (no other kernel touches
    them: no layout copy), and one add kernel reads the reduce-scatter's output.  Returns the kernel calls."""
    ag = re.search(r"(buf\d+) = torch\.ops\.fluxinductor\.all_gather_matmul\.default\((\w+), \[.*\], \[.*\], "
                   rf"{gather_dim}, ", code)
    rs = re.search(r"(buf\d+) = torch\.ops\.fluxinductor\.matmul_reduce_scatter\.default\("
                   rf"(?:reinterpret_tensor\()?(buf\d+)\b.*, 'sum', {scatter_dim}, ", code)
    assert ag and rs, f"the ops are not called with the expected dims:\n{code}"
    calls, first = kernel_calls(code)
    if gather_dim:
        assert not any(ag.group(2) in bufs for _, bufs in calls), f"a kernel touches the shard {ag.group(2)}: {calls}"
    ag_out = re.search(rf"(buf\d+) = {ag.group(1)}\[0\]\[0\]", code).group(1)
    rs_in, rs_out = first.get(rs.group(2), rs.group(2)), first.get(rs.group(1), rs.group(1))
    readers = {name for name, bufs in calls if ag_out in bufs}
    writers = {name for name, bufs in calls if rs_in in bufs}
    assert len(readers) == 1 and readers == writers and "gelu" in next(iter(readers)), calls
    adders = [name for name, bufs in calls if rs_out in bufs]
    assert len(adders) == 1 and "add" in adders[0], calls
    return calls
