"""Generation with ``lmfuse.serving.Generator`` against Hugging Face ``transformers``.

``lmfuse bench generate [options]`` (``--help``). The model: a ``LlamaForCausalLM`` from a
config with random weights (no download; default hidden 2048, 8 layers, FFN 8192, 16 heads,
4 KV heads, vocabulary 128256, bf16, untied embeddings, SDPA). Prompts are random token ids,
greedy decoding, and nothing stops at an end-of-sequence token (``eos_token_id=[]`` for
lmfuse; none in HF's generation config), so every run makes exactly the tokens asked for.

Per ``--batches`` entry B, with prompts of ``--context`` P tokens and N ``--new-tokens``:

``decode step BB PP NN``: ms per decode step (one token for each of the B sequences),
prefill excluded; tokens/s = B / step time.
  floor              the bound: the bytes a step must read -- every parameter but the input
                     embedding (a gather of B rows; counted when tied to the LM head) and
                     the KV cache of B sequences at the mean decode context P + N/2
                     (``Generator.bytes_per_token`` per token) -- at the device-to-device
                     copy rate measured in this run. "x floor": a row's time over it.
  lmfuse             ``Generator`` (CUDA graphs on). After an untimed ``generate()`` of the
                     same prompts (compilations, graph captures) the B requests are added,
                     ``step()`` runs until each has its first token (the prefill steps), then
                     the remaining ``step()`` calls (forward, sampling, scheduler,
                     bookkeeping, the tokens read back to the host) are timed together, one
                     ``torch.cuda.synchronize`` at the end (a greedy step may launch the next
                     before its tokens are read: ``--no-lookahead`` turns that off); their
                     mean. ``--eager``: also ``cuda_graphs=False``;
                     ``--kv-dtype fp8``: also an fp8 (e4m3) cache, with its own floor row.
  hf dynamic         ``model.generate`` (default dynamic cache): the fastest of ``--reps``
                     calls making N and N/2 tokens; the difference over N - N/2 tokens
                     removes the prefill and each call's fixed costs.
  hf static+compile  ``model.generate(cache_implementation="static", compile_config=
                     CompileConfig(fullgraph=True, mode="reduce-overhead"))``, transformers
                     5.x's own way: it compiles the decode forward (CUDA graphs) on CUDA only
                     (on a CPU the static cache runs uncompiled, said in the note). Both
                     lengths run twice untimed first; the same difference method.
``generate BB PP NN (end to end)``: ms of a whole call, prefill included (tokens/s =
B * N / time): ``lmfuse generate()``, the N-token calls above, and ``hf generate_batch``:
transformers' continuous batching through the manager ``model.generate_batch`` wraps
(``init_continuous_batching``, ``warmup``, ``add_request``, ``get_result``; CUDA graphs on
where there is CUDA; its cache sized by its own default), after one untimed pass.

``prefill NxT``: per ``--prefills`` entry, ms of one ``step()`` that prefills N prompts of T
tokens (each asks for one token, so the step ends them), synchronised; the median of five,
after two untimed ``generate()`` calls of the same prompts (compilations, graph captures):
``lmfuse`` (the fused layers where the family has them, in CUDA graphs per size bucket) and
``lmfuse model path`` (``decode_path="model"``: the model's own forward). Notes: prompt
tokens/s. ``--no-prefill`` skips them.

``mixed``: ``--requests`` requests (256), prompt lengths uniform in 64..1024 and output
lengths in 16..256 (seeded), arriving as a Poisson process of ``--rate`` per second (100; 0:
all at once) in wall-clock time: none starts before its arrival. Each implementation serves
the workload untimed, then timed from the first arrival to the last completion:
``lmfuse`` (each request added when due, ``step()`` while any runs; default pool),
``hf generate (batches of 32)`` (arrival order; a batch starts when its last request has
arrived and the previous batch is done; left-padded, run to its longest output, each
request counted for its own length), ``hf generate_batch`` (the manager above, each request
added when due). Notes: requests/s, useful output tokens/s, latency (arrival to completion).
No run can end before the last arrival (printed): ``--rate 0`` measures offline throughput.

Columns: ms as above; TB/s: floor bytes / time (decode steps); x lmfuse: time / lmfuse's
in the case (> 1: lmfuse is faster); peak MiB: most memory allocated beyond the weights
(CUDA; for the pools sized from free memory, lmfuse's in ``mixed`` and ``generate_batch``'s,
beyond the pool too). A peer that fails gives a row with the error. On a CPU (or with
``--quick``) a tiny model runs tiny sizes in float32, single-threaded: a smoke test of the
script, NOT performance. On a GPU, in parts (each well under 10 minutes):

    lmfuse bench generate --no-mixed --no-prefill --eager --json decode.json
    lmfuse bench generate --no-decode --no-mixed --peers "" --json prefill.json
    lmfuse bench generate --no-mixed --context 4096 --batches 16,64 --kv-dtype fp8 --json fp8.json
    lmfuse bench generate --no-decode --no-prefill --json mixed.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch

from lmfuse._launch import cdiv
from lmfuse.bench.common import (Memory, Result, check_plot, dist_version, failure, finish, free,
                                 measure_copy, parser, print_table, start, wall_ms)
from lmfuse._cli_args import (DTYPES, dtype_name, int_list, int_range, missing_package,
                              number_range, output_file, seed)
from lmfuse.serving import Generator

PEERS = ("hf", "hf-static", "hf-cb")
# option: (default, --quick default (also on a CPU), help)
SIZES = {
    "hidden": (2048, 64, "hidden size"), "layers": (8, 2, "layers"),
    "ffn": (8192, 128, "MLP intermediate size"), "heads": (16, 4, "attention heads"),
    "kv_heads": (4, 2, "KV heads"), "vocab": (128256, 512, "vocabulary size"),
    "dtype": ("bf16", "fp32", "model dtype: bf16, fp16 or fp32"),
    "context": (512, 16, "prompt tokens of the decode cases (alias --prompt-len)"),
    "new_tokens": (128, 8, "new tokens per decode-case request (>= 2)"),
    "batches": ("1,16,64", "1,2", "decode batch sizes, comma-separated"),
    "requests": (256, 6, "requests in the mixed workload"),
    "prompt_range": ("64,1024", "4,24", "mixed prompt lengths, uniform in LO,HI"),
    "output_range": ("16,256", "2,6", "mixed output lengths, uniform in LO,HI"),
    "rate": (100.0, 400.0, "mixed arrivals per second, Poisson (0: all at once)"),
    "hf_batch": (32, 4, "prompts per HF generate call in the mixed workload"),
    "reps": (3, 2, "timed repetitions of whole generate calls (the fastest is kept)"),
    "prefills": ("1x64,1x1024,1x4096,8x1024", "1x4,2x12",
                 "prefill cases, NxT (N prompts of T tokens), comma-separated"),
}


def _lo_hi(text: str) -> tuple[int, ...]:
    lo, hi = int_list(2, "LO,HI (two integers)")(text)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _prefills(text: str) -> list[tuple[int, int]]:
    try:
        cases = [tuple(int(v) for v in c.split("x")) for c in text.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(f"expected comma-separated NxT cases of positive "
                                         f"integers (e.g. 1x1024,8x512), got {text!r}")
    return cases


# How each SIZES option is read (the rest: integers >= 1).
SIZE_TYPES = {"dtype": dtype_name, "new_tokens": int_range(2), "batches": int_list(),
              "prompt_range": _lo_hi, "output_range": _lo_hi, "rate": number_range(0),
              "prefills": _prefills}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This benchmark's options, every one checked (a bad one: one line, exit status 2),
    the sizes resolved for --quick (the default on a CPU); the shared ones (--quick, --json)
    also go to common.start."""
    p = parser("lmfuse bench generate", __doc__)
    add = p.add_argument
    for key, (full, quick, text) in SIZES.items():
        flags = ["--" + key.replace("_", "-")] + (["--prompt-len"] if key == "context" else [])
        add(*flags, dest=key, type=SIZE_TYPES.get(key, int_range(1)), default=None,
            help=f"{text} (default {full}; --quick: {quick})")
    add("--kv-dtype", action="append", default=[], choices=["fp8", "bf16", "fp16", "fp32"],
        help="also lmfuse rows with this cache dtype (repeatable), e.g. fp8")
    add("--eager", action="store_true", help="also an lmfuse row with cuda_graphs=False")
    add("--lookahead", action=argparse.BooleanOptionalAction, default=True,
        help="greedy decode steps run one ahead (Generator.lookahead; default on)")
    add("--impl", default="auto", choices=["auto", "triton", "torch"],
        help="lmfuse kernels' path (default auto)")
    add("--block-len", type=int_range(1), default=16,
        help="lmfuse cache block length (default 16)")
    add("--seed", type=seed, default=0, help="prompts, lengths and arrivals (default 0)")
    add("--peers", default=",".join(PEERS), help=f"peers to run (default {','.join(PEERS)})")
    add("--decode", action=argparse.BooleanOptionalAction, default=True,
        help="the decode cases (default on)")
    add("--prefill", action=argparse.BooleanOptionalAction, default=True,
        help="the prefill cases (default on)")
    add("--mixed", action=argparse.BooleanOptionalAction, default=True,
        help="the mixed workload with arrivals (default on)")
    add("--json", type=output_file, help="write the environment and every row as JSON here")
    add("--plot", type=output_file,
        help="write a PNG bar chart of tokens/s here (needs matplotlib)")
    add("--quick", action="store_true",
        help="tiny model and sizes (the default on CPU): a smoke run, not performance")
    args = p.parse_args(argv)
    quick = args.quick or not torch.cuda.is_available()  # as common.start decides
    for key, (full, small, _) in SIZES.items():
        if getattr(args, key) is None:
            default = small if quick else full
            setattr(args, key, SIZE_TYPES[key](default) if key in SIZE_TYPES else default)
    args.peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in args.peers if x not in PEERS]
    if bad:
        p.error(f"argument --peers: unknown {', '.join(bad)}; choose from {', '.join(PEERS)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}), and "
                f"--heads of --kv-heads ({args.kv_heads})")
    if (args.hidden // args.heads) % 2:
        p.error(f"--hidden / --heads (the head dim, {args.hidden // args.heads}) must be even "
                "(the rotary embedding rotates pairs)")
    if args.vocab < 2:
        p.error(f"argument --vocab: must be >= 2, got {args.vocab}")
    other = sorted({d for d in args.kv_dtype if d not in ("fp8", dtype_name(args.dtype))})
    if other:
        p.error(f"argument --kv-dtype: the cache holds the model's dtype "
                f"({dtype_name(args.dtype)}) or fp8, got {', '.join(other)}")
    if args.impl == "triton":
        from lmfuse._dispatch import triton_support

        ok, why = triton_support(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        if not ok:
            p.error(f"argument --impl: triton cannot run here: {why}")
    missing = missing_package("transformers", "lmfuse bench generate",
                              "'lmfuse[bench]' (or transformers)")
    if missing:
        p.error(missing)
    check_plot(p, args.plot)
    return args, (["--quick"] if args.quick else []) + (["--json", args.json] if args.json
                                                         else [])


# --- model, bytes, timing --------------------------------------------------------------------

def build_model(args: argparse.Namespace, device: torch.device) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab, tie_word_embeddings=False, attn_implementation="sdpa",
        max_position_embeddings=max(8192, args.context + args.new_tokens + 16,
                                    args.prompt_range[1] + args.output_range[1] + 16,
                                    max(t for _, t in args.prefills) + 16))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(DTYPES[args.dtype]).eval()
    gen = model.generation_config  # no end-of-sequence stop: every run makes what it asks
    gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
    return model


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads from the weights: every parameter but the input embedding
    (a gather of B rows), which counts when the LM head shares it."""
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb or tied)


def failed(case: str, impl: str, exc: BaseException) -> Result:
    return Result(case, impl, None, note=failure(exc, 200))


# --- lmfuse ----------------------------------------------------------------------------------

def lmfuse_decode(model: Any, prompts: list[list[int]], new: int, args: argparse.Namespace,
                  device: torch.device, kv_dtype: Any, graphs: bool) -> dict:
    """Median decode-step ms (prefill excluded), generate() ms, the tokens, peak MiB."""
    with warnings.catch_warnings(record=True) as caught:  # a failed capture only warns
        warnings.simplefilter("always", RuntimeWarning)
        r = _lmfuse_decode(model, prompts, new, args, device, kv_dtype, graphs)
    if any("CUDA graph" in str(w.message) for w in caught):
        r["note"] += "; CUDA graph capture FAILED: decoded eagerly"
    return r


def _lmfuse_decode(model: Any, prompts: list[list[int]], new: int, args: argparse.Namespace,
                   device: torch.device, kv_dtype: Any, graphs: bool) -> dict:
    mem = Memory(device)
    mem.start()
    per_seq = cdiv(len(prompts[0]) + new, args.block_len) + 1
    gen = Generator(model, block_len=args.block_len, num_blocks=len(prompts) * per_seq,
                    kv_dtype=kv_dtype, cuda_graphs=graphs, impl=args.impl,
                    max_batch=max(256, len(prompts)))
    gen.lookahead = args.lookahead
    kw = dict(max_new_tokens=new, eos_token_id=[])
    tokens = gen.generate(prompts, **kw)  # warm-up: compilations, graph captures
    rids = {gen.add_request(p, **kw) for p in prompts}
    started: set[int] = set()
    while started != rids:  # each request's first token comes from its prefill
        started.update(rid for rid, _, _ in gen.step())
    # The decode phase timed whole (one synchronisation at its end): a step may launch the
    # next before its tokens are read, which a synchronisation per step would undo.
    def decode_phase() -> int:
        count = 0
        while gen.has_unfinished():
            gen.step()
            count += 1
        return count

    phase_ms, steps = wall_ms(decode_phase, device)
    e2e = min(wall_ms(lambda: gen.generate(prompts, **kw), device)[0] for _ in range(args.reps))
    pool = gen.cache.num_blocks * args.block_len * gen.bytes_per_token / 2**20
    note = f"{steps} steps; pool {pool:.1f} MiB"
    replay = _replay_ms(gen, len(prompts), device)
    if replay is not None:  # what the GPU alone takes of a step
        note += f"; graph replay alone {replay:.3f} ms"
    return dict(step_ms=phase_ms / max(steps, 1), steps=steps, e2e_ms=e2e, tokens=tokens,
                peak=mem.peak_mib(), note=note)


def _replay_ms(gen: Generator, batch: int, device: torch.device) -> float | None:
    """Median ms of a replay of the widest graph captured for ``batch`` rows (CUDA)."""
    graphs = [g for k, g in gen.runner._graphs.items()
              if k[0] != "prefill" and g.batch >= batch]
    if not graphs or device.type != "cuda":
        return None
    g = max(graphs, key=lambda g: (-g.batch, g.width))
    return statistics.median(wall_ms(g.graph.replay, device)[0] for _ in range(20))


def lmfuse_serve(gen: Generator, work: dict) -> dict:
    """The mixed workload on ``gen``: each request added once its arrival time has passed,
    ``step()`` while any runs (sleeping until the next arrival when none does)."""
    arrivals, n = work["arrivals"], len(work["prompts"])
    index: dict[int, int] = {}
    done, lengths, nxt = {}, [0] * n, 0
    t0 = time.perf_counter()
    while len(done) < n:
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            rid = gen.add_request(work["prompts"][nxt], max_new_tokens=work["outputs"][nxt],
                                  eos_token_id=[])
            index[rid] = nxt
            nxt += 1
        if not gen.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        for rid, toks, finished in gen.step():
            lengths[index[rid]] += len(toks)
            if finished:
                done[index[rid]] = time.perf_counter() - t0
    return dict(finish=[done[i] for i in range(n)], lengths=lengths)


# --- Hugging Face ----------------------------------------------------------------------------

def hf_generate(model: Any, ids: torch.Tensor, n: int, mask: torch.Tensor | None = None,
                **kw: Any) -> torch.Tensor:
    mask = torch.ones_like(ids) if mask is None else mask
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, **kw)
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, not {n}")
    return out


def hf_per_token(model: Any, ids: torch.Tensor, new: int, args: argparse.Namespace,
                 device: torch.device, warm: int, **kw: Any) -> dict:
    """ms per decode step from the fastest of ``--reps`` calls of N and of N/2 new tokens
    (the difference removes the prefill and each call's fixed costs); the N-token call's ms
    and tokens; the graphs torch.compile made while timed (a recompilation, if any)."""
    half = new // 2
    mem = Memory(device)
    mem.start()
    for _ in range(warm):  # N first: a static cache is sized once for both lengths
        hf_generate(model, ids, new, **kw)
        hf_generate(model, ids, half, **kw)
    graphs = _compiled_graphs()
    full = [wall_ms(lambda: hf_generate(model, ids, new, **kw), device) for _ in range(args.reps)]
    part = [wall_ms(lambda: hf_generate(model, ids, half, **kw), device)[0]
            for _ in range(args.reps)]
    t_full, t_half = min(ms for ms, _ in full), min(part)  # fixed work: noise only adds
    noise = "" if t_full > t_half else (f"{new} tokens took {t_full:.1f} ms, {half} took "
                                        f"{t_half:.1f} ms: lost in the noise")
    return dict(step_ms=None if noise else (t_full - t_half) / (new - half), e2e_ms=t_full,
                noise=noise, tokens=full[0][1][:, ids.shape[1]:].tolist(), peak=mem.peak_mib(),
                recompiled=_compiled_graphs() - graphs)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def hf_static(model: Any, ids: torch.Tensor, new: int, args: argparse.Namespace,
              device: torch.device) -> tuple[dict, str]:
    from transformers import CompileConfig

    if device.type != "cuda":
        return (hf_per_token(model, ids, new, args, device, 2, cache_implementation="static"),
                "CPU: static cache NOT compiled (transformers auto-compiles on CUDA only)")
    note = "torch.compile reduce-overhead, fullgraph"
    kw = dict(cache_implementation="static")
    try:
        r = hf_per_token(model, ids, new, args, device, 2, **kw,
                         compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    except Exception as exc:  # retried once without fullgraph: a graph break is no failure
        torch._dynamo.reset()
        note = f"fullgraph=True failed ({type(exc).__name__}): fullgraph=False"
        r = hf_per_token(model, ids, new, args, device, 2, **kw,
                         compile_config=CompileConfig(fullgraph=False, mode="reduce-overhead"))
    if r["recompiled"]:
        note += f"; {r['recompiled']} graphs compiled while timed"
    return r, note


def hf_cb_serve(model: Any, work: dict, device: torch.device, passes: int = 2) -> dict:
    """transformers' continuous batching (the manager ``generate_batch`` wraps): requests
    added at their arrival times, results read as they finish; the last pass is timed."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    prompts, outputs, arrivals = work["prompts"], work["outputs"], work["arrivals"]
    n = len(prompts)
    free(device)
    if device.type == "cuda":  # its cache sized from free GPU memory, as a user gets it
        cb_cfg = ContinuousBatchingConfig(use_cuda_graph=True)
    else:  # on a CPU it would take 60% of the host's memory: sized to the workload instead
        page = ContinuousBatchingConfig.page_size
        blocks = sum(cdiv(len(p) + o, page) + 1 for p, o in zip(prompts, outputs))
        cb_cfg = ContinuousBatchingConfig(use_cuda_graph=False, num_blocks=blocks,
                                          max_batch_tokens=max(256, *map(len, prompts)))
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                           max_new_tokens=max(outputs)),
        continuous_batching_config=cb_cfg,
        workload_hints=WorkloadHints(max_prompt_length=max(map(len, prompts)),
                                     max_generated_length=max(outputs), num_requests=n))
    attn, mem = model.config._attn_implementation, Memory(device)
    try:
        manager.warmup()
        manager.start()
        for p in range(passes):
            mem.start()
            done: dict[int, tuple[float, int]] = {}
            nxt, t0, last = 0, time.perf_counter(), time.perf_counter()
            while len(done) < n:
                now = time.perf_counter() - t0
                while nxt < n and arrivals[nxt] <= now:
                    manager.add_request(prompts[nxt], request_id=f"p{p}-{nxt}",
                                        max_new_tokens=outputs[nxt])
                    nxt += 1
                res = manager.get_result(timeout=max(arrivals[nxt] - now if nxt < n else 0.5,
                                                     1e-4))
                if res is None:
                    if not manager.is_running() or time.perf_counter() - last > 300:
                        raise RuntimeError("the continuous batching manager stopped or stalled")
                    continue
                last = time.perf_counter()
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(f"request {res.request_id}: {res.error}")
                    done[int(res.request_id.split("-")[1])] = (last - t0,
                                                              len(res.generated_tokens))
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return dict(finish=[done[i][0] for i in range(n)], lengths=[done[i][1] for i in range(n)],
                peak=mem.peak_mib(), note=f"attn {attn}")


