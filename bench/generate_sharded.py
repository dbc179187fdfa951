"""Generator throughput on 1 GPU and with its KV cache split over N GPUs (``kvdp_group``, by
batch; ``cp_group``, by context), for a model whose cache at the largest batch does not fit
one GPU::

    torchrun --nproc_per_node 2 bench/generate_sharded.py --json generate_sharded.json

A Llama-shaped model with random bf16 weights (default: hidden 2048, 16 layers, 16 query and
16 KV heads of 128, FFN 5632, vocabulary 32000: 1.0 B parameters, 128 KiB of KV cache a
token), ``--batches`` prompts of ``--context - --new`` random tokens each, ``--new`` greedy
tokens. Rows: one GPU (rank 0 alone) at every batch whose cache fits its pool; KVDP and CP
over the world group at every batch; each with the decode steps in CUDA graphs and eager. A
row's decode figure is the mean wall time of the steps that advance the whole batch (prefill
and the steps while requests still arrive are left out), tokens/s = batch / that time. Every
rank runs the same steps; rank 0's times are reported. The prompt phase (prefill) is timed apart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lmfuse.serving import Generator  # noqa: E402


def build_model(args: argparse.Namespace, device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        vocab_size=args.vocab, max_position_embeddings=max(args.context, 4096))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def free_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def serve(gen: Generator, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Every prompt through ``gen.step``: prefill time, full-batch decode step times."""
    for p in prompts:
        gen.add_request(p, max_new_tokens=new, eos_token_id=[])
    full, first, prefill_s = [], None, 0.0
    t_start = time.perf_counter()
    while gen.has_unfinished():
        before = gen.stats["prefill_steps"]
        t0 = time.perf_counter()
        out = gen.step()
        dt = time.perf_counter() - t0
        if gen.stats["prefill_steps"] > before:
            prefill_s += dt
        elif len(out) == len(prompts):
            full.append(dt)
        if first is None and len(out) == len(prompts):
            first = time.perf_counter() - t_start
    total = time.perf_counter() - t_start
    steady = full[2:] if len(full) > 4 else full  # the first steps warm allocator and caches
    step_ms = statistics.mean(steady) * 1e3 if steady else float("nan")
    return dict(decode_step_ms=step_ms, decode_step_ms_median=statistics.median(steady) * 1e3
                if steady else float("nan"), full_batch_steps=len(full),
                tokens_per_s=len(prompts) / (step_ms / 1e3) if steady else float("nan"),
                prefill_s=prefill_s, prompt_tokens_per_s=sum(map(len, prompts)) / prefill_s
                if prefill_s else float("nan"), total_s=total, stats=gen.stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=8192, help="prompt + new tokens")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="48,96")
    ap.add_argument("--splits", default="kvdp,cp")
    ap.add_argument("--block-len", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    timeout = datetime.timedelta(seconds=600)
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:  # a dry run (gloo, TRITON_INTERPRET=1, tiny sizes)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    model = build_model(args, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = Generator.kv_bytes_per_token(model.config)
    g = torch.Generator().manual_seed(1)
    prompt_len = args.context - args.new
    rows: list[dict[str, Any]] = []

    def log(row: dict[str, Any]) -> None:
        rows.append(row)
        if rank == 0:
            keys = ("gpus", "split", "batch", "cuda_graphs", "decode_step_ms", "tokens_per_s",
                    "prefill_s", "note")
            print(" ".join(f"{k}={row[k]:.3f}" if isinstance(row.get(k), float) else
                           f"{k}={row.get(k)}" for k in keys if k in row), flush=True)

    for batch in batches:
        prompts = [torch.randint(0, args.vocab, (prompt_len,), generator=g).tolist()
                   for _ in range(batch)]
        cache_gib = batch * args.context * per_token / 2**30
        # One GPU: rank 0 alone.
        for graphs in (True, False):
            if rank == 0:
                gen = Generator(model, block_len=args.block_len, cuda_graphs=graphs)
                pool_gib = gen.cache.num_blocks * args.block_len * per_token / 2**30
                base = dict(gpus=1, split="none", batch=batch, cuda_graphs=graphs,
                            cache_gib=cache_gib, pool_gib_per_gpu=pool_gib)
                if gen.cache.num_blocks * args.block_len < batch * args.context:
                    log(dict(base, fits=False, note=f"the cache ({cache_gib:.1f} GiB) does "
                             f"not fit one GPU's pool ({pool_gib:.1f} GiB)"))
                else:
                    log(dict(base, fits=True, **serve(gen, prompts, args.new)))
                gen.close()
                del gen
                free_cache(device)
            dist.barrier()
        for split in [s for s in args.splits.split(",") if s]:
            for graphs in (True, False):
                gen = Generator(model, block_len=args.block_len, cuda_graphs=graphs,
                                **{f"{split}_group": dist.group.WORLD})
                pool_gib = gen.cache.num_blocks * args.block_len * per_token / 2**30
                r = serve(gen, prompts, args.new)
                log(dict(gpus=world, split=split, batch=batch, cuda_graphs=graphs,
                         cache_gib=cache_gib, pool_gib_per_gpu=pool_gib, fits=True, **r))
                gen.close()
                del gen
                free_cache(device)
                dist.barrier()
    if rank == 0 and args.json:
        import transformers
        import triton

        env = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu", world=world,
                   torch=torch.__version__, triton=triton.__version__,
                   transformers=transformers.__version__, nccl=".".join(
                       map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                   python=platform.python_version(),
                   date=time.strftime("%Y-%m-%d"))
        model_desc = dict(hidden=args.hidden, layers=args.layers, heads=args.heads,
                          kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
                          weights_gib=weights / 2**30, kv_bytes_per_token=per_token,
                          context=args.context, new=args.new, prompt=prompt_len)
        Path(args.json).write_text(json.dumps(dict(env=env, model=model_desc, rows=rows),
                                              indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
