"""Benchmark ``lmfuse.moe_experts`` against the per-expert torch loop, transformers' experts
implementations, Liger-Kernel and a floor.

Run it as ``lmfuse bench moe_experts [--json PATH] [--plot PATH] [--quick] [--no-liger]
[--models mixtral,qwen3-moe,gpt-oss]`` (``--models``: those models' cases only; Liger's first
call at a training shape autotunes for minutes, so one model a run keeps a run short).
The cases are bf16, weights scaled by ``fan_in ** -0.5``:

  mixtral fwd+bwd     T 8192, H 4096, F 14336, E 8, k 2, SwiGLU, gate/up halves, no biases
  qwen3-moe fwd+bwd   T 8192, H 2048, F 768, E 128, k 8, SwiGLU, gate/up halves, no biases
  gpt-oss decode      T 1, 16 and 64; H 2880, F 2880, E 32, k 4, Quick-GEGLU with
                      linear_offset 1 and clamp_value 7, gate/up interleaved, with
                      gate_up_bias [E, 2F] and down_bias [E, H]

Routing, from a generator seeded by the case: router logits ``[T, E]`` random, their top k,
a softmax over the k chosen (Mixtral's order) -> ``expert_ids`` (int64) and
``router_weights`` (hidden's dtype). The training cases time forward+backward:
``torch.autograd.grad`` of the output, with a fixed random upstream gradient, w.r.t. hidden,
both weights and the router weights. The decode cases time the forward alone (no grad) and,
on a GPU, each call as the replay of a CUDA graph holding it (what a server that captures
its decode step pays), except the torch loop: it reads on the host which experts have
tokens, which no graph can hold, so it is timed eagerly (its note says so).

Rows:

  lmfuse                    ``lmfuse.moe_experts``, impl auto (the note gives the path)
  torch loop                the loop a Hugging Face model runs eagerly, in hidden's dtype:
                            for each expert with tokens, gather them, ``F.linear`` gate/up,
                            the activation, ``F.linear`` down, times the router weight,
                            ``index_add_`` into the output
  hf grouped_mm             the model's experts module in transformers (``MixtralExperts``,
                            ``Qwen3MoeExperts``, ``GptOssExperts``; built on the meta device)
                            with ``config._experts_implementation = "grouped_mm"``, called
                            through ``torch.func.functional_call`` on the case's own weights
                            (GPT-OSS's ``[E, H, 2F]`` layout: transposed views, no copy)
  hf batched_mm             the same with ``"batched_mm"``, which gathers each (token, slot)
                            pair's expert weights: not run (a row with a note) where that copy
                            would pass 16 GiB, as at both training shapes
  liger-kernel              ``LigerFusedMoEFunction`` (SwiGLU, gate/up halves, no biases: the
                            training cases; the decode rows say so; a row with a note where
                            it is not installed)
  floor                     training: the dense cuBLAS GEMMs doing the same flops, timed in
                            the same run: ``x [T k, H] @ [H, 2F]`` and ``[T k, F] @ [F, H]``
                            (forward), and their dgrad and wgrad GEMMs (3x the flops);
                            decode: a device-to-device copy of the case's minimal bytes (half
                            read, half written)

The ``TB/s`` column (``tbps`` in the JSON) holds **TFLOP/s** in the training cases, over the
expert GEMMs' ``2 T k H (2F + F)`` flops (3x for forward+backward): they are compute-bound.
In the decode cases it is TB/s over the minimal bytes: the weights and biases of the experts
the routing selects (unique expert ids x ``(2F H + H F + 2F + H)`` x element size) plus the
hidden read and the output written. Every row also gives its time as a multiple of lmfuse's
(> 1: lmfuse is faster) and the peak memory allocated beyond the inputs. A peer that is not
installed or cannot run a case is a row with a note, not a crash. Each peer's result (the
output; forward+backward: the four gradients) is checked once against lmfuse's: the note gives
``||a - b|| / ||b||`` (the largest over the gradients) and flags one over 1e-2 (1e-5 in
float32). A summary then gives lmfuse's share of the floor's rate (floor ms / lmfuse ms:
1.0 is the dense GEMMs' throughput, or the copy's bandwidth) and its speed-up over the torch
loop. ``--quick`` (the default on CPU) runs the same cases at tiny shapes in float32 (T 8,
H 32, F 16, E 4 and 8; decode T 1 and 4), without graphs on CPU, through Triton's
interpreter when ``TRITON_INTERPRET=1`` (else lmfuse's torch path): a smoke test, whose
figures are not GPU performance.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

import lmfuse
from lmfuse._launch import dtype_name
from lmfuse.bench.common import (Case, PeerUnavailable, Result, add_copy_rows, cell, dist_version,
                                 finish, measure_copy, print_peers, relative_differences,
                                 run_cases, start, timed_call, unavailable)
from lmfuse.bench.decode_attention import as_graph

# (hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias, down_bias) -> out
ExpertsFn = Callable[..., torch.Tensor]

FLOOR = "floor"
LOOP = "torch loop"
LIGER = "liger-kernel"
HF_IMPLS = ("grouped_mm", "batched_mm")
BATCHED_MM_MAX_BYTES = 16 * 2**30  # batched_mm's gathered weights, past which it is not run
# Rows timed eagerly in the graph-replayed decode cases, and why.
EAGER_ONLY = {LOOP: "eager: reads on the host which experts have tokens (no CUDA graph "
                    "can hold it)"}


class Shape(NamedTuple):
    """One model's experts: sizes, activation and layout; ``model`` also names the
    transformers experts module of the peer rows."""

    model: str
    T: int
    H: int
    F: int
    E: int
    k: int
    activation: str = "swiglu"
    linear_offset: float = 0.0
    clamp_value: Optional[float] = None
    layout: str = "halves"
    bias: bool = False

    @property
    def K2(self) -> int:
        """The gate/up projection's width: 2F (gated), F (squared ReLU)."""
        return self.F if self.activation == "squared_relu" else 2 * self.F

    def settings(self) -> dict:
        """The keyword arguments of ``lmfuse.moe_experts`` (and of the torch loop)."""
        return dict(activation=self.activation, linear_offset=self.linear_offset,
                    clamp_value=self.clamp_value, gate_up_layout=self.layout)