def hf_batched_serve(model: Any, work: dict, size: int, device: torch.device) -> dict:
    """Static batches of ``size`` in arrival order: a batch starts once its last request has
    arrived and the previous batch is done; left-padded; runs to its longest output."""
    prompts, outputs, arrivals = work["prompts"], work["outputs"], work["arrivals"]
    finish = []
    t0 = time.perf_counter()
    for lo in range(0, len(prompts), size):
        group = range(lo, min(lo + size, len(prompts)))
        time.sleep(max(0.0, arrivals[group[-1]] - (time.perf_counter() - t0)))
        width = max(len(prompts[i]) for i in group)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in group])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i])
                             for i in group])
        wall_ms(lambda: hf_generate(model, ids.to(device), max(outputs[i] for i in group),
                                    mask.to(device)), device)
        finish += [time.perf_counter() - t0] * len(group)
    return dict(finish=finish, lengths=list(outputs))  # each output cut to its own length


# --- cases -----------------------------------------------------------------------------------

def make_floors(model: Any, args: argparse.Namespace, copy: dict, env: dict) -> dict:
    """Per cache dtype (None: the model's): the bytes a decode step must read at batch b,
    and a note on them."""
    weights = weight_bytes(model)
    ctx = args.context + args.new_tokens / 2
    floors = {}
    for kv in [None] + args.kv_dtype:
        bpt = Generator(model, num_blocks=1, kv_dtype=kv, cuda_graphs=False).bytes_per_token
        env.setdefault("kv_bytes_per_token", {})[kv or args.dtype] = bpt

        def note(b: int, bpt: int = bpt) -> str:
            return (f"weights {weights / 2**20:.1f} MiB + KV {bpt * b * ctx / 2**20:.1f} MiB "
                    f"({bpt} B/token, context {ctx:g}) at {copy['tbps']:.2f} TB/s")

        floors[kv] = (lambda b, bpt=bpt: weights + bpt * b * ctx, note)
    return floors


