"""Compile decode attention's kernel for a GPU without one, and count what its key loop runs.

    python bench/sass_decode.py [--fp8] [--block-n 32] [--warps 1] [--stages 3] [--head-dim 128]
                                [--group 4] [--s-active 1] [--paged] [--no-widen] [--arch 90]

Loads ``src/lmfuse/attention/decode_kernels.py`` by path (no torch, no lmfuse import), compiles
``decode_kernel`` with ``triton.compile`` for ``cuda:<arch>`` (the specialisation a real
launch gets: 16-byte aligned pointers, strides and lengths divisible by 16, one split), and
prints the registers, spills and shared memory ptxas gives it, the PTX's shared-memory and
conversion operations, and the SASS of the key loop (the body of its one backward branch):
instructions per iteration and warp, by opcode. Run it with the Triton the GPU runs (the GPU
image has triton 3.6: ``python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0``,
then ``/tmp/t36/bin/python bench/sass_decode.py ...``): its wheel carries ptxas and cuobjdump,
so no CUDA toolkit or GPU is needed. How the fp8 V-widening fix of 2026-11-25 was found
(BENCHMARKS.md, decode attention).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNELS = (Path(__file__).resolve().parents[1] / "src" / "lmfuse" / "attention"
           / "decode_kernels.py")
# "/*0f60*/  @!P0 OPCODE.MODIFIERS ...": address, optional predicate, opcode
INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+\s+)?"
                   r"([A-Z][A-Z0-9]*(\.[A-Z0-9_.]+)?)")
BRANCH = re.compile(r"BRA\s+(0x[0-9a-f]+)")


def compile_kernel(args: argparse.Namespace):
    spec = importlib.util.spec_from_file_location("decode_kernels", KERNELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.decode_kernel
    cache = "*fp8e4nv" if args.fp8 else "*bf16"
    sig = dict(Q="*bf16", K=cache, V=cache, SEQLENS="*i32", TABLE="*i32", SINKS="*bf16",
               K_SCALE="*fp32", V_SCALE="*fp32", OUT="*bf16", LSE="*fp32", stride_blk="i64",
               stride_row="i32", stride_h="i32", stride_tb="i32", num_kv_heads="i32",
               num_splits="i32", keys_per_split="i32", qk_scale="fp32", window="i32",
               capacity="i32", num_blocks="i32")
    rows = args.group * args.s_active
    block_m = max(16, 1 << (rows - 1).bit_length())
    block_d = max(16, 1 << (args.head_dim - 1).bit_length())
    consts = dict(S_ACT=args.s_active, GROUP=args.group, D=args.head_dim, BLOCK_M=block_m,
                  BLOCK_N=args.block_n, BLOCK_D=block_d, PAGED=args.paged, BLOCK_LEN=16,
                  HAS_WINDOW=False, HAS_SINKS=False, HAS_K_SCALE=args.fp8,
                  HAS_V_SCALE=args.fp8, WRITE_LSE=False, DOT_F32=False, F16_DOT=args.fp8,
                  IEEE=False, NUM_STAGES=args.stages, WIDEN_V_FIRST=args.fp8 and args.widen,
                  num_splits=1)
    names = fn.arg_names
    missing = [n for n in names if n not in sig and n not in consts]
    if missing:
        raise SystemExit(f"sass_decode: decode_kernel has arguments this script does not set: "
                         f"{missing}; add them to sig/consts")
    signature = {n: ("constexpr" if n in consts else sig[n]) for n in names}
    aligned = [n for n, t in sig.items() if t.startswith("*")] + [
        "stride_blk", "stride_row", "stride_h", "keys_per_split", "capacity"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", args.arch, 32),
                          options=dict(num_warps=args.warps, num_stages=args.stages))


def loop_histogram(sass: str) -> tuple[int, collections.Counter]:
    """Instructions between the last backward branch and its target (the key loop)."""
    lines = [m for m in (INSTR.match(line) for line in sass.splitlines()) if m]
    addr = [int(m.group(1), 16) for m in lines]
    loop = None
    for i, m in enumerate(lines):
        b = BRANCH.search(m.string)
        if b and int(b.group(1), 16) < addr[i]:
            loop = (addr.index(int(b.group(1), 16)), i)
    if loop is None:
        return 0, collections.Counter()
    body = lines[loop[0]:loop[1] + 1]
    return len(body), collections.Counter(m.group(3) for m in body)


def _run(*cmd) -> str:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          check=True).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true", help="float8_e4m3fn caches (else bf16)")
    parser.add_argument("--block-n", type=int, default=32)
    parser.add_argument("--warps", type=int, default=1)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--s-active", type=int, default=1)
    parser.add_argument("--paged", action="store_true")
    parser.add_argument("--no-widen", dest="widen", action="store_false",
                        help="fp8: let Triton place V's widening (WIDEN_V_FIRST=False)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", help="also write the kernel's ttgir, ptx and sass here")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    kernel = compile_kernel(args)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path(args.out or "/tmp") / "decode_kernel.cubin"
    cubin.parent.mkdir(parents=True, exist_ok=True)
    cubin.write_bytes(kernel.asm["cubin"])
    sass = _run(bindir / "cuobjdump", "-sass", cubin)
    usage = [line.strip() for line in _run(bindir / "cuobjdump", "-res-usage", cubin)
             .splitlines() if "REG:" in line]
    if args.out:
        for kind in ("ttgir", "ptx"):
            (Path(args.out) / f"decode_kernel.{kind}").write_text(kernel.asm[kind])
        (Path(args.out) / "decode_kernel.sass").write_text(sass)
    print(f"triton {triton.__version__}, sm_{args.arch}: {usage[0] if usage else '?'}; "
          f"dynamic shared memory {kernel.metadata.shared} bytes")
    ptx_ops = collections.Counter(re.findall(
        r"\b(ld\.shared\.[a-z0-9.]+|st\.shared\.[a-z0-9.]+|ldmatrix[a-z0-9.]*|cp\.async\.[a-z]+|"
        r"cvt\.rn\.f16x2\.e4m3x2|mma\.sync\.[a-z0-9.]+)", kernel.asm["ptx"]))
    print("PTX:", ", ".join(f"{op} x{n}" for op, n in sorted(ptx_ops.items())))
    n, hist = loop_histogram(sass)
    print(f"key loop: {n} SASS instructions per iteration and warp "
          f"({args.block_n} keys, {n / max(args.block_n, 1):.1f} per key)")
    print("  " + ", ".join(f"{op} {k}" for op, k in hist.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