GPT_OSS = dict(activation="quick_geglu", linear_offset=1.0, clamp_value=7.0,
               layout="interleaved", bias=True)
TRAIN = [Shape("mixtral", 8192, 4096, 14336, 8, 2), Shape("qwen3-moe", 8192, 2048, 768, 128, 8)]
DECODE, DECODE_TOKENS = Shape("gpt-oss", 0, 2880, 2880, 32, 4, **GPT_OSS), (1, 16, 64)
TRAIN_QUICK = [Shape("mixtral", 8, 32, 16, 4, 2), Shape("qwen3-moe", 8, 32, 16, 8, 4)]
DECODE_QUICK, DECODE_TOKENS_QUICK = Shape("gpt-oss", 0, 32, 16, 8, 4, **GPT_OSS), (1, 4)


# --- the torch loop ------------------------------------------------------------------------


def loop_activation(h: torch.Tensor, *, activation: str, linear_offset: float,
                    clamp_value: Optional[float], gate_up_layout: str) -> torch.Tensor:
    """The activation as a model's eager code writes it, in ``h``'s dtype."""
    if activation == "squared_relu":
        return F.relu(h).square()
    if gate_up_layout == "interleaved":
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if clamp_value is not None:
        gate, up = gate.clamp(max=clamp_value), up.clamp(-clamp_value, clamp_value)
    if activation == "swiglu":
        act = F.silu(gate)
    elif activation == "geglu":
        act = F.gelu(gate, approximate="tanh")
    else:  # quick_geglu
        act = gate * torch.sigmoid(1.702 * gate)
    return act * (up + linear_offset)


