"""torchtitan itself, unmodified: its Trainer, Llama3 model, TP plan, activation checkpointing and per-block compile.

Where ``bench_clients.py`` runs a copy of torchtitan's model and plan, this runs the ``torchtitan`` package
(``pip install -e .[clients]``): one ``torchtitan.train.Trainer`` per contender, built from torchtitan's own
command-line configuration (``--compile.enable --compile.backend flux``), in one process per rank, so that
contenders alternate round by round on a warm machine.  Per step: a barrier, then torchtitan's ``train_step``
(forward, backward, grad clipping, AdamW, LR schedule) between two CUDA events (wall clock on CPU).

What is ours, not torchtitan's: a generated word-level tokenizer and a local JSON dataset of random words (torchtitan's
test assets are not in its wheel), the batches read ahead of the timed steps (all contenders train on the same
batches), a Llama3 flavour sized by the flags below, ``torch.set_default_dtype`` for bf16 parameters (torchtitan
trains tensor-parallel-only models in fp32: its mixed precision needs FSDP), and async-TP as a registered backend
(inductor with ``_micro_pipeline_tp`` and symmetric memory on the TP group, which is what torchtitan's
``--parallelism.enable_async_tensor_parallel`` switches on) so that it and plain inductor keep separate compiled code.

    torchrun --nproc-per-node 2 benchmarks/bench_torchtitan.py --out benchmarks/results/clients/x.json   # GPUs
    torchrun --nproc-per-node 2 benchmarks/bench_torchtitan.py --tiny                                    # CPU

Numerics: each contender's loss and gradients after its first step against the eager trainer's (same seed, same
batch).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_clients import TITAN_CONTENDERS, backend_for, numerics, setup, summary
from harness import Timer, git_sha, write_json

FLAVOR = "fluxinductor_bench"


def write_assets(root: str, vocab: int, seq: int, samples: int) -> tuple[str, str]:
    """A word-level tokenizer of ``vocab`` ids and a JSON-lines dataset of random words under ``root``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(vocab - 2)]
    table = {"<s>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(table, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}, f)
    rng = random.Random(0)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for _ in range(samples):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq + 1))}) + "\n")
    return tok_dir, data_dir


def register_flavor(args) -> None:
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    llama3_args[FLAVOR] = TransformerModelArgs(
        dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads, vocab_size=args.vocab,
        ffn_dim_multiplier=args.ffn_multiplier, multiple_of=args.multiple_of, rope_theta=500000)


def register_asynctp(group_name: str, device: torch.device) -> str:
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx

    _, options = backend_for("asynctp", device, group_name)

    def inductor_asynctp(gm, example_inputs):
        with torch._inductor.config.patch(options):
            return compile_fx(gm, example_inputs)

    torch._dynamo.register_backend(inductor_asynctp, name="inductor_asynctp")
    return "inductor_asynctp"


