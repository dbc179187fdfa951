"""The ``lmfuse`` command: ``info``, ``check``, ``demo``, ``generate``, ``bench``, ``plan`` and
``tune``.

    lmfuse info              versions, devices, and which path each op takes here
    lmfuse check             every op against its reference, forward and gradients
    lmfuse demo              train a tiny GPT with lmfuse's ops and in plain PyTorch, then
                             decode over a paged KV cache (``lmfuse demo --help``)
    lmfuse generate MODEL_DIR --prompt TEXT
                             continue prompts with a local Hugging Face checkpoint on the
                             paged KV cache (``lmfuse generate --help``)
    lmfuse bench softmax     time lmfuse against its peers (lmfuse/bench/softmax.py; also
                             ``python -m lmfuse.bench.softmax``)
    lmfuse plan              how to shard a decode KV cache: TP, KVDP, CP or a mix
    lmfuse tune linear_cross_entropy
                             sweep launch configs on this GPU; record the fastest in the
                             user cache (lmfuse.tuning.user_cache_path()) that ops read

``python -m lmfuse ...`` runs the same command. A bad argument is one line on stderr and exit
status 2, before any work is done.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import re
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from ._cli_args import (DTYPES, ArgumentParser, dtype_name, int_list, int_range,  # noqa: F401
                        missing_package, number_range, output_file, seed)

FAMILIES = ("softmax", "cross_entropy", "linear_cross_entropy", "activations", "decode_attention",
            "rms_norm", "layer_norm", "rope", "moe_experts", "generate", "host")
TUNABLE = ("linear_cross_entropy",)
#: The modules whose ``checks(device, dtypes)`` ``lmfuse check`` runs, in order.
CHECKED = ("softmax.ops", "cross_entropy.ops", "cross_entropy.linear", "activations.ops",
           "attention.ops", "norm.ops", "rope.ops", "moe.ops")


def _best_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cmd_info(args: argparse.Namespace) -> int:
    import lmfuse
    from lmfuse._dispatch import interpreter_active, triton_available

    device = _best_device()
    print(f"lmfuse {lmfuse.__version__}")
    print(f"python {platform.python_version()} | torch {torch.__version__}", end="")
    if triton_available():
        import triton

        print(f" | triton {triton.__version__}")
    else:
        print(" | triton not installed")
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, "
                  f"{p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
    else:
        print("no CUDA device")
    print("Triton interpreter (TRITON_INTERPRET=1): "
          + ("on" if triton_available() and interpreter_active() else
             "off (triton not installed)" if not triton_available() else "off"))
    from lmfuse.integrations.transformers import SUPPORTED_MODEL_TYPES
    from lmfuse.serving.engine import SUPPORTED_MODEL_TYPES as SERVING_TYPES

    print(f"apply_lmfuse model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    print(f"lmfuse.serving.Generator model types: {', '.join(SERVING_TYPES)}")
    print()
    x = torch.randn(1, 2, 4, 8, device=device)
    print("paths for a sample input on the best device:")
    print(lmfuse.explain(lmfuse.fused_softmax, x, causal=True))
    logits = torch.randn(4, 1000, device=device, requires_grad=True)
    target = torch.randint(0, 1000, (4,), device=device)
    print(lmfuse.explain(lmfuse.cross_entropy, logits, target))
    h = torch.randn(4, 2 * 300, device=device, requires_grad=True)
    print(lmfuse.explain(lmfuse.swiglu, h, torch.zeros(600, device=device)))
    print(lmfuse.explain(lmfuse.rms_norm, h, torch.ones(600, device=device)))
    return 0


def _check_in_interpreter(argv: list[str] | None) -> int | None:
    """Without CUDA, ``lmfuse check`` runs the Triton kernels in Triton's interpreter. Triton
    reads ``TRITON_INTERPRET`` when it is imported (its own library's functions are made
    then), which may have happened before this runs (torch's compiler imports it): so when
    the variable is not set, the check runs
    in a child process that has it, and this returns its exit status (None: run here)."""
    if (torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ
            or importlib.util.find_spec("triton") is None):
        return None
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    argv = sys.argv[1:] if argv is None else list(argv)
    return subprocess.call([sys.executable, "-m", "lmfuse", *argv], env=env)


def cmd_check(args: argparse.Namespace) -> int:
    from lmfuse._check import run_all
    from lmfuse._dispatch import interpreter_active, triton_available

    device = _best_device()
    where = device.type if device.type == "cuda" else (
        "cpu, Triton kernels in the interpreter" if triton_available() and interpreter_active()
        else "cpu, reference only")
    print(f"lmfuse check on {where}: each op against its float64 reference")
    torch.manual_seed(args.seed)
    ok = run_all([case for module in CHECKED for case in importlib.import_module(
        f"lmfuse.{module}").checks(device, args.dtypes)])
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def _dtype_list(text: str) -> list[torch.dtype]:
    """``--dtypes fp32,bf16`` -> dtypes."""
    return [DTYPES[dtype_name(name)] for name in text.split(",")]


def _bench_main(family: str) -> Callable[[list[str]], Optional[int]]:
    return importlib.import_module(f"lmfuse.bench.{family}").main


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        bench_main = _bench_main(args.family)
    except ModuleNotFoundError as exc:  # a package the harness imports at the top
        if not exc.name or exc.name.split(".")[0] == "lmfuse":
            raise
        package = exc.name.split(".")[0]
        print(f"lmfuse bench {args.family}: needs {package}, which is not installed here: "
              f"pip install {package}", file=sys.stderr)
        return 2
    return int(bench_main(rest) or 0)


def cmd_tune(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("lmfuse tune: no CUDA device here; tuning times kernels on the GPU it tunes "
              "for", file=sys.stderr)
        return 2
    import json

    from lmfuse import tuning
    from lmfuse.cross_entropy import tune

    if not args.dry_run:
        try:  # (where its results go, before minutes of timing)
            tuning.user_cache_path()
        except RuntimeError as exc:
            print(f"lmfuse tune: {str(exc).removeprefix('lmfuse: ')}", file=sys.stderr)
            return 2
    shapes = args.shape or list(tune.TUNE_SHAPES)
    results = tune.tune(shapes, DTYPES[args.dtype], torch.device("cuda"),
                        max_chunk_bytes=args.max_chunk_mib * 2**20, record=not args.dry_run)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__,
            cache=None if args.dry_run else str(tuning.user_cache_path()), results=results),
            indent=1) + "\n")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from lmfuse.distributed.planner import plan_sharding

    try:
        plan = plan_sharding(args.batch, args.q_heads, args.kv_heads, args.ranks, args.context,
                             args.head_dim, args.layers, args.dtype, args.hbm_gib,
                             s_active=args.s_active, tp=args.tp, cost_model=args.calibrate)
    except (TypeError, ValueError) as exc:
        # (the planner names its parameters; the command line's are their flags)
        message = str(exc)
        for param in ("batch", "q_heads", "kv_heads", "ranks", "context_len", "head_dim",
                      "n_layers", "dtype", "hbm_gib", "s_active", "tp", "cost_model"):
            flag = {"context_len": "context", "n_layers": "layers",
                    "cost_model": "calibrate"}.get(param, param).replace("_", "-")
            # (where the message names it as a value: "x must ...", "x (12) ...", "x = ...")
            message = re.sub(rf"(?<![\w/-]){param}(?= (must|\(|=|is\b))", f"--{flag}",
                             message)
        print(f"lmfuse plan: {message.removeprefix('plan_sharding: ')}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: the usual exit status, no traceback
        return 130
    except BrokenPipeError:  # `lmfuse info | head`: the reader left; stop quietly
        # (stdout pointed at /dev/null so that the interpreter's final flush cannot raise)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    parser = ArgumentParser(prog="lmfuse", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and the path each op takes")
    check = sub.add_parser("check", help="every op against its reference, on the best device")
    check.add_argument("--dtypes", type=_dtype_list, default="fp32,fp16,bf16",
                       help="comma-separated: fp32,fp16,bf16")
    check.add_argument("--seed", type=seed, default=0, help="torch's seed (default 0)")
    # Its options are parsed by lmfuse.demo.main (``lmfuse demo --help``).
    sub.add_parser("demo", add_help=False,
                   help="train a tiny GPT with lmfuse and plain PyTorch, then decode")
    from lmfuse import generate_cli

    generate = sub.add_parser("generate", help="continue prompts with a local Hugging Face "
                              "checkpoint on lmfuse's paged KV cache",
                              description=generate_cli.DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    generate_cli.add_arguments(generate)
    bench = sub.add_parser("bench", help="benchmark an op family against its peers",
                           description="Time lmfuse against its peers. The options after "
                           "FAMILY go to its harness: `lmfuse bench FAMILY --help`.")
    bench.add_argument("family", choices=FAMILIES, metavar="FAMILY",
                       help=f"one of {', '.join(FAMILIES)}")
    # Everything after FAMILY, --help included, is the harness's.
    bench.add_argument("options", nargs=argparse.REMAINDER, metavar="...",
                       help="the harness's options (`lmfuse bench FAMILY --help`)")
    plan = sub.add_parser("plan", help="how to shard a decode KV cache over ranks "
                          "(defaults: a GPT-OSS-120B-like model at 128K context)")
    for flag, default, text in (("--batch", 16, "sequences decoded together"),
                                ("--q-heads", 64, "query heads"), ("--kv-heads", 8, "KV heads"),
                                ("--ranks", 64, "ranks (GPUs)"),
                                ("--context", 131072, "cached tokens per sequence"),
                                ("--head-dim", 64, "head dim"), ("--layers", 80, "layers"),
                                ("--s-active", 1, "tokens decoded per step (1..8)")):
        plan.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    plan.add_argument("--dtype", default="bf16", help="KV cache dtype: bf16, fp16, fp32, fp8 "
                      "(default bf16)")
    plan.add_argument("--hbm-gib", type=number_range(0.0, 1e9, above=True), default=141.0,
                      help="GiB per rank the KV cache may use (default 141)")
    plan.add_argument("--tp", type=int, default=None,
                      help="ways the KV heads are split (default min(kv-heads, ranks)); 1: "
                      "every rank holds every KV head of its sequences")
    plan.add_argument("--calibrate", metavar="FILE",
                      help="predict each split's layer and step time from a cost model fitted "
                      "to FILE (bench/decode_sharded.py --calibrate --json FILE)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    tune = sub.add_parser("tune", help="sweep launch configs on this GPU, record the best")
    tune.add_argument("family", choices=TUNABLE)
    tune.add_argument("--shape", type=int_list(3, "N,H,V (three ints)"), action="append",
                      help="N,H,V to tune (repeatable; default: N=8192, H=4096, "
                           "V=32000/128256/262144); the result serves V's bucket")
    tune.add_argument("--dtype", type=dtype_name, default="bf16",
                      help="fp32, fp16 or bf16 (default bf16)")
    tune.add_argument("--max-chunk-mib", type=int_range(1), default=512,
                      help="largest logits chunk budget to try, in MiB (default 512: "
                           "larger chunks are faster at large V but cost that much memory)")
    tune.add_argument("--dry-run", action="store_true", help="time, but record nothing")
    tune.add_argument("--json", type=output_file, help="write every trial to this file")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, args.options + rest)
    if args.command == "demo":
        from lmfuse.demo import main as demo_main

        return demo_main(rest)
    if rest:
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        code = _check_in_interpreter(argv)
        if code is not None:
            return code
    return {"info": cmd_info, "check": cmd_check, "plan": cmd_plan,
            "tune": cmd_tune, "generate": generate_cli.run}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