def torch_loop(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias=None,
               down_bias=None, **settings) -> torch.Tensor:
    """The per-expert loop of a Hugging Face model in eager mode: each expert with tokens
    gathers them, runs its MLP and adds its router-weighted output back in place."""
    out = torch.zeros_like(hidden)
    with torch.no_grad():  # the experts that have tokens, read on the host
        counts = torch.bincount(expert_ids.reshape(-1), minlength=w_gate_up.shape[0])
        hit = counts.nonzero().flatten().tolist()
    for e in hit:
        token, slot = torch.where(expert_ids == e)
        h = F.linear(hidden[token], w_gate_up[e],
                     gate_up_bias[e] if gate_up_bias is not None else None)
        y = F.linear(loop_activation(h, **settings), w_down[e],
                     down_bias[e] if down_bias is not None else None)
        out.index_add_(0, token, y * router_weights[token, slot, None])
    return out


# --- peers ---------------------------------------------------------------------------------


# model -> (transformers module, experts class, config class, config keywords of a shape)
HF_EXPERTS: dict[str, tuple[str, str, str, Callable[[Shape], dict]]] = {
    "mixtral": ("mixtral.modeling_mixtral", "MixtralExperts", "MixtralConfig",
                lambda s: dict(hidden_size=s.H, intermediate_size=s.F, num_local_experts=s.E,
                               num_experts_per_tok=s.k)),
    "qwen3-moe": ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig",
                  lambda s: dict(hidden_size=s.H, moe_intermediate_size=s.F, num_experts=s.E,
                                 num_experts_per_tok=s.k)),
    "gpt-oss": ("gpt_oss.modeling_gpt_oss", "GptOssExperts", "GptOssConfig",
                lambda s: dict(hidden_size=s.H, intermediate_size=s.F, num_local_experts=s.E,
                               num_experts_per_tok=s.k, swiglu_limit=s.clamp_value)),
}


def hf_experts(s: Shape, impl: str) -> tuple[ExpertsFn, str]:
    """transformers' experts module of ``s.model`` running ``impl`` as an ``ExpertsFn`` on
    the weights it is given (``functional_call``: no copy), and its row's note; a stand-in
    that raises (so the row notes why) when this transformers cannot."""
    module, cls_name, cfg_name, keywords = HF_EXPERTS[s.model]
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if impl not in ALL_EXPERTS_FUNCTIONS:
            raise KeyError(f"transformers has no experts implementation {impl!r}")
        mod = importlib.import_module(f"transformers.models.{module}")
        config = getattr(mod, cfg_name)(**keywords(s))
        config._experts_implementation = impl
        with torch.device("meta"):  # its parameters are the case's, passed at each call
            experts = getattr(mod, cls_name)(config)
    except Exception as exc:  # not installed, too old (no experts interface), or broken here
        return unavailable(exc), f"unavailable ({type(exc).__name__})"
    from torch.func import functional_call

    transposed = getattr(experts, "is_transposed", False)

    def call(hidden, expert_ids, router_weights, w_gate_up, w_down, gate_up_bias=None,
             down_bias=None):
        params = {"gate_up_proj": w_gate_up.transpose(1, 2) if transposed else w_gate_up,
                  "down_proj": w_down.transpose(1, 2) if transposed else w_down}
        if gate_up_bias is not None:
            params["gate_up_proj_bias"] = gate_up_bias
        if down_bias is not None:
            params["down_proj_bias"] = down_bias
        return functional_call(experts, params, (hidden, expert_ids, router_weights))

    how = "as transposed views" if transposed else "as stored"
    return call, f"transformers {cls_name}, the case's weights {how}"


def load_liger() -> tuple[Callable[..., torch.Tensor], str]:
    """Liger-Kernel's fused experts ``(x, w_gate_up, w_down, ids int32, weights) -> out``
    and its version; a stand-in that raises when it cannot be imported."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as exc:  # not installed, too old, or its import needs what is missing
        version = dist_version("liger-kernel")
        return unavailable(exc), "not installed" if version.startswith("(") else version
    return LigerFusedMoEFunction.apply, dist_version("liger-kernel")


# --- inputs and floors ---------------------------------------------------------------------


class Weights:
    """A shape's expert weights (and biases), from a generator seeded by ``seed``."""

    def __init__(self, s: Shape, dtype: torch.dtype, device: torch.device, seed: int,
                 requires_grad: bool):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

        def randn(*shape: int, scale: float) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=dtype, device=device).mul_(scale)
            return t.requires_grad_(requires_grad)

        self.w_gate_up = randn(s.E, s.K2, s.H, scale=s.H ** -0.5)
        self.w_down = randn(s.E, s.H, s.F, scale=s.F ** -0.5)
        self.gate_up_bias = randn(s.E, s.K2, scale=0.1) if s.bias else None
        self.down_bias = randn(s.E, s.H, scale=0.1) if s.bias else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w_gate_up, self.w_down, self.gate_up_bias, self.down_bias)
                if t is not None]