def trainer_for(args, backend: str | None, tok_dir: str, data_dir: str, dump: str):
    """A torchtitan Trainer; ``backend`` None is eager (no compile)."""
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    argv = [
        "--model.name", "llama3", "--model.flavor", FLAVOR, "--model.hf_assets_path", tok_dir,
        "--training.dataset", "c4_test", "--training.dataset_path", data_dir,
        "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.tokens // args.batch),
        "--training.steps", "1000000", "--training.max_norm", "1.0",
        "--parallelism.tensor_parallel_degree", str(args.world), "--parallelism.data_parallel_shard_degree", "1",
        "--activation_checkpoint.mode", args.checkpoint,
        "--metrics.log_freq", "1000000", "--checkpoint.no-enable", "--job.dump_folder", dump,
        "--debug.seed", "0", "--training.dtype", {"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
    ]
    if args.float8:
        argv += ["--model.converters", "quantize.linear.float8"]
    if backend is not None:
        argv += ["--compile.enable", "--compile.components", "model", "--compile.backend", backend]
    return Trainer(ConfigManager().parse_args(argv))


def grads_of(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for model in trainer.model_parts:
        for name, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                out[name.replace("._orig_mod", "")] = g.float()
    return out


def profile_steps(folder: str, runs: dict, step, index: int, rank: int) -> None:
    """Two more steps of each contender: one under the profiler (host and device), saved as a Chrome trace per rank,
    and one under cProfile (the host's Python), saved as text, the functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for name, trainer in runs.items():
        torch.distributed.barrier()
        with profile(activities=activities) as prof:
            step(trainer, index)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(folder, f"{name}_rank{rank}.json"))
        torch.distributed.barrier()
        python = cProfile.Profile()
        python.enable()
        step(trainer, index + 1)
        python.disable()
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(python, stream=text).sort_stats(order).print_stats(60)
        with open(os.path.join(folder, f"{name}_rank{rank}.pstats.txt"), "w") as f:
            f.write(text.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model (dim 64, 2 layers, 32 tokens)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn-multiplier", type=float, default=1.3, help="with --multiple-of 1024: FFN 14336 at dim 4096")
    p.add_argument("--multiple-of", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x sequence)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--checkpoint", choices=("none", "full", "selective"), default="none",
                   help="torchtitan's --activation_checkpoint.mode")
    p.add_argument("--float8", action="store_true",
                   help="torchtitan's float8 training (--model.converters quantize.linear.float8, tensorwise; torchao)")
    p.add_argument("--contenders", default=",".join(TITAN_CONTENDERS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="timed steps per contender per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None, help="JSON path (rank 0 writes it)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the rounds, profile a step per contender: DIR/<contender>_rank<r>.json (Chrome trace) "
                        "and .pstats.txt (cProfile of the host's Python)")
    args = p.parse_args()
    if args.tiny:
        args.dim, args.heads, args.kv_heads, args.vocab, args.tokens, args.multiple_of = 64, 4, 2, 128, 32, 32
        args.warmup, args.iters, args.rounds = 1, 2, 2
    try:
        import torchtitan
    except ImportError as e:
        sys.exit(f"torchtitan is not installed ({e}); pip install -e .[clients]")
    import torch.distributed as dist

    rank, args.world, device = setup()
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    register_flavor(args)
    root = tempfile.mkdtemp(prefix=f"bench-torchtitan-{rank}-")
    steps = args.warmup + 1 + args.iters * args.rounds + (2 if args.profile else 0)
    tok_dir, data_dir = write_assets(root, args.vocab, args.tokens // args.batch, samples=args.batch * (steps + 2))
    contenders = [c for c in args.contenders.split(",") if c]
    backends = {"inductor": "inductor", "flux": "flux"}
    if "asynctp" in contenders:
        try:
            backends["asynctp"] = register_asynctp(dist.group.WORLD.group_name, device)
        except RuntimeError as e:
            if rank == 0:
                print(f"[bench_torchtitan] asynctp: {e}", flush=True)
            contenders.remove("asynctp")

    import fluxinductor

    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "contenders": {}}
    eager = trainer_for(args, None, tok_dir, data_dir, os.path.join(root, "eager"))
    batches = [next(iter_) for iter_ in [eager.batch_generator(eager.dataloader)] for _ in range(steps)]

    def step(trainer, index):
        trainer.step += 1
        trainer.train_step(trainer.batch_generator(batches[index:index + 1]))

    def first_step(trainer) -> float:
        """The first step's loss (torchtitan logs it only every log_freq steps, so it is read off the call)."""
        losses, inner = [], trainer.forward_backward_step
        trainer.forward_backward_step = lambda **kw: losses.append(inner(**kw)) or losses[-1]
        try:
            step(trainer, 0)
        finally:
            trainer.forward_backward_step = inner
        return float(sum(losses).detach())

    loss_ref = first_step(eager)
    grads_ref = grads_of(eager)
    del eager
    gc.collect()
    runs = {}
    for name in contenders:
        entry: dict[str, object] = {}
        result["contenders"][name] = entry
        try:
            trainer = trainer_for(args, backends[name], tok_dir, data_dir, os.path.join(root, name))
            fluxinductor.reset_rewrite_stats()
            loss = first_step(trainer)  # compiles; the same first batch and initial weights as eager
            grads = grads_of(trainer)
            entry.update(numerics(loss, loss_ref, grads, grads_ref))
            for i in range(args.warmup):
                step(trainer, 1 + i)
            entry["rewrite_stats"] = fluxinductor.rewrite_stats()
            entry["times_ms"], entry["host_ms"] = [], []
            runs[name] = trainer
        except Exception as e:  # noqa: BLE001 - a contender that cannot run is reported, not fatal
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            if rank == 0:
                print(f"[bench_torchtitan] {name}: {entry['error']}", flush=True)
    timer = Timer(device)
    names = list(runs)
    first = 1 + args.warmup

    def timed(name: str, index: int) -> None:
        """One timed step: its host-exposed time, and the host's time until train_step returned (its host work, and
        any wait for the GPU inside the step)."""
        host = []

        def fn():
            t0 = time.perf_counter()
            step(runs[name], index)
            host.append((time.perf_counter() - t0) * 1e3)

        result["contenders"][name]["times_ms"].append(timer(fn))
        result["contenders"][name]["host_ms"].append(host[0])

    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for name in order:
            for i in range(args.iters):
                timed(name, first + r * args.iters + i)
    for name in names:
        entry = result["contenders"][name]
        entry["summary"] = summary(entry["times_ms"])
        entry["host_summary"] = summary(entry["host_ms"])
    if args.profile:
        profile_steps(args.profile, runs, step, first + args.rounds * args.iters, rank)
    if rank == 0:
        sha, dirty = git_sha()
        data = {"benchmark": "bench_torchtitan", "torchtitan": getattr(torchtitan, "__version__", "?"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "world": args.world, "torch": torch.__version__, "git_sha": sha, "git_dirty": dirty,
                "torchtitan_trainer": result}
        if args.out:
            write_json(args.out, data)
        print(f"{'contender':<10} {'median ms':>10} {'min':>8} {'max':>8} {'host ms':>8} {'loss err':>10} {'grad err':>10}")
        for name, entry in result["contenders"].items():
            s = entry.get("summary")
            if s is None:
                print(f"{name:<10} {entry.get('error', '')[:70]}")
            else:
                print(f"{name:<10} {s['median_ms']:>10.2f} {s['min_ms']:>8.2f} {s['max_ms']:>8.2f} "
                      f"{entry['host_summary']['median_ms']:>8.2f} "
                      f"{entry['loss_rel_err']:>10.2e} {entry['grad_rel_err_all']:>10.2e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