def decode_rows(model: Any, batch: int, args: argparse.Namespace, device: torch.device,
                floors: dict, tbps: float, tokps: dict) -> list[Result]:
    P, N = args.context, args.new_tokens
    ids = torch.randint(1, args.vocab, (batch, P),
                        generator=torch.Generator().manual_seed(args.seed + batch))
    prompts, ids = ids.tolist(), ids.to(device)
    step_case = f"decode step B{batch} P{P} N{N}"
    e2e_case = f"generate B{batch} P{P} N{N} (end to end)"
    steps: list[Result] = []
    e2e: list[Result] = []

    def step_row(impl: str, r: dict, kv: str | None, note: str) -> Result:
        floor_ms = floors[kv][0](batch) / tbps / 1e9
        return Result(step_case, impl, r["step_ms"], floors[kv][0](batch) / 1e9 / r["step_ms"],
                      None, r["peak"], f"{r['step_ms'] / floor_ms:.2f}x floor; {note}")

    for kv, (nbytes, note) in floors.items():
        steps.append(Result(step_case, "floor" + (f" ({kv} KV)" if kv else ""),
                            nbytes(batch) / tbps / 1e9, tbps, note=note(batch)))
    variants = [("lmfuse", None, True)] + ([("lmfuse eager", None, False)] if args.eager else [])
    variants += [(f"lmfuse {kv} KV", kv, True) for kv in args.kv_dtype]
    want = None  # the first lmfuse row's tokens, which the others are compared with
    for impl, kv, graphs in variants:
        try:
            r = lmfuse_decode(model, prompts, N, args, device, kv, graphs)
        except Exception as exc:
            steps.append(failed(step_case, impl, exc))
            continue
        same = "" if want is None else f"; tokens = lmfuse's in {_same(r, want)}"
        want = want or r["tokens"]
        steps.append(step_row(impl, r, kv, r["note"] + same))
        e2e.append(Result(e2e_case, f"{impl} generate()", r["e2e_ms"], None, None, r["peak"]))
    peers = {"hf": ("hf dynamic", lambda: (hf_per_token(model, ids, N, args, device, 1), "")),
             "hf-static": ("hf static+compile", lambda: hf_static(model, ids, N, args, device))}
    for impl, run_peer in (v for k, v in peers.items() if k in args.peers):
        try:
            r, note = run_peer()
        except Exception as exc:
            steps.append(failed(step_case, impl, exc))
            continue
        note = f"{note}; tokens = lmfuse's in {_same(r, want)}".lstrip("; ")
        steps.append(step_row(impl, r, None, note) if r["step_ms"] else
                     Result(step_case, impl, None, note=f"{r['noise']}; {note}"))
        e2e.append(Result(e2e_case, impl, r["e2e_ms"], None, None, r["peak"]))
    if "hf-cb" in args.peers:
        work = dict(prompts=prompts, outputs=[N] * batch, arrivals=[0.0] * batch)
        try:
            r = hf_cb_serve(model, work, device)
            e2e.append(Result(e2e_case, "hf generate_batch", max(r["finish"]) * 1e3, None,
                              None, r["peak"], r["note"]))
        except Exception as exc:
            e2e.append(failed(e2e_case, "hf generate_batch", exc))
    for rows, tokens_per_row in ((steps, batch), (e2e, batch * N)):
        base = next((r.ms for r in rows if r.impl.startswith("lmfuse") and r.ms), None)
        for r in (r for r in rows if r.ms):
            r.ratio = r.ms / base if base else None
            tokps[(r.case, r.impl)] = tokens_per_row / r.ms * 1e3
            r.note = f"{tokens_per_row / r.ms * 1e3:,.0f} tok/s; {r.note}".rstrip("; ")
    print_table(steps + e2e, header=False)
    return steps + e2e


