"""Benchmark lmfuse's rotary position embedding against transformers, torch.compile and Liger.

Run it as ``lmfuse bench rope [--graphs] [--json PATH] [--plot PATH] [--quick]``.
``--graphs`` times CUDA graph replays of every row: the device time alone (eager calls of
forward+backward through autograd measure the host on a slow host). The cases are
Llama-8B-like prefill and training shapes in bf16, in transformers' attention layout:
``q [B, Hq, S, D]`` and ``k [B, Hk, S, D]`` made as transformers makes them (the
projection's ``[B, S, H, D]`` transposed: a non-contiguous view), ``cos``, ``sin``
``[B, S, D]`` (random angles, the two halves repeated as in transformers' tables), for
``B 4, S 2048, Hq 32, Hk 8, D 128`` and ``B 1, S 8192, Hq 64, Hk 8, D 128``; each timed
forward only (no grad) and forward+backward (``torch.autograd.grad`` of both outputs, with
fixed random upstream gradients made as q and k are -- ``[B, S, H, D]`` transposed, as an
attention kernel working in that layout returns them -- w.r.t. q and k). ``--quick``
(the default on the CPU): float32 ``B 2, S 16, Hq 4, Hk 2, D 32`` and ``B 1, S 24, Hq 6,
Hk 2, D 64``.

Every row reports the median time, the achieved TB/s over the case's *minimal* bytes
(forward: read q, k, cos and sin, write q_embed and k_embed; forward+backward: that, and
read dq_embed, dk_embed, cos and sin again, write dq and dk -- twice the forward's bytes;
the whole ``[B, S, D]`` tables are counted, though with repeated halves half of each would
do, as Liger reads: per token, 2 of every 2 (Hq + Hk) + 2 head-sized rows moved, 2.4% and
1.4% of the bytes here), its time
as a multiple of lmfuse's, and the peak memory allocated beyond the inputs.

Rows: ``lmfuse`` (``lmfuse.apply_rotary_pos_emb``), ``torch`` (transformers'
``models.llama.modeling_llama.apply_rotary_pos_emb`` in eager PyTorch, or its formula
copied here when transformers cannot be imported: the note says which), ``torch.compile``
(that function, ``fullgraph=True``), ``liger-kernel`` (``LigerRopeFunction`` called as
``liger_rotary_pos_emb`` calls it; a row with a note when it is not installed or cannot
run) and ``copy`` (a device-to-device copy reading and writing as many bytes as the case's
minimum: the bandwidth ceiling). Liger rotates in place: it transposes q and k back to
``[B, S, H, D]`` (contiguous in this layout, so no copy) and overwrites them, and in the
backward the upstream gradients likewise; its row runs on its own copies of the inputs
and gradients, which the timed calls rotate again and again (the timing does not depend
on their values). Each peer's result is checked once against lmfuse's: the note gives
``||a - b|| / ||b||`` (the larger over q's and k's) and flags one over 1e-2 (1e-5 in
float32). lmfuse computes in float32 and rounds once; transformers' eager code and Liger
round the steps in bf16, so the bf16 rows differ by a few bf16 roundings.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

import lmfuse
from lmfuse.bench.common import (Case, compile_per_shape, copy_case, dist_version,
                                 dtype_label, graphs_option, print_peers, relative_differences,
                                 run_against_copy, start, timed_call, unavailable)

RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, k, cos, sin) -> (q', k')
# (B, S, Hq, Hk, D): Llama-3-8B-like prefill / training, and a long 70B-like sequence
SHAPES = [(4, 2048, 32, 8, 128), (1, 8192, 64, 8, 128)]
QUICK_SHAPES = [(2, 16, 4, 2, 32), (1, 24, 6, 2, 64)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def formula(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (Llama), copied: the torch row where
    transformers cannot be imported."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def load_transformers() -> tuple[RopeFn, str, str]:
    """transformers' Llama ``apply_rotary_pos_emb``, its row's note and its version; the
    copied :func:`formula` when transformers cannot be imported."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except Exception as exc:  # not installed, or its import needs what is missing here
        return (formula, f"transformers unavailable ({type(exc).__name__}): its formula, "
                "copied", "not installed")
    return (apply_rotary_pos_emb, "transformers' apply_rotary_pos_emb (Llama), eager",
            dist_version("transformers"))