def route(T: int, E: int, k: int, dtype: torch.dtype, device: torch.device,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert_ids [T, k] int64, router_weights [T, k] in dtype)``: the top k of random
    router logits, softmax over the k chosen (Mixtral's order)."""
    logits = torch.randn(T, E, generator=gen, device=device)
    top = logits.topk(k, dim=-1)
    return top.indices, top.values.softmax(dim=-1).to(dtype)


def gemm_floor(s: Shape, w: Weights, gen: torch.Generator) -> Callable[[], object]:
    """The dense cuBLAS GEMMs doing a training case's flops: forward ``h = x @ W1`` (``[T k,
    H] @ [H, 2F]``) and ``y = a @ W2`` (``[T k, F] @ [F, H]``); backward ``da = dy @ W2.T``,
    ``dW2 = dy.T @ a``, ``dx = dh @ W1.T``, ``dW1 = dh.T @ x``. W1 and W2 are expert 0's
    weights (views); x, a, dy and dh random, made here, outside the timing."""
    rows, dtype, device = s.T * s.k, w.w_down.dtype, w.w_down.device

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype, device=device)

    x, a, dy, dh = randn(rows, s.H), randn(rows, s.F), randn(rows, s.H), randn(rows, s.K2)
    w1, w2 = w.w_gate_up[0].detach(), w.w_down[0].detach()  # [2F, H], [H, F]

    def fwd_bwd():
        return (torch.matmul(x, w1.T), torch.matmul(a, w2.T),  # forward
                torch.matmul(dy, w2), torch.matmul(dy.T, a),  # down: dgrad, wgrad
                torch.matmul(dh, w1), torch.matmul(dh.T, x))  # gate/up: dgrad, wgrad

    return fwd_bwd


def gemm_flops(s: Shape, backward: bool) -> int:
    """The expert GEMMs' flops: ``2 T k H (K2 + F)`` forward, 3x forward+backward."""
    return 2 * s.T * s.k * s.H * (s.K2 + s.F) * (3 if backward else 1)


def decode_bytes(s: Shape, expert_ids: torch.Tensor, elt: int) -> int:
    """The decode minimum: every selected expert's weights and biases read once, hidden read,
    the output written."""
    used = int(torch.unique(expert_ids).numel())
    per_expert = s.K2 * s.H + s.H * s.F + ((s.K2 + s.H) if s.bias else 0)
    return (used * per_expert + 2 * s.T * s.H) * elt


# --- cases ---------------------------------------------------------------------------------