def prefill_rows(model: Any, args: argparse.Namespace, device: torch.device) -> list[Result]:
    """The ``prefill NxT`` rows (module docstring)."""
    rows: list[Result] = []
    for n, T in args.prefills:
        g = torch.Generator().manual_seed(args.seed + 7 * n + T)
        prompts = torch.randint(1, args.vocab, (n, T), generator=g).tolist()
        case, base = f"prefill {n}x{T}", None
        for impl, path in (("lmfuse", "auto"), ("lmfuse model path", "model")):
            try:
                ms = _prefill_ms(model, prompts, args, device, path)
            except Exception as exc:
                rows.append(failed(case, impl, exc))
                continue
            base = base or ms
            rows.append(Result(case, impl, ms, ratio=ms / base,
                               note=f"{n * T / ms * 1e3:,.0f} prompt tok/s"))
        free(device)
    print_table(rows, header=False)
    return rows


def _prefill_ms(model: Any, prompts: list[list[int]], args: argparse.Namespace,
                device: torch.device, path: str) -> float:
    per_seq = cdiv(len(prompts[0]) + 1, args.block_len) + 1
    gen = Generator(model, block_len=args.block_len, num_blocks=len(prompts) * per_seq,
                    impl=args.impl, decode_path=path, max_batch=max(256, len(prompts)),
                    max_prefill_tokens=max(8192, sum(map(len, prompts))))
    kw = dict(max_new_tokens=1, eos_token_id=[])
    try:
        for _ in range(2):  # compilations, graph captures
            gen.generate(prompts, **kw)
        times = []
        for _ in range(5):
            for p in prompts:
                gen.add_request(p, **kw)
            times.append(wall_ms(gen.step, device)[0])
            while gen.has_unfinished():  # nothing left: each request asked for one token
                gen.step()
        return statistics.median(times)
    finally:
        gen.close()