def load_liger() -> tuple[RopeFn, str, str]:
    """Liger-Kernel's RoPE as ``(q, k, cos, sin) -> (q_embed, k_embed)`` (in place), its
    row's note, and its version; a stand-in that raises (so the row notes why) when it
    cannot be imported."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as exc:  # not installed, or its import needs what is missing here
        return unavailable(exc), f"unavailable ({type(exc).__name__})", "not installed"

    def liger(q, k, cos, sin):
        # as liger_rotary_pos_emb: (q, k, cos, sin, position_ids, unsqueeze_dim)
        return LigerRopeFunction.apply(q, k, cos, sin, None, 1)

    return liger, "LigerRopeFunction, in place (on its own inputs)", dist_version("liger-kernel")


def minimal_bytes(B: int, S: int, Hq: int, Hk: int, D: int, R: int, elt: int, table_elt: int,
                  backward: bool) -> int:
    """Forward: read q and k, write q_embed and k_embed (``elt`` bytes an element), read
    cos and sin ``[B, S, R]`` (``table_elt``). Backward besides: read dq_embed, dk_embed, cos
    and sin, write dq and dk -- as many again."""
    fwd = 2 * B * S * (Hq + Hk) * D * elt + 2 * B * S * R * table_elt
    return 2 * fwd if backward else fwd


def heads_view(B: int, S: int, H: int, D: int, dtype: torch.dtype, device: torch.device
               ) -> torch.Tensor:
    """``[B, H, S, D]`` as transformers makes it: the ``[B, S, H, D]`` projection
    transposed (a view, not contiguous)."""
    return torch.randn(B, S, H, D, dtype=dtype, device=device).transpose(1, 2)


def make_case(shape: tuple[int, int, int, int, int], dtype: torch.dtype,
              device: torch.device, torch_fn: RopeFn, torch_note: str, compiled: RopeFn,
              liger: RopeFn, liger_note: str, *, backward: bool) -> Case:
    B, S, Hq, Hk, D = shape
    q, k = heads_view(B, S, Hq, D, dtype, device), heads_view(B, S, Hk, D, dtype, device)
    angle = torch.rand(B, S, D // 2, device=device) * 6.3
    angle = torch.cat((angle, angle), -1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    gq, gk = heads_view(B, S, Hq, D, dtype, device), heads_view(B, S, Hk, D, dtype, device)
    # Liger overwrites its inputs and its upstream gradients: copies of its own (the same
    # strides)
    ql, kl, gql, gkl = (t.clone() for t in (q, k, gq, gk))
    if backward:
        for t in (q, k, ql, kl):
            t.requires_grad_(True)

    timed = partial(timed_call, args=(q, k, cos, sin), backward=backward, wrt=[q, k],
                    grad=(gq, gk))
    impls = {
        "lmfuse": timed(lmfuse.apply_rotary_pos_emb),
        "torch": timed(torch_fn),
        "torch.compile": timed(compiled),
        "liger-kernel": timed_call(liger, (ql, kl, cos, sin), backward, wrt=[ql, kl],
                                   grad=(gql, gkl)),
    }
    notes = {"torch": torch_note, "torch.compile": "fullgraph, of the torch row",
             "liger-kernel": liger_note}
    relative_differences(impls, dtype, notes=notes)
    nbytes = minimal_bytes(B, S, Hq, Hk, D, D, q.element_size(), cos.element_size(),
                           backward)
    mode = "fwd+bwd" if backward else "fwd"
    return copy_case(f"rope {mode} B{B} S{S} Hq{Hq}/Hk{Hk} D{D} {dtype_label(dtype)}",
                     nbytes, impls, notes, device)


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start("lmfuse bench rope", __doc__, argv,
                                     options=graphs_option)
    torch_fn, torch_note, transformers_version = load_transformers()
    liger, liger_note, liger_version = load_liger()
    print_peers(env, {"transformers": transformers_version, "liger-kernel": liger_version})
    compiled = compile_per_shape(torch_fn, 64)
    dtype = torch.float32 if quick else torch.bfloat16
    shapes = QUICK_SHAPES if quick else SHAPES
    cases = [make_case(shape, dtype, device, torch_fn, torch_note, compiled, liger,
                       liger_note, backward=bw)
             for shape in shapes for bw in (False, True)]
    elt = torch.finfo(dtype).bits // 8
    B, S, Hq, Hk, D = shapes[0]
    return run_against_copy(
        args, device, env, cases, minimal_bytes(B, S, Hq, Hk, D, D, elt, elt, False) // 2,
        "# TB/s over minimal bytes (fwd: read q, k, cos and sin, write q_embed and k_embed; "
        "fwd+bwd also: read dq_embed, dk_embed, cos and sin, write dq and dk); x lmfuse = "
        "ms / lmfuse ms (> 1: lmfuse is faster); peak MiB: allocated beyond the inputs",
        "rope")

if __name__ == "__main__":
    raise SystemExit(main())
