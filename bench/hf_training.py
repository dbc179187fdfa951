"""A Hugging Face causal LM's training step with and without ``apply_lmfuse``.

    python bench/hf_training.py [--json PATH] [--quick] [--generate N] [--impls A,B]
        [--model llama|qwen3|gemma|mixtral|qwen3_moe|gemma3|gemma4]

Builds a random-weight model from a config (no download; Llama-3-like by default: hidden
2048, 8 layers, FFN 8192, vocabulary 128256, bf16, SDPA attention; the MoE families and
Gemma 3/4 built around the same sizes, see ``FAMILIES``), and times one training
step (forward with labels, backward) on ``[batch, seq]`` tokens for:

* ``transformers``: the model as Hugging Face builds it (its loss materialises the
  ``[batch * seq, V]`` logits in float32);
* ``lmfuse``: the same weights after ``lmfuse.integrations.transformers.apply_lmfuse``
  (RMSNorm, SwiGLU / GEGLU and the loss through ``linear_cross_entropy``);
* ``liger-kernel``: Liger-Kernel's own patch of the same model, where it is installed.

Each row gives the median step time, tokens/s, the peak memory allocated during the step
beyond the model, its parameters' gradients and the optimizer-free state (the activations
and the loss' temporaries), and the loss and gradient agreement with the unpatched model
(relative difference of the loss, and the largest over the parameters' gradients of
``||a - b|| / ||b||``).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from lmfuse.bench.common import Result, bench_ms, dist_version, environment, print_table


def _gemma_text(dims: dict) -> dict:
    """Gemma 3/4's text stack at the benchmark's sizes: head dim 256, Gemma's vocabulary of
    262144, a sliding window of 512 on five layers of six (the sixth and the last full)."""
    layers = dims["num_hidden_layers"]
    return dict(head_dim=256, vocab_size=262144 if dims["vocab_size"] > 32000 else 32000,
                sliding_window=512,
                layer_types=["full_attention" if (i + 1) % 6 == 0 or i == layers - 1
                             else "sliding_attention"
                             for i in range(layers)])


# --model NAME -> (config model type, its overrides from the dense sizes). The MoE models
# keep the dense model's attention and replace its MLP with experts of about its compute
# per token: Mixtral's 8 experts of FFN // 2, two a token; Qwen3-MoE's 64 of 768, eight a
# token. Gemma 4 without per-layer input embeddings (its larger checkpoints' form).
FAMILIES = {
    "mixtral": ("mixtral", lambda d: dict(intermediate_size=d["intermediate_size"] // 2,
                                          num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", lambda d: dict(
        head_dim=d["hidden_size"] // 16, num_experts=64 if d["vocab_size"] > 32000 else 8,
        num_experts_per_tok=8 if d["vocab_size"] > 32000 else 2,
        moe_intermediate_size=768 if d["vocab_size"] > 32000 else 256)),
    "gemma3": ("gemma3_text", _gemma_text),
    "gemma4": ("gemma4_text", lambda d: dict(_gemma_text(d), hidden_size_per_layer_input=0)),
}


def build(kind: str, quick: bool, device: torch.device):
    import transformers

    small = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)
    big = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=4, vocab_size=128256)
    dims = small if quick else big
    common = dict(max_position_embeddings=8192, attn_implementation="sdpa",
                  tie_word_embeddings=False, **dims)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(head_dim=dims["hidden_size"] // 16, **common)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "gemma":
        config = transformers.GemmaConfig(head_dim=dims["hidden_size"] // 16, **common)
        cls = transformers.GemmaForCausalLM
    elif kind in FAMILIES:
        model_type, extra = FAMILIES[kind]
        kw = dict(common, **extra(dims))
        config = transformers.AutoConfig.for_model(model_type, **kw)
        cls = transformers.AutoModelForCausalLM
        torch.manual_seed(0)
        return cls.from_config(config).to(device=device, dtype=torch.bfloat16)
    else:
        raise ValueError(f"--model must be one of llama, qwen3, gemma, {', '.join(FAMILIES)}; "
                         f"got {kind!r}")
    torch.manual_seed(0)
    model = cls(config).to(device=device, dtype=torch.bfloat16)
    return model


def liger_patch(kind: str, model):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return model


def step_fn(model, ids, labels):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.detach()
    return step


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def compare(loss, g, ref_loss, ref_g) -> str:
    dl = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    worst, where = 0.0, ""
    for n, r in ref_g.items():
        a = g.get(n)
        if a is None:
            return f"loss rel {dl:.1e}; gradient of {n} missing"
        rel = ((a - r).norm() / r.norm().clamp_min(1e-30)).item()
        if rel > worst:
            worst, where = rel, n
    return f"loss rel {dl:.1e}; worst grad rel {worst:.1e} ({where})"


def time_generation(base, prompt, n: int, name: str) -> list[Result]:
    """Greedy ``generate`` of ``n`` tokens (eager, wall clock, median of 3) for the model as
    built, ``apply_lmfuse`` with its default small-call fallback, and with every call fused
    (``inference_fallback_tokens=0``); the generated tokens compared with the first's."""
    import time

    from lmfuse.integrations.transformers import apply_lmfuse

    base.eval()
    variants = {"transformers": base,
                "lmfuse": apply_lmfuse(copy.deepcopy(base)),
                "lmfuse (every call fused)": apply_lmfuse(copy.deepcopy(base),
                                                          inference_fallback_tokens=0)}
    rows, want = [], None
    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    for impl, model in variants.items():
        out = model.generate(prompt, **gen)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(prompt, **gen)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        same = "" if want is None else ("same tokens" if torch.equal(out, want)
                                        else "tokens differ (bf16 near-ties)")
        want = out if want is None else want
        ms = sorted(times)[1]
        rows.append(Result(f"{name} generate {n}", impl, ms, None, None, None,
                           f"{n / ms * 1e3:,.0f} tokens/s; {same}"))
    lm = rows[1].ms
    for r in rows:
        r.ratio = r.ms / lm
    print_table(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="also time greedy generation of N tokens (eager, batch 1)")
    ap.add_argument("--impls", default="transformers,lmfuse,liger-kernel",
                    help="rows to run, comma-separated (transformers is the reference and "
                         "always runs; Liger-Kernel's fused MoE autotunes for minutes on "
                         "its first call at these sizes)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    impls = {i.strip() for i in args.impls.split(",") if i.strip()} | {"transformers"}
    unknown = impls - {"transformers", "lmfuse", "liger-kernel"}
    if unknown:
        ap.error(f"--impls: unknown {sorted(unknown)}; choose from transformers, lmfuse, "
                 f"liger-kernel")
    device = torch.device("cuda")
    from lmfuse.integrations.transformers import apply_lmfuse

    base = build(args.model, args.quick, device)
    V = base.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, V, (args.batch, args.seq), generator=g).to(device)
    labels = ids.clone()
    labels[:, : args.seq // 16] = -100  # a prompt that carries no loss

    name = f"{args.model} train step [{args.batch}x{args.seq}] V={V}"
    # Generation first: Liger's patch (below) replaces the causal-LM class's forward.
    gen_rows = (time_generation(base, ids[:1, :32], args.generate, args.model)
                if args.generate else [])
    base.train()
    variants = {"transformers": lambda: base,
                "lmfuse": lambda: apply_lmfuse(copy.deepcopy(base)),
                "liger-kernel": lambda: liger_patch(args.model, copy.deepcopy(base))}
    variants = {k: v for k, v in variants.items() if k in impls}
    rows, ref = [], None
    for impl, make in variants.items():
        try:
            model = make()
            step = step_fn(model, ids, labels)
            loss = step()
            note = "" if ref is None else compare(loss, grads(model), *ref)
            if ref is None:
                ref = (loss, grads(model))
            ms = bench_ms(step, device, warmup=200, rep=1000)
            model.zero_grad(set_to_none=False)  # gradients kept allocated: not counted
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            torch.cuda.synchronize()
            mem = (torch.cuda.max_memory_allocated() - before) / 2**20
            del out
            rows.append(Result(name, impl, ms, None, None, mem,
                               f"{args.batch * args.seq / ms * 1e3:,.0f} tokens/s; {note}"))
            if model is not base:
                del model
            torch.cuda.empty_cache()
        except Exception as exc:  # a peer missing or failing is a row with a note
            rows.append(Result(name, impl, None, None, None, None,
                               f"failed: {type(exc).__name__}: {exc}"[:200]))
    lm = next((r.ms for r in rows if r.impl == "lmfuse"), None)
    for r in rows:
        r.ratio = r.ms / lm if (r.ms and lm) else None
    print_table(rows)
    rows += gen_rows
    if args.json:
        import json
        from dataclasses import asdict

        env = environment(device)
        env["transformers"] = dist_version("transformers")
        env["liger-kernel"] = dist_version("liger-kernel")
        Path(args.json).write_text(json.dumps({"env": env, "results": [asdict(r) for r in rows]},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