def _same(r: dict, want: list[list[int]] | None) -> str:
    """How many sequences are identical to ``want``'s, and the mean share of tokens before
    the first difference (greedy decoding of random weights meets near-ties)."""
    pairs = list(zip(r["tokens"], want or []))
    if not pairs:
        return "0/0"
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) / max(len(x), 1)
              for x, y in pairs]
    same = sum(x == y for x, y in pairs)
    return f"{same}/{len(pairs)} (mean identical prefix {100 * statistics.mean(prefix):.0f}%)"


def mixed_work(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    (plo, phi), (olo, ohi), n = args.prompt_range, args.output_range, args.requests
    prompts = [[rng.randrange(1, args.vocab) for _ in range(rng.randint(plo, phi))]
               for _ in range(n)]
    outputs = [rng.randint(olo, ohi) for _ in range(n)]
    gaps = [rng.expovariate(args.rate) if args.rate > 0 else 0.0 for _ in range(n - 1)]
    arrivals = [sum(gaps[:i]) for i in range(n)]
    return dict(prompts=prompts, outputs=outputs, arrivals=arrivals)


def mixed_rows(model: Any, args: argparse.Namespace, device: torch.device, passes: int,
               tokps: dict) -> list[Result]:
    work = mixed_work(args)
    n, useful = len(work["prompts"]), sum(work["outputs"])
    case = f"mixed {n} req, " + (f"{args.rate:g}/s arrivals" if args.rate else "all at once")
    print(f"# mixed: {n} requests arriving over {work['arrivals'][-1]:.2f} s, "
          f"{sum(map(len, work['prompts']))} prompt and {useful} output tokens")

    def timed(serve: Callable[[], dict]) -> dict:  # the last of ``passes`` runs
        mem = Memory(device)
        for _ in range(passes):
            mem.start()
            res = serve()
        return res | dict(peak=mem.peak_mib())

    def lmfuse() -> dict:
        free(device)  # its pool takes a share of the free memory
        gen = Generator(model, block_len=args.block_len, impl=args.impl)
        gen.lookahead = args.lookahead
        pool = gen.cache.num_blocks * args.block_len * gen.bytes_per_token / 2**30
        try:
            return timed(lambda: lmfuse_serve(gen, work)) | dict(note=f"pool {pool:.2f} GiB")
        finally:
            gen.close()  # its pool and graphs freed before a peer sizes its cache

    runs = {"lmfuse": lmfuse}
    if "hf" in args.peers:
        runs[f"hf generate (batches of {args.hf_batch})"] = lambda: timed(
            lambda: hf_batched_serve(model, work, args.hf_batch, device))
    if "hf-cb" in args.peers:
        runs["hf generate_batch"] = lambda: hf_cb_serve(model, work, device, passes)
    rows = []
    for impl, run_impl in runs.items():
        try:
            res = run_impl()
        except Exception as exc:
            rows.append(failed(case, impl, exc))
            continue
        wall = max(res["finish"])
        lat = sorted(f - a for f, a in zip(res["finish"], work["arrivals"]))
        bad = sum(a != b for a, b in zip(res["lengths"], work["outputs"]))
        note = (f"{n / wall:.2f} req/s; {useful / wall:,.0f} useful tok/s; latency mean "
                f"{statistics.mean(lat):.2f} s, p90 {lat[int(0.9 * (n - 1))]:.2f} s; "
                + (f"{bad} outputs of the wrong length; " if bad else "") + res.get("note", ""))
        tokps[(case, impl)] = useful / wall
        rows.append(Result(case, impl, wall * 1e3, None, None, res["peak"], note.rstrip("; ")))
    base = next((r.ms for r in rows if r.impl == "lmfuse" and r.ms), None)
    for r in rows:
        r.ratio = r.ms / base if (r.ms and base) else None
    print_table(rows, header=False)
    return rows


def main(argv: list[str] | None = None) -> int:
    args, common = parse(sys.argv[1:] if argv is None else list(argv))
    _, device, quick, env = start("lmfuse bench generate", __doc__, common)
    threads = torch.get_num_threads()
    if device.type == "cpu":  # tiny ops: threads only add barriers (and stalls on a busy CPU)
        torch.set_num_threads(1)
    try:
        return run(args, device, quick, env)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, device: torch.device, quick: bool, env: dict) -> int:
    smoke = quick or device.type != "cuda"
    if smoke:
        print("# SMOKE RUN (--quick or no CUDA): a tiny model at tiny sizes; the figures are "
              "NOT performance")
    model = build_model(args, device)
    weights = weight_bytes(model)
    env.update(transformers=dist_version("transformers"), smoke=smoke,
               settings={k: v for k, v in vars(args).items() if k not in ("json", "plot")},
               weight_bytes_read_per_step=weights)
    copy = measure_copy(min(max(weights, 2**20), 2**31), device)
    floors = make_floors(model, args, copy, env)
    print(f"# {args.dtype} Llama-like model: {weights / 2**20:.1f} MiB of weights read per "
          f"step; KV-cache bytes per token {env['kv_bytes_per_token']}; lmfuse impl "
          f"{args.impl}\n# decode step: ms per step, prefill excluded; end to end: ms per "
          "call; mixed: ms for the workload. TB/s: floor bytes / time; x lmfuse: time / "
          "lmfuse's; peak MiB: beyond the weights")
    print_table([])
    tokps: dict = {}
    rows: list[Result] = []
    for batch in args.batches if args.decode else []:
        rows += decode_rows(model, batch, args, device, floors, copy["tbps"], tokps)
    if args.prefill:
        rows += prefill_rows(model, args, device)
    if args.mixed:  # two untimed passes first, but in a smoke run: a pass whose arrivals
        # batch the requests otherwise meets new batch shapes, whose CUDA graphs and
        # kernel variants are made in the pass (H100, a fresh Triton cache: 5.47 against
        # 3.01 s for the second pass of the same code)
        rows += mixed_rows(model, args, device, 1 if smoke else 3, tokps)
    if smoke:
        print("# SMOKE RUN: not performance")
    env["tokens_per_s"] = [dict(case=c, impl=i, tokens_per_s=v) for (c, i), v in tokps.items()]
    return finish(args, env, copy, rows, f"generate on {env['device']}",
                  value=lambda r: tokps.get((r.case, r.impl)), case_width=1.8, log=True,
                  ylabel="tokens/s (decode: per step; end to end, mixed: whole run)")


if __name__ == "__main__":
    raise SystemExit(main())