def make_case(s: Shape, w: Weights, dtype: torch.dtype, device: torch.device,
              liger: Callable[..., torch.Tensor], *, backward: bool, seed: int) -> Case:
    """One case: fresh hidden and routing from ``seed``, the shape's weights ``w``; the
    rows' results compared with lmfuse's once, here."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    hidden = torch.randn(s.T, s.H, generator=gen, dtype=dtype, device=device)
    expert_ids, router_weights = route(s.T, s.E, s.k, dtype, device, gen)
    args = (hidden, expert_ids, router_weights, w.w_gate_up, w.w_down, w.gate_up_bias,
            w.down_bias)
    grad, wrt = None, ()
    if backward:
        hidden.requires_grad_(True)
        router_weights.requires_grad_(True)
        grad = torch.randn(s.T, s.H, generator=gen, dtype=dtype, device=device)
        wrt = [hidden, *w.tensors()[:2], router_weights, *w.tensors()[2:]]
    timed = partial(timed_call, args=args, backward=backward, wrt=wrt, grad=grad)

    settings = s.settings()
    plan = lmfuse.explain(lmfuse.moe_experts, *args[:5], gate_up_bias=w.gate_up_bias,
                          down_bias=w.down_bias, **settings)
    impls = {
        "lmfuse": timed(lambda h, i, r, a, b, ba, bb: lmfuse.moe_experts(
            h, i, r, a, b, gate_up_bias=ba, down_bias=bb, **settings)),
        LOOP: timed(partial(torch_loop, **settings)),
    }
    notes = {"lmfuse": f"impl auto: {plan.impl}",
             LOOP: f"per-expert F.linear pair, index_add_, {dtype_name(dtype)}"}
    elt = hidden.element_size()
    gathered = s.T * s.k * (s.K2 * s.H + s.H * s.F) * elt
    for impl in HF_IMPLS:
        row = f"hf {impl}"
        if impl == "batched_mm" and gathered > BATCHED_MM_MAX_BYTES:
            impls[row] = unavailable(f"not run: batched_mm gathers each pair's expert "
                                     f"weights, {gathered / 2**30:,.0f} GiB here")
            continue
        fn, notes[row] = hf_experts(s, impl)
        impls[row] = timed(fn)
    if s.activation == "swiglu" and s.layout == "halves" and not s.bias:
        ids32 = expert_ids.to(torch.int32)
        impls[LIGER] = timed(lambda h, i, r, a, b, ba, bb: liger(h, a, b, ids32, r))
        notes[LIGER] = "LigerFusedMoEFunction"
    else:
        impls[LIGER] = unavailable("LigerFusedMoEFunction computes SwiGLU (gate/up "
                                   "halves) without biases only")
    relative_differences(impls, dtype, notes=notes)
    mode = "fwd+bwd" if backward else "decode"
    name = (f"{s.model} {mode} T{s.T} H{s.H} F{s.F} E{s.E} k{s.k} {dtype_name(dtype)}")
    if backward:  # training: compute-bound, the dense GEMMs are the floor
        impls[FLOOR] = gemm_floor(s, w, gen)
        notes[FLOOR] = "dense cuBLAS GEMMs of the same flops (6 matmuls, expert 0's weights)"
        return Case(name, gemm_flops(s, backward), impls, notes)
    return Case(name, decode_bytes(s, expert_ids, elt), impls, notes)  # floor: a copy


def build_cases(device: torch.device, quick: bool, liger: Callable[..., torch.Tensor],
                models: Optional[set[str]] = None) -> tuple[list[Case], list[Case]]:
    """(training cases, decode cases) of ``models`` (all if None); their inputs stay alive
    for the run."""
    dtype = torch.float32 if quick else torch.bfloat16
    train, decode_shape, tokens = ((TRAIN_QUICK, DECODE_QUICK, DECODE_TOKENS_QUICK) if quick
                                   else (TRAIN, DECODE, DECODE_TOKENS))
    training = []
    for i, s in enumerate(train):
        if models is not None and s.model not in models:
            continue
        w = Weights(s, dtype, device, seed=1000 + i, requires_grad=True)
        training.append(make_case(s, w, dtype, device, liger, backward=True, seed=2000 + i))
    if models is not None and decode_shape.model not in models:
        return training, []
    w = Weights(decode_shape, dtype, device, seed=3000, requires_grad=False)
    decode = [make_case(decode_shape._replace(T=t), w, dtype, device, liger, backward=False,
                        seed=4000 + t) for t in tokens]
    add_copy_rows(decode, device, FLOOR,
                  "device-to-device copy of the minimal bytes (half read, half written)")
    return training, decode


def capture_graphs(cases: list[Case]) -> None:
    """Each row's call replaced by the replay of a CUDA graph holding it, except those in
    ``EAGER_ONLY`` (noted) and a peer that cannot run (its row says why when timed)."""
    for case in cases:
        for impl, fn in list(case.impls.items()):
            if impl in EAGER_ONLY:
                case.notes[impl] = f"{case.notes.get(impl, '')}; {EAGER_ONLY[impl]}".lstrip("; ")
                continue
            try:
                case.impls[impl] = as_graph(fn)
            except PeerUnavailable:
                pass
            except Exception as exc:  # e.g. a host synchronisation inside the call
                torch.cuda.synchronize()
                case.impls[impl] = unavailable(f"CUDA graph capture failed: "
                                               f"{type(exc).__name__}: {exc}")


def report(results: list[Result]) -> None:
    """lmfuse per case: its share of the floor's rate and its speed-up over the torch loop."""
    print("\n# lmfuse against the floor (x floor rate = floor ms / lmfuse ms: 1.0 is the dense "
          "GEMMs' throughput, or the copy's bandwidth) and the torch loop (loop ms / lmfuse ms)")
    print(f"{'case':<44} {'ms':>9} {'floor ms':>9} {'x floor rate':>12} {'loop x':>7}")
    for ours in (r for r in results if r.impl == "lmfuse"):
        rows = {r.impl: r for r in results if r.case == ours.case}
        if ours.ms is None:
            print(f"{ours.case:<44} lmfuse did not run")
            continue
        floor, loop = rows.get(FLOOR), rows.get(LOOP)
        floor_ms = floor.ms if floor is not None else None
        share = floor_ms / ours.ms if floor_ms else None
        speedup = loop.ratio if loop is not None and loop.ratio else None
        print(f"{ours.case:<44} {ours.ms:9.4f} {cell(floor_ms or None, '9.4f')} "
              f"{cell(share, '12.2f')} {cell(speedup, '7.2f')}")


