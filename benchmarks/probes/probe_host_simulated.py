"""Host cost of an eager fused call, layer by layer, with two ranks simulated on one GPU (no process group).

The exposed part of a host-exposed forward step is the host time of its first fused op (the Q/K/V AG+GEMM) up to its
GEMM's launch (docs/performance.md, "Model level").  That time is spent in the op's layer (the dispatcher's call into
the Python kernel, the replay), in the kernel module's per-call object (``ag_gemm._PushCall``, ``gemm_rs._EagerCall``)
and in its one call into the extension.  This probe runs those objects for two ranks of one process on one GPU (each
rank's workspace faked over local buffers, as tests/gpu simulates ranks; the GEMMs get a share of the SMs each so
both ranks' kernels are resident), called directly and through the op (their replays registered as the dispatcher
registers them after a signature's first call), and times, behind a GPU sleep so that nothing waits for the device:
the whole call, the Python before the extension call (which delays the GEMM's launch), the extension call, and what
follows it (the AG+GEMM's cuBLAS GEMMs of the narrow weights, the results' views); for the run of ``--calls`` calls
per rank whose whole calls took least of ``--reps`` runs, µs per call.  ``--profile``: cProfile of the calls (own time
per function, top 25), which inflates every Python call.

Usage: CUDA_MODULE_LOADING=EAGER python benchmarks/probes/probe_host_simulated.py --out host.json
(eager module loading: a kernel's lazy load at its first launch can wait for an idle device, which the simulated
ranks' first call never leaves it; cuBLAS, which the AG+GEMM's narrow weights run on, is warmed up first for the
same reason.)
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, write_json  # noqa: E402

WORLD = 2


class _Workspace:
    """What ``ag_gemm._PushCall`` reads of a ``symm.SymmetricWorkspace``, over one process's tensors for rank
    ``rank`` of ``ranks`` (every rank's buffers and flags per call parity, arrival words, passed words)."""

    def __init__(self, rank, ranks, side):
        self.rank, self.world, self.captured = rank, WORLD, False
        self.epoch = self._previous = 0
        self._ranks = ranks
        self.flags = ranks.flags[rank]
        self.arrivals = ranks.arrivals[rank]
        self.passed = ranks.passed[rank]
        self.side_stream = side
        self._events = None

    def reserve(self, nbytes):
        pass

    def next_epoch(self):
        self._previous, self.epoch = self.epoch, self.epoch + 1
        return self.epoch

    def previous_epoch(self):
        return self._previous

    def peer_addresses(self, parity, m, k, dtype):
        return ([self._ranks.buffers[parity][q].data_ptr() for q in range(WORLD)],
                [self._ranks.flags[q][parity].data_ptr() for q in range(WORLD)])

    def view(self, parity, rank, m, k, dtype):
        return self._ranks.buffers[parity][rank]

    def peer_arrival_words(self):
        return [self._ranks.arrivals[q][self.rank].data_ptr() for q in range(WORLD)]

    def push_events(self):
        from fluxinductor.kernels import symm

        if self._events is None:
            self._events = symm.push_events(self._ranks.device)
        return self._events


def _through_the_op(op, group_names, calls, operands, args, replay_for):
    """The same calls through ``torch.ops.fluxinductor.<op>``: each rank's call remembered as the dispatcher's replay
    of its signature (``replay_for(call)``; kept for the whole run), so the op goes from its replay key to it as a
    compiled graph's call does once a signature has run."""
    from fluxinductor import dispatch, ops  # noqa: F401  (ops registers torch.ops.fluxinductor)

    dispatch.REPLAY_S = 1e9
    fn = getattr(torch.ops.fluxinductor, op)
    wrapped = []
    for r, call in enumerate(calls):
        tensors, rest = operands[r]
        dispatch._remember_replay(dispatch.replay_key(op, group_names[r], args, tensors), replay_for(call.func))
        wrapped.append(functools.partial(fn, *rest(group_names[r])))
    return wrapped


def _ag_calls(m, k, ns, dtype, device, through_op=False):
    """Two simulated ranks' ``_PushCall`` objects and their operands (the gathered A returned, as for a backward);
    ``through_op``: called through the op (:func:`_through_the_op`) on a [1, S/w, K] shard gathered on dim 1."""
    from fluxinductor.kernels import ag_gemm, symm

    shard_rows = m // WORLD
    ranks = SimpleNamespace(
        device=device,
        buffers=[[torch.zeros(m, k, dtype=dtype, device=device) for _ in range(WORLD)] for _ in range(2)],
        flags=[torch.zeros(2, WORLD * symm.MAX_CHUNKS_PER_RANK, dtype=torch.int32, device=device)
               for _ in range(WORLD)],
        arrivals=[torch.zeros(WORLD, dtype=torch.int32, device=device) for _ in range(WORLD)],
        passed=[torch.zeros(1, dtype=torch.int32, device=device) for _ in range(WORLD)])
    weights = [torch.randn(n, k, dtype=dtype, device=device).t() for n in ns]
    biases = [None] * len(ns)
    shards = [torch.randn(shard_rows, k, dtype=dtype, device=device) for _ in range(WORLD)]
    for w in weights:  # cuBLAS's first call loads its kernels, which waits for an idle device: not inside a call pair
        torch.mm(torch.zeros(m, k, dtype=dtype, device=device), w)
    torch.cuda.synchronize()
    calls = [ag_gemm._PushCall(_Workspace(r, ranks, torch.cuda.Stream(device)), shards[r], weights, biases, True)
             for r in range(WORLD)]
    calls = [functools.partial(calls[r], shards[r], weights, biases) for r in range(WORLD)]
    if not through_op:
        return calls
    from fluxinductor import dispatch

    shards3d = [s.view(1, shard_rows, k) for s in shards]
    operands = [((shards3d[r], *weights, *biases),
                 lambda name, r=r: (shards3d[r], weights, biases, 1, name, True)) for r in range(WORLD)]
    return _through_the_op("all_gather_matmul", [f"simulated{r}" for r in range(WORLD)], calls, operands,
                           (1, True, len(weights)),
                           lambda run: dispatch._all_gather_matmul_replay(run, m, (1,), 1, True))


def _rs_calls(m, k, n, dtype, device, transport, through_op=False):
    """Two simulated ranks' ``gemm_rs._EagerCall`` objects (their group state faked over local buffers);
    ``through_op``: called through the op (:func:`_through_the_op`) on a [1, S, K] operand scattered on dim 1."""
    from fluxinductor.kernels import gemm_rs, gemm_rs_group

    _, _, nbytes = gemm_rs.buffer_layout(m, n, WORLD, dtype)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(WORLD)]
    states = []
    for r in range(WORLD):
        state = object.__new__(gemm_rs_group._GroupState)
        state.__dict__.update(group_name=f"simulated{r}", rank=r, world=WORLD, device=device, capacity=nbytes,
                              buffer=buffers[r], handle=None, buffer_ptrs=[b.data_ptr() for b in buffers], retired=[],
                              epoch=0, agreed=set(), agree_calls=0, generation=0, copy=None, error=gemm_rs.ErrorWord())
        state.agree = lambda sig: None
        gemm_rs_group._states[(state.group_name, device.index)] = state
        states.append(state)
    a = [torch.randn(m, k, dtype=dtype, device=device) for _ in range(WORLD)]
    weight = torch.randn(n, k, dtype=dtype, device=device).t()
    calls = [gemm_rs._EagerCall(states[r], a[r], weight, None, "sum", transport, None, None) for r in range(WORLD)]
    calls = [functools.partial(calls[r], a[r], weight, None) for r in range(WORLD)]
    if not through_op:
        return calls
    from fluxinductor import dispatch

    a3d = [x.view(1, m, k) for x in a]
    operands = [((a3d[r], weight, None), lambda name, r=r: (a3d[r], weight, None, "sum", 1, name))
                for r in range(WORLD)]
    return _through_the_op("matmul_reduce_scatter", [f"simulated{r}" for r in range(WORLD)], calls, operands,
                           ("sum", 1, None),
                           lambda run: dispatch._matmul_reduce_scatter_replay(run, m // WORLD, (1,), 1))


class _ExtensionTimer:
    """Wraps one extension entry point: accumulates its host time."""

    def __init__(self, module, name):
        self.module, self.name, self.inner = module, name, getattr(module, name)
        self.total = 0.0
        self.entered = 0.0  # when the last call entered

    def __call__(self, *args):
        t0 = self.entered = time.perf_counter()
        result = self.inner(*args)
        self.total += time.perf_counter() - t0
        return result


def _time(calls, streams, n_calls, reps, timer):
    """Least over ``reps`` of (µs per call of the whole call, in the extension, before the extension call), every
    rank's call of an epoch enqueued in turn behind a sleep kernel."""
    best = (float("inf"),) * 3
    for rep in range(reps + 2):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        timer.total = 0.0
        elapsed = before = 0.0
        for _ in range(n_calls):
            for r, call in enumerate(calls):
                with torch.cuda.stream(streams[r]):
                    t0 = time.perf_counter()
                    call()
                    elapsed += time.perf_counter() - t0
                    before += timer.entered - t0
        if rep >= 2:  # the first two warm caches and lazy loading
            per = n_calls * len(calls)
            best = min(best, (elapsed * 1e6 / per, timer.total * 1e6 / per, before * 1e6 / per))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return best


def _profile(calls, streams, n_calls) -> str:
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n_calls):
        for r, call in enumerate(calls):
            with torch.cuda.stream(streams[r]):
                call()
    prof.disable()
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ag", default="4096x8192x4096,512,512", help="global M x K x N per rank of the AG+GEMM's widest "
                   "weight, then the N of its other weights (the Q/K/V all-gather at hidden 8192, TP=2)")
    p.add_argument("--rs", default="4096x8192x8192", help="global M x K x N of the GEMM+RS (attention output)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--debug", action="store_true", help="run and check one call pair before timing")
    args = p.parse_args(argv)

    from fluxinductor.kernels import ag_gemm, gemm_rs, loader, symm

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # A share of the SMs each, so that both ranks' persistent GEMMs are resident with room for the arrival kernels
    # (the split transport's two GEMMs per rank may hold SMs at once).
    ag_gemm.gemm_args = functools.partial(ag_gemm.gemm_args, sm_count=(sms * 3 // 4 // WORLD) // 2 * 2)
    gemm_rs.launch = functools.partial(gemm_rs.launch, sm_count=(sms // (2 * WORLD) - 1) // 2 * 2)
    ag_shape, *ag_more = args.ag.split(",")
    m, k, n = (int(v) for v in ag_shape.split("x"))
    rs_m, rs_k, rs_n = (int(v) for v in args.rs.split("x"))
    streams = [torch.cuda.Stream(device) for _ in range(WORLD)]
    ext = loader.extension()
    rows = []
    cases = []
    for layer in ("kernel module", "op"):
        cases.append(("all_gather_matmul", "push", layer, f"{m}x{k}x{n}+{'+'.join(ag_more)}", "ag_push_call",
                      lambda o=layer == "op": _ag_calls(m, k, [n] + [int(x) for x in ag_more], dtype, device, o)))
        for transport in ("split", "store"):
            cases.append(("matmul_reduce_scatter", transport, layer, args.rs, "gemm_rs_run",
                          lambda t=transport, o=layer == "op": _rs_calls(rs_m, rs_k // WORLD, rs_n, dtype, device, t,
                                                                         o)))
    for op, transport, layer, shape, entry, make in cases:
        timer = _ExtensionTimer(ext, entry)
        setattr(ext, entry, timer)
        try:
            calls = make()
            if args.debug:
                for r in range(WORLD):
                    with torch.cuda.stream(streams[r]):
                        calls[r]()
                torch.cuda.synchronize()
                print(op, transport, "first call pair: error word", symm.read_error(device.index), flush=True)
            whole, inside, before = _time(calls, streams, args.calls, args.reps, timer)
            row = dict(op=op, transport=transport, layer=layer, shape=shape, call_us=round(whole, 1),
                       extension_us=round(inside, 1),
                       before_extension_us=round(before, 1), after_extension_us=round(whole - inside - before, 1))
            if args.profile:
                row["profile"] = _profile(calls, streams, args.calls)
        finally:
            setattr(ext, entry, timer.inner)
        rows.append(row)
        print(f"{op:22s} {transport:6s} {layer:13s} {shape:24s} call {row['call_us']:6.1f} us: before the extension "
              f"{row['before_extension_us']:5.1f}, in it {row['extension_us']:5.1f}, after it "
              f"{row['after_extension_us']:5.1f}", flush=True)
        if args.profile:
            print(row["profile"], flush=True)
    code = symm.read_error(device.index)
    print("error word:", code)
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, git_sha=git_sha(),
                  method=f"two ranks simulated on one GPU; least of {args.reps} runs of {args.calls} calls per rank, "
                  "behind a GPU sleep", error_word=code, rows=rows)
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
