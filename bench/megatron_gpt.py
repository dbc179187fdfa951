"""A Megatron-Core GPTModel's training step with and without ``lmfuse.megatron.patch``.

    python bench/megatron_gpt.py [--json PATH] [--layers 8] [--hidden 2048] [--heads 16]
        [--query-groups 4] [--ffn 8192] [--vocab 128256] [--seq 2048] [--micro-batch 4]
        [--dtype bf16] [--steps 10] [--warmup 3] [--optimizer] [--ablate]
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 bench/megatron_gpt.py --tp 2 ...

Builds a random-weight ``GPTModel`` with Megatron-Core's local layer spec
(``get_gpt_layer_local_spec(normalization="RMSNorm")``: ``DotProductAttention``, ``MLP``
with SwiGLU, ``torch.nn.RMSNorm``; rotary positions, untied output layer) on one GPU (or
``--tp`` GPUs under torchrun, tensor parallel without sequence parallelism, which the local
spec cannot build), and times one training step: forward with labels, the mean of
Megatron's per-token loss, backward (and a fused AdamW step with ``--optimizer``), for:

* ``megatron-core``: the model as built, with Megatron's own fusions where this install
  has them: ``bias_activation_fusion`` (its jit SwiGLU), ``masked_softmax_fusion`` (its CUDA
  softmax kernel, if ``scaled_masked_softmax_cuda`` is importable, else its PyTorch
  softmax: the JSON says which), ``cross_entropy_loss_fusion`` (native; ``--megatron-ce
  unfused`` for ``vocab_parallel_cross_entropy``), fused bias-dropout-add;
* ``lmfuse``: a copy of the same weights after ``lmfuse.megatron.patch(model)`` (fused
  softmax, SwiGLU, RMSNorm, and the loss through ``linear_cross_entropy`` on the output
  layer's input and weight: no ``[s, b, V / tp]`` logits);
* with ``--ablate``, one row per patched part alone (``patch(model, softmax=True, others
  False)``, ...).

Each row gives the median step time over ``--steps`` steps (CUDA events, after
``--warmup`` steps), tokens/s, the peak memory allocated during one step beyond what was
allocated before it (parameters, gradients and optimizer state excluded), and the agreement
with the unpatched model on the same weights before any optimizer step: the relative
difference of the loss, the largest relative difference over the per-token losses, and the
largest ``||a - b|| / ||b||`` over every parameter's gradient (a few named ones in the JSON).
Megatron's native fused cross-entropy rounds the logits' gradient to bfloat16 whatever the
dtype (``fused_cross_entropy.calculate_gradients``), so in ``--dtype fp32`` the gradients
agree to about 1e-3 against it and to float32 rounding against ``--megatron-ce unfused``.

Needs a CUDA GPU and megatron-core (0.16 or 0.19); on a machine without them it says so and
exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from lmfuse.bench.common import Result, dist_version, environment, print_table

# Parameters whose gradient agreement the JSON lists by name (the last layer's index is
# filled in from --layers).
NAMED_GRADS = ("embedding.word_embeddings.weight",
               "decoder.layers.0.self_attention.linear_qkv.weight",
               "decoder.layers.0.mlp.linear_fc1.weight",
               "decoder.layers.{last}.mlp.linear_fc2.weight",
               "decoder.layers.{last}.pre_mlp_layernorm.weight",
               "decoder.final_layernorm.weight",
               "output_layer.weight")
ABLATIONS = ("softmax", "activations", "rms_norm", "loss")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron_gpt.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--query-groups", type=int, default=4, help="KV heads (GQA); = --heads: MHA")
    p.add_argument("--ffn", type=int, default=8192, help="FFN hidden size (each SwiGLU half)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: torchrun's WORLD_SIZE, else 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--optimizer", action="store_true",
                   help="include a fused AdamW step in the timed step")
    p.add_argument("--ablate", action="store_true",
                   help="also time each patched part alone (softmax, activations, ...)")
    p.add_argument("--megatron-softmax-fusion", choices=("auto", "on", "off"), default="auto",
                   help="Megatron's masked_softmax_fusion for the baseline (auto: on when "
                        "its CUDA kernel is importable)")
    p.add_argument("--megatron-ce", choices=("fused", "unfused"), default="fused",
                   help="Megatron's cross-entropy for the baseline: the native fused one "
                        "(cross_entropy_loss_fusion) or vocab_parallel_cross_entropy")
    p.add_argument("--mask", action="store_true",
                   help="pass an explicit [1, 1, s, s] causal mask (as Megatron-LM's data loader "
                        "makes by default) instead of None")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="write the results as JSON here (rank 0)")
    return p.parse_args(argv)


def fail(message: str) -> int:
    print(f"megatron_gpt.py: {message}", file=sys.stderr)
    return 2


# --- set-up ------------------------------------------------------------------------------------


def init_distributed(tp: int | None) -> tuple[int, int, torch.device]:
    """torch.distributed (NCCL; one rank unless launched by torchrun) and Megatron's model
    parallelism; ``(rank, tensor-parallel size, device)``."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (see KINDS.md)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    else:
        dist.init_process_group("nccl", device_id=device)
    tp = world if tp is None else tp
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(1234)
    return rank, tp, device


