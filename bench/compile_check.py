"""Compile every kernel launch of ``lmfuse check`` for a GPU target, on a machine without one.

    python bench/compile_check.py [--table h200] [--arch 90] [--dtypes fp32,fp16]
                                  [--bf16] [--serving] [--triton SITE_PACKAGES] [--json PATH]

Two steps. First ``lmfuse check``'s cases run on the CPU with Triton's interpreter (set
here, before lmfuse is imported) and every kernel launch is recorded: the kernel, its
arguments' types and its constexprs and launch options. ``--table`` picks the tuning table
the launches read (as if on that GPU: ``h200``, ``h100``; default: the CPU's, i.e.
default.json). Then a second process, without the interpreter, compiles each distinct
launch for ``cuda`` at ``--arch``, through PTX, and prints what did not compile: with the
Triton it imports, or with the one under ``--triton`` (a ``site-packages`` holding another
version, e.g. ``pip install --target DIR triton==3.6.0``: a GPU image's version may refuse
what the interpreter's accepts; the capture keeps the interpreter's Triton, whose
interpreter the tests use). ``--bf16`` also compiles each half-precision launch with
bfloat16 pointers (the interpreter cannot run bfloat16 dots, so ``--dtypes`` keeps to fp32
and fp16).

``--serving`` adds the Generator's kernels (GEMVs, fused decode layers, KV appends): tiny
random models of a few families (Llama, Qwen3, Gemma 2, GPT-OSS; bf16 and fp8 caches)
generate a few tokens with ``impl="triton"``.

It catches what the interpreter lets through and the compiler refuses (a string default of
a nested jit function in Triton 3.6, 2026-11-29; shapes or layouts the backend rejects),
not wrong results or speed: those need the GPU (``lmfuse check`` there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _type_of(value) -> tuple[str, object]:
    """``(signature type, constexpr value or None)`` of one runtime argument as Triton
    specialises it: a tensor is a pointer to its dtype, None a constexpr, a bool i1, an int
    i32 or i64, a float fp32."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_DTYPE[value.dtype], None
    if value is None:
        return "constexpr", None
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), None
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"no signature type for {type(value).__name__}")


def _constexpr_value(value):
    """A constexpr as JSON: Triton dtypes by name, the rest as themselves."""
    name = getattr(value, "name", None)
    if type(value).__module__.startswith("triton") and isinstance(name, str):
        return {"tl_dtype": name}
    return value


def _long_rows_workload() -> None:
    """Cross-entropy rows past lmfuse check's sizes: unaligned ones over 65536 columns take
    the sliced fused pass (``ce_slices_kernel``) in the shipped tables."""
    import torch

    import lmfuse

    for dtype in (torch.float32, torch.float16):
        x = torch.randn(3, 70001, dtype=dtype, requires_grad=True)
        t = torch.tensor([0, 70000, -100])
        for kw in ({}, dict(label_smoothing=0.1, z_loss=1e-4),
                   dict(weight=torch.rand(70001))):
            torch.autograd.grad(lmfuse.cross_entropy(x, t, **kw), x)


