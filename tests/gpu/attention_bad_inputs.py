"""Bad values through the decode-attention kernels with the value checks off, for an
out-of-bounds audit under compute-sanitizer (every load and store of ``decode_kernel``,
``merge_kernel``, ``append_kernel`` and ``qk_norm_rope_append_kernel`` must stay inside its
tensors whatever the lengths, block ids and scales say)::

    compute-sanitizer --tool memcheck --error-exitcode 1 --leak-check no \\
        python tests/gpu/attention_bad_inputs.py
    compute-sanitizer --tool initcheck --error-exitcode 1 \\
        python tests/gpu/attention_bad_inputs.py --quick

Each case runs once (compilation included) and is synchronised, so a fault is reported
against its case; the script prints one line per case and exits non-zero on any Python
error. The caches are exact-size allocations (no guard rows: memcheck sees a read past the
end of the allocation). ``--quick`` runs one shape per kernel. A dry run on the CPU (the
Triton interpreter; no sanitizer)::

    TRITON_INTERPRET=1 python tests/gpu/attention_bad_inputs.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch

import lmfuse
from lmfuse.attention.block import DecodeAttentionBlock

DEV = "cuda"
FP8 = torch.float8_e4m3fn
I32 = torch.int32


def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV).to(dtype)


def decode_cases(quick: bool):
    S = 300
    lens_sets = {"past capacity": [S + 1, 2**31 - 1, 5], "negative": [-1, -(2**31), 7],
                 "int64 huge": [2**40, 3, 0]}
    for (name, lens), paged, fp8, s_active, window, splits in itertools.product(
            lens_sets.items(), (False, True), (False, True), (1, 4), (None, 40), (None, 1, 7)):
        if quick and (fp8 or s_active > 1 or window or splits == 1):
            continue
        yield (f"decode {name} paged={paged} fp8={fp8} s={s_active} w={window} "
               f"splits={splits}", lens, paged, fp8, s_active, window, splits, None)
    blocks = {"-1 in use": -1, "past pool": 10**6, "-7": -7, "int32 max": 2**31 - 1}
    for (name, bad), fp8, splits in itertools.product(blocks.items(), (False, True),
                                                      (None, 5)):
        if quick and (fp8 or splits):
            continue
        yield (f"decode block {name} fp8={fp8} splits={splits}", [S, 200, 17], True, fp8, 1,
               None, splits, bad)


def run_decode(lens, paged, fp8, s_active, window, splits, bad_block):
    B, S, Hkv, G, D, bl = 3, 300, 2, 4, 128, 16
    cdt = FP8 if fp8 else torch.bfloat16
    q = rnd(B, s_active, Hkv * G, D)
    kw = {}
    if paged:
        per = -(-S // bl)
        k, v = rnd(B * per, bl, Hkv, D, dtype=cdt), rnd(B * per, bl, Hkv, D, dtype=cdt)
        table = torch.arange(B * per, dtype=I32, device=DEV).view(B, per)
        if bad_block is not None:
            table[0, 3] = bad_block
            table[1, per - 1] = bad_block
        kw["block_table"] = table
    else:
        k, v = rnd(B, S, Hkv, D, dtype=cdt), rnd(B, S, Hkv, D, dtype=cdt)
    if fp8:
        kw["k_scale"] = torch.tensor([0.0, -1.0], device=DEV)
        kw["v_scale"] = torch.tensor([math.nan, math.inf], device=DEV)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=DEV)
    lmfuse.decode_attention(q, k, v, lens_t, window_size=window, num_splits=splits,
                            sinks=rnd(Hkv * G, dtype=torch.float32), return_lse=True, **kw)


def run_merge():
    for P, R, D in ((1, 5, 64), (7, 33, 128), (130, 3, 80)):
        outs, lses = rnd(P, R, D, dtype=torch.float32), rnd(P, R, dtype=torch.float32)
        lses[0, 0], lses[-1, 1], lses[:, 2] = math.nan, math.inf, -math.inf
        lmfuse.merge_attention_states(outs, lses, out_dtype=torch.bfloat16)
        lmfuse.merge_attention_states(outs.transpose(0, 1).contiguous().transpose(0, 1), lses)


def run_append(fp8: bool):
    B, S, H, D, bl = 4, 32, 2, 128, 8
    cdt = FP8 if fp8 else torch.bfloat16
    new = rnd(B, 3, H, D)
    scales = dict(k_scale=torch.tensor([0.0, -2.0], device=DEV),
                  v_scale=torch.tensor([math.nan, math.inf], device=DEV)) if fp8 else {}
    lens = torch.tensor([S - 1, -2, 2**31 - 1, -(2**40)], dtype=torch.int64, device=DEV)
    k, v = rnd(B, S, H, D, dtype=cdt), rnd(B, S, H, D, dtype=cdt)
    lmfuse.kv_cache_append(k, v, new, new, lens, **scales)
    per = S // bl
    k, v = rnd(B * per, bl, H, D, dtype=cdt), rnd(B * per, bl, H, D, dtype=cdt)
    table = torch.arange(B * per, dtype=I32, device=DEV).view(B, per)
    table[0, -1] = -1
    table[1, 0] = 10**6
    table[2, :] = -5
    lmfuse.kv_cache_append(k, v, new, new, torch.tensor([S - 2, 0, 4, 30], device=DEV),
                           block_table=table, **scales)


def run_block(paged: bool, fp8: bool):
    B, Hq, Hkv, D, S, bl = 3, 8, 2, 64, 16, 4
    blk = DecodeAttentionBlock(Hq * D, Hq, Hkv, D, device=DEV, dtype=torch.bfloat16)
    cdt = FP8 if fp8 else torch.bfloat16
    kw = {}
    if paged:
        k = rnd(B * S // bl, bl, Hkv, D, dtype=cdt)
        table = torch.arange(B * S // bl, dtype=I32, device=DEV).view(B, S // bl)
        table[0, 1], table[1, 3] = -1, 10**6
        kw["block_table"] = table
    else:
        k = rnd(B, S, Hkv, D, dtype=cdt)
    if fp8:
        kw.update(k_scale=torch.tensor([0.0, 1.0], device=DEV),
                  v_scale=torch.tensor([1.0, -1.0], device=DEV))
    lens = torch.tensor([S, -3, 2**31 - 1], dtype=I32, device=DEV)
    with torch.no_grad():
        blk(rnd(B, 2, Hq * D), k, k.clone(), lens, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run under TRITON_INTERPRET=1")
    args = parser.parse_args()
    global DEV
    DEV = args.device
    if (DEV == "cuda") == (os.environ.get("TRITON_INTERPRET") == "1"):
        parser.error("--device cuda needs TRITON_INTERPRET unset; --device cpu needs it =1")
    # Off is the default on CUDA tensors; on CPU tensors the checks always run, so the dry
    # run switches them off the way the CPU tests do.
    lmfuse.set_checks(False)
    if DEV == "cpu":
        from lmfuse.attention import ops
        ops.value_checks = lambda t: False
    torch.manual_seed(0)
    cases = [(name, lambda a=a: run_decode(*a)) for name, *a in decode_cases(args.quick)]
    cases += [("merge nan/inf lses", run_merge)]
    cases += [(f"append fp8={f}", lambda f=f: run_append(f)) for f in (False, True)]
    cases += [(f"block paged={p} fp8={f}", lambda p=p, f=f: run_block(p, f))
              for p, f in itertools.product((False, True), (False, True))
              if not args.quick or not f]
    failed = 0
    for name, fn in cases:
        try:
            fn()
            if DEV == "cuda":
                torch.cuda.synchronize()
            print(f"ok    {name}", flush=True)
        except Exception as e:  # a Python error (a device fault aborts under memcheck)
            failed += 1
            print(f"ERROR {name}: {type(e).__name__}: {e}", flush=True)
    print(f"{len(cases) - failed} of {len(cases)} cases ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