def megatron_softmax_kernel() -> bool:
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def build(args: argparse.Namespace, tp: int, softmax_fusion: bool):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, ffn_hidden_size=args.ffn,
        tensor_model_parallel_size=tp, sequence_parallel=False,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=True,
        masked_softmax_fusion=softmax_fusion, bias_dropout_fusion=True,
        cross_entropy_loss_fusion=args.megatron_ce == "fused",
        cross_entropy_fusion_impl="native",
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        init_method_std=0.02)
    torch.manual_seed(args.seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=args.vocab, max_sequence_length=args.seq,
        position_embedding_type="rope", share_embeddings_and_output_weights=False)
    return model.cuda()


def copy_model(model):
    """A deep copy sharing the process groups (which cannot be copied)."""
    pg = torch.distributed.ProcessGroup
    memo: dict[int, Any] = {}
    for m in model.modules():
        for v in vars(m).values():
            inner = list(vars(v).values()) if hasattr(v, "__dict__") and not isinstance(
                v, (torch.nn.Module, torch.Tensor)) else []
            for x in [v, *inner]:
                if isinstance(x, pg):
                    memo[id(x)] = x
    return copy.deepcopy(model, memo)


# --- one step, timed ---------------------------------------------------------------------------


def make_step(model, batch, optimizer=None) -> Callable[[], torch.Tensor]:
    ids, pos, mask, labels = batch

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        per_token = model(ids, pos, mask, labels=labels)
        loss = per_token.float().mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return per_token.detach()

    return step


