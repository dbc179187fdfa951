"""Generate text with the tiny GPT of train_tiny_gpt.py, the way a serving engine does:
a paged KV cache, prompts of different lengths prefilled in chunks, then every sequence
decoded together, one token a step.

    lmfuse.PagedKVCache            one pool of fixed-size blocks per layer, a block table
                                   per sequence (cache.reserve makes room for a step)
    lmfuse.DecodeAttentionBlock    rmsnorm -> qkv -> rotary -> cache append -> decode
                                   attention (1..8 active tokens) -> out projection; it
                                   loads the training attention's state dict unchanged
    lmfuse.decode_attention        attention of the newest tokens over a (paged) cache
    lmfuse.merge_attention_states  combines attention over disjoint parts of a cache

The script checks itself twice: the continuation against a plain full re-forward of the
same weights (no cache, every op's PyTorch reference), and attention over the two halves
of each cache, merged, against attention over the whole cache.

    python examples/decode_tiny_gpt.py --checkpoint tiny_gpt.pt
    python examples/decode_tiny_gpt.py --train-steps 200 --sample   # trains first

The model is lmfuse.tiny_gpt's TinyGPT; its training loop and checkpoints come from
train_tiny_gpt.py, which must lie beside it.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import train_tiny_gpt as tiny  # the training loop and checkpoints

import lmfuse
from lmfuse.tiny_gpt import NORM_EPS, ROPE_THETA, TinyGPT

PREFILL_CHUNK = 8  # decode attention takes 1..8 active tokens a step
DEFAULT_PROMPTS = ("def ", "import torch\n", "    def forward(self, x",
                   "class TinyGPT(nn.Module):\n    ")
# Relative to the largest value: the decode path's logits against a float32 full forward's
# (float32), and the merged halves' attention against the whole cache's (every dtype).
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# Half precision: the decode path's logits may be off a float32 re-forward by twice the
# plain half-precision re-forward's error plus this (relative to the largest logit).
HALF_SLACK = 5e-3


@dataclass
class Generation:
    tokens: list[list[int]]  # the continuation of each prompt
    logits: torch.Tensor  # [prompts, new_tokens, 256] float32: what each token was picked from
    cache: lmfuse.PagedKVCache  # holds every prompt and continuation token but the last
    seq_ids: list[int]
    tokens_per_s: float  # the decode steps (all but the first token), all sequences together


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_blocks(model: TinyGPT, impl: str) -> list[lmfuse.DecodeAttentionBlock]:
    """One DecodeAttentionBlock per layer, with that layer's trained attention weights."""
    weight = model.head.weight
    blocks = []
    for layer in model.layers:
        block = lmfuse.DecodeAttentionBlock(
            model.cfg.d_model, model.cfg.n_heads, model.cfg.n_heads, rope=True,
            rope_theta=ROPE_THETA, norm_eps=NORM_EPS, impl=impl,
            device=weight.device, dtype=weight.dtype)
        block.load_state_dict(layer.attn.state_dict())  # same names, same layout
        blocks.append(block)
    return blocks


def _worse(err: float, new: float) -> float:
    """The larger error, NaN winning (Python's ``max`` keeps whichever comes first, so NaN
    logits read as an error of 0 and passed)."""
    return new if math.isnan(new) or new > err else err


