"""Client benchmark: the models users bring, compiled unmodified with each backend.

1. torchtitan's Llama3 (``tests/_llama_tp.py``: its module, its TP plan with sequence and loss parallelism, its
   per-block ``torch.compile(block, fullgraph=True)``, AdamW and grad clipping) on TP ranks: training steps with
   ``inductor``, ``inductor`` + async-TP (``_micro_pipeline_tp``, GPU only) and ``flux``.  Host exposed: a barrier,
   then the step between two CUDA events (wall clock on CPU).  Contenders alternate round by round; medians and
   spread per contender.  Numerics: loss and gradients after one step against eager.
2. Hugging Face transformers' Llama with ``tp_plan="auto"`` (when transformers is installed): prefill (one forward)
   and decode (``generate`` with a static cache) with ``inductor`` and ``flux``, logits against eager.

Run with torchrun, one process per rank::

    torchrun --nproc-per-node 2 benchmarks/bench_clients.py --out benchmarks/results/clients.json  # GPUs, bf16
    torchrun --nproc-per-node 2 benchmarks/bench_clients.py --tiny --plain-block-input --out /tmp/c.json  # CPU, gloo

(``python -m torch.distributed.run`` in place of ``torchrun`` runs the ranks with the current interpreter.)

The JSON holds the device, versions, git revision, every step time and the numerics; the table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The torchtitan-style model is shared with the tests that check it (tests/compile/test_clients.py).
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from harness import DTYPES, Timer, git_sha, write_json

TITAN_CONTENDERS = ("inductor", "asynctp", "flux")


def setup():
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, world, device


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_ms": statistics.median(ordered), "min_ms": ordered[0], "max_ms": ordered[-1],
            "p10_ms": ordered[len(ordered) // 10], "p90_ms": ordered[(9 * len(ordered)) // 10], "n": len(ordered)}


def numerics(loss: float, loss_ref: float, grads: dict, grads_ref: dict) -> dict[str, object]:
    """A training step's loss and gradients against eager's: relative errors of the loss, of all gradients together,
    and of the worst parameter (named)."""
    per_param = {k: float((grads[k] - g).norm() / g.norm().clamp_min(1e-12)) for k, g in grads_ref.items()}
    return {
        "loss_rel_err": abs(loss - loss_ref) / abs(loss_ref),
        "grad_rel_err_max": max(per_param.values()),
        "grad_rel_err_worst_param": max(per_param, key=per_param.get),
        "grad_rel_err_all": float(sum(float((grads[k] - g).square().sum()) for k, g in grads_ref.items()) ** 0.5
                                  / sum(float(g.square().sum()) for g in grads_ref.values()) ** 0.5),
    }


def backend_for(name: str, device: torch.device, group_name: str):
    """(backend, options) for ``torch.compile``, or raise with why the contender cannot run here."""
    if name == "inductor":
        return "inductor", None
    if name == "flux":
        return "flux", None
    if name == "asynctp":
        if device.type != "cuda":
            raise RuntimeError("async-TP needs CUDA symmetric memory")
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group_name)
        return "inductor", {"_micro_pipeline_tp": True}
    raise ValueError(f"unknown contender {name!r}")


def bench_torchtitan(args, rank: int, world: int, device: torch.device) -> dict[str, object]:
    import _llama_tp as llama
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fluxinductor

    dtype = DTYPES[args.dtype]
    cfg = llama.LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                            ffn_dim=args.ffn, vocab=args.vocab, seq=args.tokens // args.batch)
    mesh = init_device_mesh(device.type, (world,))
    group_name = dist.group.WORLD.group_name
    tokens, labels = llama.tokens_for(cfg, args.batch, device=str(device))

    def build():
        model = llama.parallelize(llama.build(cfg, dtype=dtype, device=str(device), fan_in_init=not args.tiny), mesh)
        model.plain_block_input = args.plain_block_input
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model, optim):
        loss = llama.train_step(model, tokens, labels)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss

    eager, _ = build()
    loss_ref = float(llama.train_step(eager, tokens, labels))
    grads_ref = llama.full_grads(eager)
    del eager

    runs, result = {}, {"config": vars(cfg), "batch": args.batch, "contenders": {}}
    for name in args.contenders:
        entry: dict[str, object] = {}
        result["contenders"][name] = entry
        try:
            backend, options = backend_for(name, device, group_name)
            model, optim = build()
            llama.compile_blocks(model, backend, options, checkpoint=args.checkpoint)
            fluxinductor.reset_rewrite_stats()
            loss = float(llama.train_step(model, tokens, labels))  # compiles; numerics before any optimizer step
            grads = llama.full_grads(model)
            entry.update(numerics(loss, loss_ref, grads, grads_ref))
            optim.zero_grad(set_to_none=True)
            for _ in range(args.warmup):
                step(model, optim)
            entry["rewrite_stats"] = fluxinductor.rewrite_stats()
            entry["times_ms"] = []
            runs[name] = (model, optim)
        except Exception as e:  # noqa: BLE001 - a contender that cannot run is reported, not fatal
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            if rank == 0:
                print(f"[bench_clients] {name}: {entry['error']}", flush=True)
    timer = Timer(device)
    names = list(runs)
    for round_index in range(args.rounds):
        # Alternate the order each round so that no contender always runs first after the others.
        order = names[round_index % len(names):] + names[:round_index % len(names)] if names else []
        for name in order:
            model, optim = runs[name]
            timed = [timer(functools.partial(step, model, optim)) for _ in range(args.iters)]
            result["contenders"][name]["times_ms"] += timed
    for name in names:
        result["contenders"][name]["summary"] = summary(result["contenders"][name]["times_ms"])
    return result


def bench_transformers(args, rank: int, world: int, device: torch.device) -> dict[str, object]:
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        return {"skipped": f"transformers is not installed ({e}); pip install -e .[clients]"}
    import tempfile

    import torch.distributed as dist

    dtype = DTYPES[args.dtype]
    cfg = LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=args.hf_prompt + args.hf_new_tokens + 8)
    result: dict[str, object] = {"version": transformers.__version__, "contenders": {}}
    path = [tempfile.mkdtemp(prefix="bench-clients-hf-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(dtype).save_pretrained(path[0])
    dist.barrier()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, args.vocab, (args.batch, args.hf_prompt), generator=g).to(device)
    timer = Timer(device)

    def load():
        model = LlamaForCausalLM.from_pretrained(path[0], torch_dtype=dtype, tp_plan="auto")
        return model.eval()

    with torch.no_grad():
        try:
            ref_logits = load()(prompt).logits.float()
        except Exception as e:  # noqa: BLE001 - e.g. tp_plan needs accelerate: reported, not fatal
            result["error"] = f"eager reference: {type(e).__name__}: {e}"
            return result
        generate = {"max_new_tokens": args.hf_new_tokens, "do_sample": False, "cache_implementation": "static"}
        models = {}
        for name in ("inductor", "flux"):
            entry: dict[str, object] = {"prefill": [], "generate": []}
            result["contenders"][name] = entry
            try:
                import fluxinductor

                model = load()
                model.forward = torch.compile(model.forward, backend=name)
                fluxinductor.reset_rewrite_stats()
                logits = model(prompt).logits.float()
                entry["logits_rel_err"] = float((logits - ref_logits).norm() / ref_logits.norm())
                model.generate(prompt, **generate)  # compiles the decode graphs
                entry["rewrite_stats"] = fluxinductor.rewrite_stats()
                models[name] = model
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                entry["error"] = f"{type(e).__name__}: {e}"
                entry["traceback"] = traceback.format_exc()[-4000:]
        # Rounds alternate the contenders (and their order), as the training benchmark's do.
        names = list(models)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                entry, model = result["contenders"][name], models[name]
                entry["prefill"] += [timer(functools.partial(model, prompt)) for _ in range(args.iters)]
                entry["generate"].append(timer(functools.partial(model.generate, prompt, **generate)))
        for name in names:
            entry = result["contenders"][name]
            entry["prefill_ms"] = summary(entry.pop("prefill"))
            entry["decode_ms_per_token"] = {k: v / args.hf_new_tokens if k != "n" else v
                                            for k, v in summary(entry.pop("generate")).items()}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model (dim 64, 2 layers, 64 tokens)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x sequence)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--checkpoint", choices=("none", "full", "selective"), default="none",
                   help="activation checkpointing per block, as torchtitan's --activation_checkpoint.mode")
    p.add_argument("--plain-block-input", action="store_true",
                   help="block 0 reads a copy of the embedding's AsyncCollectiveTensor output (torch 2.13 fails the "
                        "backward of a compiled region reading it, for every backend)")
    p.add_argument("--contenders", default=",".join(TITAN_CONTENDERS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="timed steps per contender per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--hf-prompt", type=int, default=512)
    p.add_argument("--hf-new-tokens", type=int, default=32)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-torchtitan", action="store_true", help="only the transformers part")
    p.add_argument("--out", default=None, help="JSON path (rank 0 writes it)")
    args = p.parse_args()
    if args.tiny:
        args.dim, args.heads, args.kv_heads, args.ffn, args.vocab, args.tokens = 64, 4, 2, 128, 128, 32
        args.hf_prompt, args.hf_new_tokens, args.warmup, args.iters, args.rounds = 16, 4, 1, 2, 2
    args.contenders = [c for c in args.contenders.split(",") if c]
    rank, world, device = setup()
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    torch.manual_seed(0)
    sha, dirty = git_sha()
    data = {"benchmark": "bench_clients", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "world": world, "torch": torch.__version__, "git_sha": sha, "git_dirty": dirty,
            "args": vars(args)}
    if not args.skip_torchtitan:
        data["torchtitan_llama3"] = bench_torchtitan(args, rank, world, device)
    if not args.skip_transformers:
        data["transformers_llama"] = bench_transformers(args, rank, world, device)
    if rank == 0:
        if args.out:
            write_json(args.out, data)
        print(f"{'client':<20} {'contender':<10} {'median ms':>10} {'min':>8} {'max':>8} {'numerics':>10}")
        for name, entry in data.get("torchtitan_llama3", {}).get("contenders", {}).items():
            s = entry.get("summary")
            if s is None:
                print(f"{'torchtitan train':<20} {name:<10} {entry.get('error', '')[:60]}")
                continue
            # numerics: loss and all gradients together against eager (the worst single parameter is in the JSON)
            err = max(entry["loss_rel_err"], entry["grad_rel_err_all"])
            print(f"{'torchtitan train':<20} {name:<10} {s['median_ms']:>10.2f} {s['min_ms']:>8.2f} "
                  f"{s['max_ms']:>8.2f} {err:>10.2e}")
        for name, entry in data.get("transformers_llama", {}).get("contenders", {}).items():
            if "error" in entry:
                print(f"{'transformers':<20} {name:<10} {entry['error'][:60]}")
                continue
            for what in ("prefill_ms", "decode_ms_per_token"):
                s = entry[what]
                print(f"{'hf ' + what:<20} {name:<10} {s['median_ms']:>10.2f} {s['min_ms']:>8.2f} "
                      f"{s['max_ms']:>8.2f} {entry['logits_rel_err']:>10.2e}")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