def _serving_workload() -> None:
    """A few tokens from tiny models of the Generator's families, on its fused path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmfuse.serving import Generator

    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
                max_position_embeddings=256)
    families = {"llama": {}, "qwen3": {}, "gemma2": dict(sliding_window=6,
                                                         attn_logit_softcapping=2.0,
                                                         final_logit_softcapping=5.0),
                "gpt_oss": dict(sliding_window=6, num_local_experts=4, num_experts_per_tok=2)}
    for family, extra in families.items():
        torch.manual_seed(0)
        config = AutoConfig.for_model(family, **tiny, **extra)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        for kv_dtype in (None, torch.float8_e4m3fn):
            gen = Generator(model, block_len=4, num_blocks=48, impl="triton",
                            kv_dtype=kv_dtype)
            gen.generate([[5, 6, 7, 8, 9, 10, 11], [3]], max_new_tokens=3, eos_token_id=[])


def _engine_workload() -> None:
    """The kernels no CPU case of lmfuse check launches, each called as its GPU path calls
    it, on CPU tensors: the mixture-of-experts grouped-GEMM engine's element-wise kernels
    (``torch._grouped_mm`` runs on the CPU too) and its large routing, the vocabulary
    parallel merge (a gloo group of one rank), the decode block's fused qk-norm, rotary and
    append, the Generator's argmax, bus copy and L2 prefetch. A launch the interpreter
    cannot run (the prefetch's inline PTX) is recorded before it fails."""
    import tempfile

    import torch
    import torch.distributed as dist

    import lmfuse
    from lmfuse.attention.block import qk_norm_rope_append
    from lmfuse.cross_entropy import ops as ce_ops
    from lmfuse.cross_entropy import vocab_parallel
    from lmfuse.moe import ops as moe_ops
    from lmfuse.moe.routing import route_large
    from lmfuse.serving.fused_ops import l2_prefetch
    from lmfuse.serving.runner import bus_copy
    from lmfuse.serving.sampling import argmax_rows

    engine = moe_ops._grouped_engine
    moe_ops._grouped_engine = lambda *args, **kwargs: True  # as on a Hopper GPU in bf16
    try:
        T, H, F, E, k = 48, 32, 16, 4, 2
        for activation, kw in (("swiglu", {}), ("quick_geglu", dict(
                gate_up_layout="interleaved", linear_offset=1.0, clamp_value=7.0,
                bias=True)), ("swiglu", dict(fp8_input_store=True))):
            bias = kw.pop("bias", False)
            leaves = [torch.randn(T, H), torch.rand(T, k), torch.randn(E, 2 * F, H) / 8,
                      torch.randn(E, H, F) / 8]
            if bias:
                leaves += [torch.randn(E, 2 * F), torch.randn(E, H)]
            leaves = [t.to(torch.bfloat16).requires_grad_(True) for t in leaves]
            ids = torch.randint(0, E, (T, k))
            h, rw, wgu, wd = leaves[:4]
            out = lmfuse.moe_experts(h, ids, rw, wgu, wd, activation=activation,
                                     gate_up_bias=leaves[4] if bias else None,
                                     down_bias=leaves[5] if bias else None, impl="triton", **kw)
            torch.autograd.grad(out.float().square().sum(), leaves)
    finally:
        moe_ops._grouped_engine = engine
    route_large(torch.randint(-1, 6, (700, 3)), torch.rand(700, 3), 5)

    # The merge runs with two ranks or more: a gloo group of one, seen as two (its
    # all-gather gives this rank's stats twice, its agreement check is skipped).
    patched = [(ce_ops, "group_size", lambda group: 2), (ce_ops, "check_agreed_once",
                                                         lambda *args, **kwargs: None),
               (vocab_parallel, "all_gather_stacked", lambda t, group: torch.stack([t, t]))]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=0,
                                world_size=1)
        try:
            for module, name, fn in patched:
                setattr(module, name, fn)
            x = torch.randn(6, 40, requires_grad=True)
            t = torch.tensor([0, 79, -100, 5, 47, 1])
            for kw in ({}, dict(label_smoothing=0.1, z_loss=1e-4),
                       dict(weight=torch.rand(40)), dict(return_predicted_tokens=True)):
                out = lmfuse.cross_entropy(x, t, tp_group=dist.group.WORLD, impl="triton",
                                           **kw)
                loss = out.loss if isinstance(out, tuple) else out
                torch.autograd.grad(loss, x)
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)
            dist.destroy_process_group()

    B, Hq, Hkv, D = 2, 4, 2, 16
    with torch.inference_mode():
        for cache_dtype, paged in ((torch.float16, False), (torch.float8_e4m3fn, True)):
            shape = (6, 4, Hkv, D) if paged else (B, 12, Hkv, D)
            k_cache = torch.zeros(shape, dtype=cache_dtype)
            v_cache = torch.zeros(shape, dtype=cache_dtype)
            qk_norm_rope_append(
                torch.randn(B, 1, (Hq + 2 * Hkv) * D, dtype=torch.float16), k_cache, v_cache,
                torch.tensor([3, 5]), num_heads=Hq, num_kv_heads=Hkv,
                q_norm_weight=torch.rand(D, dtype=torch.float16),
                k_norm_weight=torch.rand(D, dtype=torch.float16),
                inv_freq=1.0 / 10000 ** (torch.arange(0, D, 2) / D),
                block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
                if paged else None,
                k_scale=torch.ones(Hkv) if paged else None,
                v_scale=torch.ones(Hkv) if paged else None, impl="triton")

    argmax_rows(torch.randn(3, 5000))
    bus_copy(torch.empty(3000, dtype=torch.int64), torch.arange(3000))
    try:
        l2_prefetch([(torch.empty(4096, dtype=torch.bfloat16), 8192)])
    except Exception:  # noqa: BLE001  (inline PTX: recorded, not run)
        pass