@torch.inference_mode()
def generate(model: TinyGPT, prompts: list[list[int]], new_tokens: int, *,
             block_len: int = 16, sample: bool = False, temperature: float = 1.0,
             seed: int = 0, impl: str = "auto") -> Generation:
    """Continue each of ``prompts`` (non-empty byte lists) by ``new_tokens`` tokens."""
    if not prompts or not all(prompts):
        raise ValueError("generate: need at least one prompt, and no empty one")
    weight = model.head.weight
    device, dtype = weight.device, weight.dtype
    blocks = attention_blocks(model, impl)
    heads, head_dim = model.cfg.n_heads, model.cfg.d_model // model.cfg.n_heads
    blocks_per_seq = -(-(max(map(len, prompts)) + new_tokens) // block_len)
    cache = lmfuse.PagedKVCache(len(prompts) * blocks_per_seq, block_len, heads, head_dim,
                                dtype=dtype, device=device, num_layers=len(blocks))
    seq_ids = [cache.add_sequence() for _ in prompts]

    def forward(ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [n, s_active]`` of sequences ``ids`` -> the logits ``[n, 256]`` after
        their last token; their keys and values are written into the cache."""
        step = cache.reserve(ids, tokens.shape[1])  # blocks for the new tokens
        x = model.embed(tokens)
        for i, (layer, block) in enumerate(zip(model.layers, blocks)):
            # The block writes k, v at positions seqlens_before + j and attends over the
            # seqlens_before + s_active tokens now cached.
            x = x + block(x, cache.k_caches[i], cache.v_caches[i], step.seqlens_before,
                          block_table=step.block_table)
            x = x + layer.mlp(layer.mlp_norm(x))
        return model.head(model.final_norm(x[:, -1]))

    # Prefill one prompt at a time (their lengths differ), PREFILL_CHUNK tokens a step.
    last = []
    for seq_id, prompt in zip(seq_ids, prompts):
        ids = torch.tensor(prompt, device=device)[None]
        for start in range(0, len(prompt), PREFILL_CHUNK):
            logits = forward([seq_id], ids[:, start:start + PREFILL_CHUNK])
        last.append(logits[0])
    logits = torch.stack(last)

    gen = torch.Generator().manual_seed(seed)
    picked, picked_from = [], []
    _sync(device)
    t0 = time.perf_counter()
    for i in range(new_tokens):  # decode: the whole batch, one token a step
        if sample:
            probs = torch.softmax(logits.float() / temperature, -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=gen)[:, 0].to(device)
        else:
            nxt = logits.argmax(-1)
        picked.append(nxt)
        picked_from.append(logits.float())
        if i + 1 < new_tokens:
            logits = forward(seq_ids, nxt[:, None])
    _sync(device)
    # The first token comes from the prefill's logits: the timed steps made the others.
    steps = new_tokens - 1
    rate = len(prompts) * steps / max(time.perf_counter() - t0, 1e-9) if steps > 0 else 0.0
    if not picked:
        return Generation([[] for _ in prompts], logits.new_zeros(len(prompts), 0, 256),
                          cache, seq_ids, 0.0)
    return Generation(torch.stack(picked, 1).tolist(), torch.stack(picked_from, 1), cache,
                      seq_ids, rate)


@torch.no_grad()
def full_forward_logits(model: TinyGPT, prompt: list[int],
                        continuation: list[int]) -> torch.Tensor:
    """The next-token logits ``[len(continuation), 256]`` float32 at each generated
    position, from one plain forward of the whole sequence (no cache)."""
    seq = torch.tensor(prompt + continuation[:-1], device=model.head.weight.device)[None]
    return model.logits(seq)[0, len(prompt) - 1:].float()


@torch.inference_mode()
def split_kv_error(g: Generation, layer: int = 0, impl: str = "auto") -> float:
    """Attention over each sequence's whole cache, against attention over its first and
    second halves merged; returns the max difference relative to the largest output.

    Softmax attention over keys A and B is recoverable from the attention over A alone and
    over B alone, given their log-sum-exps: ``out = (e^lse_A out_A + e^lse_B out_B) /
    (e^lse_A + e^lse_B)``. Split-KV decoding uses this to spread one long sequence over a
    GPU's SMs, context parallelism to spread a context over GPUs; here the halves are block
    lists of one paged cache, the first ceil(blocks / 2) blocks and the rest.
    """
    cache, ids = g.cache, g.seq_ids
    k_cache, v_cache = cache.k_caches[layer], cache.v_caches[layer]
    gen = torch.Generator().manual_seed(0)
    # One query token a sequence: it sees every cached key, so the split is exact.
    q = torch.randn(len(ids), 1, cache.kv_heads, cache.head_dim, generator=gen)
    q = q.to(device=cache.device, dtype=cache.dtype)
    whole = lmfuse.decode_attention(q, k_cache, v_cache, cache.seqlens(ids),
                                    block_table=cache.block_table(ids), impl=impl)
    halves = ([], []), ([], [])  # (block lists, lengths) of the first half, of the second
    for seq_id in ids:
        blocks, length = cache.block_ids(seq_id), cache.seqlen(seq_id)
        cut = (len(blocks) + 1) // 2
        first = min(length, cut * cache.block_len)
        for (tables, lengths), part, n in zip(halves, (blocks[:cut], blocks[cut:]),
                                              (first, length - first)):
            tables.append(part)
            lengths.append(n)
    outs, lses = [], []
    for tables, lengths in halves:
        width = max(1, *map(len, tables))
        table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
        # An empty half (a one-block cache) gives zeros with lse = -inf: it adds nothing.
        out, lse = lmfuse.decode_attention(
            q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device=q.device),
            block_table=table.to(q.device), return_lse=True, impl=impl)
        outs.append(out)
        lses.append(lse)
    merged, _ = lmfuse.merge_attention_states(torch.stack(outs), torch.stack(lses), impl=impl)
    return float((merged.float() - whole.float()).abs().max() / whole.float().abs().max())


def _show(tokens: list[int]) -> str:
    return repr(bytes(tokens).decode("utf-8", errors="replace"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="from train_tiny_gpt.py --save; without one, train first")
    parser.add_argument("--train-steps", type=int, default=200,
                        help="steps to train when no --checkpoint is given (with the model "
                             "and training flags below)")
    parser.add_argument("--prompt", action="append", dest="prompts",
                        help="a prompt to continue (repeatable)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--sample", action="store_true",
                        help="sample with --temperature instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--block-len", type=int, default=16, help="tokens per cache block")
    tiny.add_model_args(parser)
    args = parser.parse_args(argv)
    if args.train_steps < 1 or args.new_tokens < 0:
        parser.error("need --train-steps >= 1 and --new-tokens >= 0")
    if args.dtype == "fp16" and not args.checkpoint:
        parser.error(tiny.FP16_TRAINING + " (then decode its --checkpoint in fp16)")
    if args.block_len < 1:
        parser.error(f"--block-len must be >= 1, got {args.block_len}")
    if args.sample and not (math.isfinite(args.temperature) and args.temperature > 0):
        parser.error(f"--temperature must be a finite number > 0 to sample, got "
                     f"{args.temperature}")
    if any(not p for p in args.prompts or []):
        parser.error("--prompt must not be empty")

    device, dtype = tiny.check_args(parser, args, model=not args.checkpoint)
    if args.checkpoint:
        try:
            model = tiny.load_checkpoint(args.checkpoint, impl=args.impl)
        except Exception as exc:  # (torch.load's errors on a foreign file vary by kind)
            parser.error(f"--checkpoint {args.checkpoint}: not a train_tiny_gpt.py checkpoint "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        print(f"loaded {args.checkpoint}: {model.cfg}")
    else:
        torch.manual_seed(args.seed)
        model = TinyGPT(tiny.model_config(args), impl=args.impl)
        print(f"no --checkpoint: training {model.cfg} for {args.train_steps} steps")
        tiny.train(model.to(device=device, dtype=dtype), tiny.load_bytes(args.text),
                   steps=args.train_steps, batch=args.batch, seq=args.seq, lr=args.lr,
                   seed=args.seed, log_every=max(1, args.train_steps // 5))
    model.to(device=device, dtype=dtype).eval()

    # (surrogateescape: bytes the terminal gave that are not UTF-8 go back as they came)
    prompts = [list(p.encode("utf-8", "surrogateescape"))
               for p in (args.prompts or DEFAULT_PROMPTS)]
    g = generate(model, prompts, args.new_tokens, block_len=args.block_len, sample=args.sample,
                 temperature=args.temperature, seed=args.seed, impl=args.impl)
    how = f"sampled at T={args.temperature}" if args.sample else "greedy"
    print(f"\n{len(prompts)} prompts decoded together over a PagedKVCache ({how}, "
          f"{g.tokens_per_s:,.0f} tok/s on {device}, {dtype}):")
    for prompt, cont in zip(prompts, g.tokens):
        print(f"  {_show(prompt)} -> {_show(cont)}")

    # The same weights, re-run on each whole sequence with every op's PyTorch reference. In
    # half precision the two paths round differently, so both are also held against a
    # float32 re-forward: the decode path must be about as close to it as the plain one.
    plain = TinyGPT(model.cfg, impl="torch").to(device=device, dtype=dtype)
    plain.load_state_dict(model.state_dict())
    exact = None
    if dtype != torch.float32:
        exact = TinyGPT(model.cfg, impl="torch").to(device=device, dtype=torch.float32)
        exact.load_state_dict(model.state_dict())
    agree, logit_err, decode_err, plain_err = True, 0.0, 0.0, 0.0
    for prompt, cont, got in zip(prompts, g.tokens, g.logits):
        if not cont:
            continue
        full = full_forward_logits(plain, prompt, cont)
        # Position t of this forward sees the prompt and cont[:t]: its argmax is what a
        # greedy re-run from scratch picks at step t.
        agree &= full.argmax(-1).tolist() == cont
        logit_err = _worse(logit_err, float((got - full).abs().max() / full.abs().max()))
        if exact is not None:
            ref = full_forward_logits(exact, prompt, cont)
            decode_err = _worse(decode_err, float((got - ref).abs().max() / ref.abs().max()))
            plain_err = _worse(plain_err, float((full - ref).abs().max() / ref.abs().max()))
    print(f"decode logits vs a full re-forward: max |diff| / max |logit| = {logit_err:.1e}")
    if exact is None:
        logits_ok = logit_err <= LOGIT_TOLERANCE[dtype]
        print(f"  (tolerance {LOGIT_TOLERANCE[dtype]:.0e}): {'ok' if logits_ok else 'FAILED'}")
    else:
        logits_ok = decode_err <= 2.0 * plain_err + HALF_SLACK
        print(f"  against a float32 re-forward: decode {decode_err:.1e}, plain {dtype} "
              f"re-forward {plain_err:.1e} (decode within 2x the plain one's error + "
              f"{HALF_SLACK:.0e}): {'ok' if logits_ok else 'FAILED'}")
    if not args.sample:
        print(f"greedy continuations agree with the full re-forward: {'yes' if agree else 'no'}"
              + ("" if agree or dtype == torch.float32 else
                 " (in half precision a near-tie can round either way in the two paths)"))

    merge_err = split_kv_error(g, impl=args.impl)
    merge_ok = merge_err <= LOGIT_TOLERANCE[dtype]
    print(f"attention over two halves of each cache, merged, vs over the whole: max |diff| / "
          f"max |out| = {merge_err:.1e}: {'ok' if merge_ok else 'FAILED'}")
    # Only an fp32 greedy mismatch is an error: half precision may break a near-tie.
    greedy_ok = agree or args.sample or dtype != torch.float32
    return 0 if logits_ok and merge_ok and greedy_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