def _options(p) -> None:
    p.add_argument("--no-liger", action="store_true",
                   help="leave Liger-Kernel's row out (its fused MoE autotunes for minutes on "
                        "its first call at the training shapes)")
    p.add_argument("--models", default="",
                   help="comma-separated: mixtral, qwen3-moe, gpt-oss (default: all)")


def main(argv: list[str] | None = None) -> int:
    args, device, quick, env = start(
        "lmfuse bench moe_experts", __doc__, argv,
        plot_what="TFLOP/s (training) or TB/s (decode)",
        options=_options)
    models = None
    if args.models:
        models = {m.strip() for m in args.models.split(",") if m.strip()}
        known = {s.model for s in TRAIN} | {DECODE.model}
        if not models or not models <= known:
            print(f"lmfuse bench moe_experts: --models takes a comma-separated subset of "
                  f"{', '.join(sorted(known))}; got {args.models!r}", file=sys.stderr)
            return 2
    liger, liger_version = load_liger()
    if args.no_liger:
        liger = unavailable("left out (--no-liger)")
    print_peers(env, {"transformers": dist_version("transformers"), "liger-kernel": liger_version})
    graphs = device.type == "cuda"
    env["timing"] = ("decode cases: CUDA-graph replay of each call (the torch loop eager)"
                     if graphs else "eager calls")
    env["tbps"] = ("fwd+bwd (training) cases: TFLOP/s over the expert GEMMs' flops; "
                   "decode cases: TB/s over the selected experts' bytes and hidden in/out")
    training, decode = build_cases(device, quick, liger, models)
    # read and written: as many bytes as the largest decode case's minimum (or 16 MiB)
    copy = measure_copy(max([case.nbytes for case in decode] or [2 * 2**24]) // 2, device)
    if graphs:
        print("# decode cases: every call timed as the replay of a CUDA graph holding it "
              "(except the torch loop)")
        capture_graphs(decode)
    print("# the TB/s column: TFLOP/s in the fwd+bwd cases (2 T k H (2F + F) flops, x3), TB/s "
          "in the decode cases (selected experts' weights and biases, hidden in and out); "
          "x lmfuse = ms / lmfuse ms (> 1: lmfuse is faster); peak MiB: allocated beyond "
          "the inputs")
    results = run_cases(training + decode, device)
    report(results)
    return finish(args, env, copy, results,
                  f"moe_experts on {env['device']}: TFLOP/s (fwd+bwd), TB/s (decode)")


if __name__ == "__main__":
    raise SystemExit(main())