def capture(table: str | None, dtypes: str, serving: bool = False) -> list[dict]:
    """Run ``lmfuse check``'s cases, long cross-entropy rows, the kernels those leave out
    (:func:`_engine_workload`; with ``serving`` the Generator's too) under the interpreter;
    the distinct launches."""
    os.environ["TRITON_INTERPRET"] = "1"
    import importlib

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from lmfuse import tuning
    from lmfuse._check import run_all
    from lmfuse.cli import CHECKED, _dtype_list

    if table:
        tuning._cached_key.cache_clear()
        tuning._cached_key = lambda device: table  # the launches read that GPU's table
    seen: dict[str, dict] = {}
    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            _record(self, args, kwargs, seen)
        except Exception as exc:  # noqa: BLE001  (a launch we cannot describe: said, not fatal)
            print(f"  not recorded: {self.fn.__name__}: {exc}", file=sys.stderr)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        torch.manual_seed(0)
        cases = [case for module in CHECKED for case in importlib.import_module(
            f"lmfuse.{module}").checks(torch.device("cpu"), _dtype_list(dtypes))]
        run_all(cases, out=lambda *a, **k: None)
        _long_rows_workload()
        _engine_workload()
        if serving:
            _serving_workload()
    finally:
        InterpretedFunction.run = real_run
    return list(seen.values())


_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


def _record(kernel, args: tuple, kwargs: dict, seen: dict) -> None:
    import inspect

    params = list(inspect.signature(kernel.fn).parameters.values())
    bound = dict(zip((p.name for p in params), args))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    signature, constexprs = {}, {}
    for p in params:
        is_constexpr = "constexpr" in str(p.annotation)
        if p.name in bound:
            value = bound[p.name]
        elif p.default is not inspect.Parameter.empty:
            value = p.default
        else:
            raise TypeError(f"argument {p.name} missing")
        if is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = _constexpr_value(value)
        else:
            kind, _ = _type_of(value)
            signature[p.name] = kind
            if kind == "constexpr":
                constexprs[p.name] = None
    spec = {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__,
            "signature": signature, "constexprs": constexprs,
            "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}
    seen.setdefault(json.dumps(spec, sort_keys=True), spec)


def compile_specs(specs: list[dict], arch: int, bf16: bool) -> list[dict]:
    """Compile each launch for ``cuda`` at ``arch`` (no GPU needed); one result a launch."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    print(f"compiling with triton {triton.__version__} ({triton.__file__})", flush=True)
    todo = list(specs)
    if bf16:
        todo += [dict(s, signature={k: v.replace("*fp16", "*bf16") for k, v in
                                    s["signature"].items()}, as_bf16=True)
                 for s in specs if any(v == "*fp16" for v in s["signature"].values())]
    results = []
    for spec in todo:
        fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        constexprs = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v
                      for k, v in spec["constexprs"].items()}
        t0 = time.perf_counter()
        try:
            triton.compile(ASTSource(fn, spec["signature"], constexprs=constexprs),
                           target=target, options=dict(spec["options"]))
            error = None
        except Exception as exc:  # noqa: BLE001
            lines = [line for line in str(exc).splitlines() if line.strip()]
            error = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
        results.append(dict(spec, error=error, seconds=round(time.perf_counter() - t0, 2)))
        print(f"{'FAIL' if error else 'ok  '} {spec['kernel']}"
              f"{' (bf16)' if spec.get('as_bf16') else ''} {spec['options']}"
              + (f"\n      {error}" if error else ""), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", help="the tuning table the launches read (h200, h100, ...)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    p.add_argument("--dtypes", default="fp32,fp16", help="lmfuse check's dtypes")
    p.add_argument("--bf16", action="store_true",
                   help="also compile the half-precision launches with bfloat16 pointers")
    p.add_argument("--serving", action="store_true",
                   help="also the Generator's kernels (tiny models of four families)")
    p.add_argument("--triton", help="a site-packages whose Triton the compile step imports")
    p.add_argument("--json", help="write every launch and its result here")
    p.add_argument("--compile", help=argparse.SUPPRESS)  # the second step's input
    args = p.parse_args(argv)
    if args.compile:
        with open(args.compile) as f:
            specs = json.load(f)
        results = compile_specs(specs, args.arch, args.bf16)
        with open(args.compile, "w") as f:
            json.dump(results, f, indent=1)
        return 0
    specs = capture(args.table, args.dtypes, args.serving)
    print(f"{len(specs)} distinct launches from lmfuse check"
          f"{' and the Generator' if args.serving else ''} (table: "
          f"{args.table or 'default'}); compiling for sm_{args.arch}", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(specs, f)
        path = f.name
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if args.triton:
        env["PYTHONPATH"] = os.pathsep.join(
            [args.triton] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, __file__, "--compile", path, "--arch", str(args.arch)]
    subprocess.run(cmd + (["--bf16"] if args.bf16 else []), env=env, check=True)
    with open(path) as f:
        results = json.load(f)
    os.unlink(path)
    failed = [r for r in results if r["error"]]
    print(f"{len(results) - len(failed)} of {len(results)} compiled, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


_TRITON_DTYPE = {}


def _dtype_table() -> None:
    import torch

    _TRITON_DTYPE.update({
        torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
        torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
        torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
        torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"})


if __name__ == "__main__":
    _dtype_table()
    sys.exit(main())