def time_ms(step: Callable[[], Any], steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def peak_extra_mib(step: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


def agreement(loss, g, ref_loss, ref_g, named: list[str]) -> dict[str, Any]:
    out = {"loss_rel": abs(float(loss.float().mean()) - float(ref_loss.float().mean()))
           / abs(float(ref_loss.float().mean())),
           "per_token_loss_max_rel": float((loss.float() - ref_loss.float()).abs().max()
                                           / ref_loss.float().abs().max()),
           "missing_grads": sorted(set(ref_g) - set(g))}
    worst = max(((rel(g[n], r), n) for n, r in ref_g.items() if n in g), default=(0.0, ""))
    out["grad_max_rel"], out["grad_max_rel_param"] = worst
    out["grads_rel"] = {n: rel(g[n], ref_g[n]) for n in named if n in g and n in ref_g}
    return out


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        return fail("needs a CUDA GPU (it times a Megatron-Core training step); none here")
    try:
        import megatron.core  # noqa: F401
        from megatron.core.package_info import __version__ as megatron_version
    except ImportError as exc:
        return fail(f"needs megatron-core (pip install megatron-core): {exc}")
    from lmfuse.megatron import patch

    rank, tp, device = init_distributed(args.tp)
    say = print if rank == 0 else (lambda *a, **k: None)
    kernel = megatron_softmax_kernel()
    softmax_fusion = {"auto": kernel, "on": True, "off": False}[args.megatron_softmax_fusion]
    base = build(args, tp, softmax_fusion)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(args.seq, device=device).expand(args.micro_batch, args.seq)
    mask = (torch.ones(args.seq, args.seq, dtype=torch.bool, device=device).triu(1)[None, None]
            if args.mask else None)  # None: the causal mask type alone
    batch = (ids, pos, mask, labels)
    tokens = args.micro_batch * args.seq
    named = [n.format(last=args.layers - 1) for n in NAMED_GRADS]
    case = (f"GPT {args.layers}x{args.hidden} h{args.heads}/{args.query_groups} "
            f"ffn{args.ffn} V{args.vocab} [{args.micro_batch}x{args.seq}] {args.dtype}"
            f"{f' tp{tp}' if tp > 1 else ''}{' mask' if args.mask else ''}")
    say(f"# {torch.cuda.get_device_name(device)} | torch {torch.__version__} | megatron-core "
        f"{megatron_version} | Megatron softmax: "
        f"{'fused CUDA kernel' if softmax_fusion and kernel else 'PyTorch'}")

    def run(model) -> tuple[list[float], float, torch.Tensor, dict[str, torch.Tensor]]:
        loss = make_step(model, batch)()  # the agreement step: weights as built
        g = grads(model)
        optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
                     if args.optimizer else None)
        step = make_step(model, batch, optimizer)
        times = time_ms(step, args.steps, args.warmup)
        mem = peak_extra_mib(step)
        del optimizer
        return times, mem, loss, g

    variants: dict[str, dict[str, bool] | None] = {"lmfuse": {}}
    if args.ablate:
        for part in ABLATIONS:
            variants[f"lmfuse {part} only"] = {p: p == part for p in ABLATIONS}
    rows, details = [], {}
    try:
        ref_loss, ref_grads = make_step(base, batch)(), grads(base)
    except Exception as exc:
        return fail(f"the unpatched Megatron-Core model's step failed: "
                    f"{type(exc).__name__}: {exc}")
    summary = None
    for impl, flags in variants.items():
        try:
            model = copy_model(base)
            s = patch(model, **flags)
            summary = summary or s
            times, mem, loss, g = run(model)
            agree = agreement(loss, g, ref_loss, ref_grads, named)
            details[impl] = {"times_ms": times, "agreement": agree, "patched": s}
            ms = sorted(times)[len(times) // 2]
            note = (f"{tokens / ms * 1e3:,.0f} tokens/s; loss rel {agree['loss_rel']:.1e}; "
                    f"worst grad rel {agree['grad_max_rel']:.1e}")
            rows.append(Result(case, impl, ms, None, None, mem, note))
            del model, g
        except Exception as exc:  # a failing variant is a row with a note
            rows.append(Result(case, impl, None, None, None, None,
                               f"failed: {type(exc).__name__}: {exc}"[:200]))
        torch.cuda.empty_cache()
    try:  # the baseline last: its optimizer steps change its weights
        times, mem, _, _ = run(base)
        ms = sorted(times)[len(times) // 2]
        details["megatron-core"] = {"times_ms": times}
        rows.insert(0, Result(case, "megatron-core", ms, None, None, mem,
                              f"{tokens / ms * 1e3:,.0f} tokens/s"))
    except Exception as exc:
        rows.insert(0, Result(case, "megatron-core", None, None, None, None,
                              f"failed: {type(exc).__name__}: {exc}"[:200]))
    lm = next((r.ms for r in rows if r.impl == "lmfuse"), None)
    for r in rows:
        r.ratio = r.ms / lm if (r.ms and lm) else None
    if rank == 0:
        print_table(rows)
    if args.json and rank == 0:
        import json
        from dataclasses import asdict

        env = environment(device)
        env.update({"megatron-core": megatron_version,
                    "megatron_softmax": "fused CUDA kernel" if softmax_fusion and kernel
                    else "PyTorch", "tensor_parallel": tp,
                    "transformer-engine": dist_version("transformer-engine"),
                    "apex": dist_version("apex")})
        payload = {"environment": env, "args": vars(args), "patch_summary": summary,
                   "results": [asdict(r) for r in rows], "details": details}
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
        print(f"wrote {args.json}")
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
