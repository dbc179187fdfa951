"""The tiny byte-level GPT that ``lmfuse demo`` trains and ``examples/`` train and decode:
one definition, with lmfuse's ops (``fused=True``) or plain PyTorch's, the same parameters
either way.

    tokens -> embedding -> L x [x + attn(x); x + mlp(rmsnorm(x))] -> rmsnorm -> head
    attn    RMSNorm -> fused QKV projection -> rotary embedding -> causal attention -> out

The parameter names are what the users map the weights by: :func:`as_llama` views them as a
``transformers`` LlamaForCausalLM (no copy), ``examples/decode_tiny_gpt.py`` loads each
attention into an ``lmfuse.DecodeAttentionBlock``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

import lmfuse
from lmfuse.attention.block import rope_inv_freq

VOCAB = 256  # bytes
NORM_EPS = 1e-6
ROPE_THETA = 10000.0


@dataclass
class ModelConfig:
    """The tiny GPT's sizes and MLP activation (the examples save it with their weights)."""

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    ffn: int = 192
    activation: str = "swiglu"  # any lmfuse.FusedMLP activation; the plain model: PLAIN_MLP's


def rms_norm(x: torch.Tensor, weight: torch.Tensor, fused: bool = False,
             impl: str = "auto") -> torch.Tensor:
    """``lmfuse.rms_norm`` when ``fused``, else the formula in float32 math, rounded once."""
    if fused:
        return lmfuse.rms_norm(x, weight, eps=NORM_EPS, impl=impl)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
            * weight.float()).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _inv_freq(head_dim: int, device: torch.device) -> torch.Tensor:
    """The rotary frequencies, float32, kept on ``device`` (a buffer would be rounded by
    ``model.to(dtype)``): DecodeAttentionBlock's own, formed on the CPU by the float32
    formula transformers' Llama uses, so the bits are the same and training, the decode
    example's blocks and :func:`as_llama`'s Llama all turn by the same angles. (Made
    outside inference mode: a cached inference tensor could not be saved for backward.)"""
    with torch.inference_mode(False):
        return rope_inv_freq(head_dim, ROPE_THETA, device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [B, T, H, D]`` by ``cos, sin [T, 1, D/2]``."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class RMSNorm(nn.Module):
    """``lmfuse.rms_norm`` in the fused model, the plain formula in the other."""

    def __init__(self, d: int, fused: bool, impl: str) -> None:
        super().__init__()
        self.fused, self.impl = fused, impl
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.fused, self.impl)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with lmfuse.DecodeAttentionBlock's parameters:
    ``input_norm_weight`` (its RMSNorm), ``qkv`` (the query, key and value projections
    stacked in that order, ``[3 d, d]``), ``out``; no biases, rope over the whole head."""

    def __init__(self, d: int, n_heads: int, fused: bool, impl: str) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.fused, self.impl = n_heads, d // n_heads, fused, impl
        self.input_norm_weight = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        H, D = self.n_heads, self.head_dim
        h = rms_norm(x, self.input_norm_weight, self.fused, self.impl)
        q, k, v = self.qkv(h).view(B, T, 3, H, D).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        scores = q @ k.transpose(-1, -2)  # [B, H, T, T]
        if self.fused:  # scale, causal mask and softmax in one kernel; no [T, T] mask tensor
            p = lmfuse.fused_softmax(scores, scale=D ** -0.5, causal=True, impl=self.impl)
        else:
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            p = torch.softmax((scores.float() * D ** -0.5).masked_fill(future, -math.inf),
                              -1).to(x.dtype)
        return self.out((p @ v).transpose(1, 2).reshape(B, T, d))


_gelu = functools.partial(F.gelu, approximate="tanh")
# FusedMLP's activations in plain PyTorch (GELU tanh-approximated, as FusedMLP's):
# name -> (the activation, gated).
PLAIN_MLP = {"swiglu": (F.silu, True), "geglu": (_gelu, True),
             "quick_geglu": (lambda a: a * torch.sigmoid(1.702 * a), True),
             "gelu": (_gelu, False), "squared_relu": (lambda a: F.relu(a).square(), False)}


class PlainMLP(nn.Module):
    """``FusedMLP(d, ffn, activation, bias=False)`` in plain PyTorch (same parameters)."""

    def __init__(self, d: int, ffn: int, activation: str) -> None:
        super().__init__()
        self.act, self.gated = PLAIN_MLP[activation]
        self.fc1 = nn.Linear(d, 2 * ffn if self.gated else ffn, bias=False)
        self.fc2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if not self.gated:
            return self.fc2(self.act(h))
        a, g = h.chunk(2, -1)  # the activated half first, as FusedMLP
        return self.fc2(self.act(a) * g)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool, impl: str) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, fused, impl)
        self.mlp_norm = RMSNorm(cfg.d_model, fused, impl)
        self.mlp = (lmfuse.FusedMLP(cfg.d_model, cfg.ffn, cfg.activation, bias=False, impl=impl)
                    if fused else PlainMLP(cfg.d_model, cfg.ffn, cfg.activation))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """The byte-level GPT, with lmfuse's ops (``fused``; ``impl`` their path) or plain
    PyTorch's: the same parameters either way, so one's state dict loads into the other.
    ``cfg``: a :class:`ModelConfig` or anything with its fields (a :class:`DemoConfig`);
    kept as ``self.cfg``, a ModelConfig."""

    def __init__(self, cfg: Any, fused: bool = True, impl: str = "auto") -> None:
        super().__init__()
        cfg = ModelConfig(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)})
        for name in ("d_model", "n_heads", "n_layers", "ffn"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TinyGPT: {name} must be an integer >= 1, got {value!r}")
        if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(f"TinyGPT: d_model ({cfg.d_model}) must be n_heads "
                             f"({cfg.n_heads}) times an even head_dim (rotary embeddings "
                             "rotate pairs)")
        if not fused and cfg.activation not in PLAIN_MLP:
            raise ValueError(f"TinyGPT: activation must be one of {', '.join(PLAIN_MLP)} in "
                             f"the plain model (fused=False), got {cfg.activation!r}")
        self.cfg, self.fused, self.impl = cfg, fused, impl
        self.head_dim = cfg.d_model // cfg.n_heads
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg, fused, impl) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, fused, impl)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [B, T]`` -> final hidden states ``[B, T, d_model]``."""
        x = self.embed(tokens)
        positions = torch.arange(tokens.shape[1], device=x.device, dtype=torch.float32)
        angle = (positions[:, None] * _inv_freq(self.head_dim, x.device))[:, None]  # [T,1,D/2]
        # cos / sin of the float32 angles, then rounded (as transformers' Llama and
        # DecodeAttentionBlock take them; rounding the angles first would move them by up to
        # half a radian).
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.final_norm(x)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(tokens))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, *,
             materialise_logits: bool = False, z_loss: float = 0.0,
             label_smoothing: float = 0.0) -> torch.Tensor:
        """Mean next-byte loss of ``tokens [B, T]`` against ``targets [B, T]``. Fused:
        lmfuse.linear_cross_entropy (hidden @ head.weight.T chunk by chunk, the [tokens, 256]
        logits never materialised) or, ``materialise_logits``, lmfuse.cross_entropy. Plain
        (the logits always materialised): F.cross_entropy of float32 logits, plus ``z_loss *
        logsumexp(logits) ** 2`` averaged over the tokens the loss counts (targets other
        than -100), as lmfuse's losses average it."""
        h, y = self.hidden(tokens).flatten(0, 1), targets.flatten()
        opts = dict(z_loss=z_loss, label_smoothing=label_smoothing)
        if not self.fused:
            logits = self.head(h).float()
            loss = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
            if not z_loss:
                return loss
            counted = y != -100
            z = logits.logsumexp(-1).square() * counted
            return loss + z_loss * z.sum() / counted.sum().clamp(min=1)
        if materialise_logits:
            return lmfuse.cross_entropy(self.head(h), y, impl=self.impl, **opts)
        return lmfuse.linear_cross_entropy(h, self.head.weight, y, impl=self.impl, **opts)




def load_text(path: Optional[str]) -> tuple[bytes, str]:
    if path is not None:
        return Path(path).read_bytes(), path
    root = Path(lmfuse.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    return b"\n".join(f.read_bytes() for f in files), f"lmfuse's own source ({len(files)} files)"




def as_llama(model: TinyGPT, max_positions: int) -> Any:
    """``model`` as a ``transformers.LlamaForCausalLM`` (eval mode) whose parameters are
    ``model``'s own tensors: views of the same storage, nothing copied, so the Llama model
    sees every later change of ``model``'s weights. ``max_positions``: its
    ``max_position_embeddings``.

        TinyGPT                               LlamaForCausalLM
        embed.weight                          model.embed_tokens.weight
        layers[i].attn.input_norm_weight      model.layers[i].input_layernorm.weight
        layers[i].attn.qkv.weight rows        ...self_attn.{q,k,v}_proj.weight (d rows each,
                                              in that order)
        layers[i].attn.out.weight             ...self_attn.o_proj.weight
        layers[i].mlp_norm.weight             ...post_attention_layernorm.weight
        layers[i].mlp.fc1.weight rows         ...mlp.gate_proj.weight (the first ffn rows:
                                              the activated half), ...mlp.up_proj.weight
        layers[i].mlp.fc2.weight              ...mlp.down_proj.weight
        final_norm.weight                     model.norm.weight
        head.weight                           lm_head.weight (untied)

    The computations agree without transforming anything: pre-norm residual blocks,
    RMSNorm with eps 1e-6 (Llama multiplies by the weight after rounding to the input dtype,
    TinyGPT before: equal in fp32, one rounding apart in half precision), rotate-half rotary
    embeddings of theta 1e4 over the whole head from float32 angles, attention scaled by
    ``head_dim ** -0.5`` with as many key/value heads as query heads, ``silu(gate) * up``,
    no biases. The rotary frequencies are a float32 buffer of the Llama model, computed as
    TinyGPT computes them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if model.cfg.activation != "swiglu":
        raise ValueError(f"as_llama: Llama's MLP is SwiGLU; this model's activation is "
                         f"{model.cfg.activation!r}")
    first = model.layers[0]
    d, H = model.embed.embedding_dim, first.attn.n_heads
    ffn = first.mlp.fc2.in_features
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=ffn,
        num_hidden_layers=len(model.layers), num_attention_heads=H, num_key_value_heads=H,
        head_dim=d // H, hidden_act="silu", max_position_embeddings=max_positions,
        rms_norm_eps=NORM_EPS, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device("meta"):  # no memory: every parameter is replaced by a view below
        llama = LlamaForCausalLM(config)

    def share(module: nn.Module, tensor: torch.Tensor) -> None:
        module.weight = nn.Parameter(tensor.detach(), requires_grad=False)

    share(llama.model.embed_tokens, model.embed.weight)
    for layer, ours in zip(llama.model.layers, model.layers):
        attn, qkv = layer.self_attn, ours.attn.qkv.weight
        share(layer.input_layernorm, ours.attn.input_norm_weight)
        for proj, rows in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv.split(d)):
            share(proj, rows)
        share(attn.o_proj, ours.attn.out.weight)
        share(layer.post_attention_layernorm, ours.mlp_norm.weight)
        share(layer.mlp.gate_proj, ours.mlp.fc1.weight[:ffn])
        share(layer.mlp.up_proj, ours.mlp.fc1.weight[ffn:])
        share(layer.mlp.down_proj, ours.mlp.fc2.weight)
    share(llama.model.norm, model.final_norm.weight)
    share(llama.lm_head, model.head.weight)
    device = model.head.weight.device
    # Built on the CPU in float32, as transformers builds it, then moved (not cast).
    llama.model.rotary_emb = type(llama.model.rotary_emb)(config).to(device)
    left = [n for n, t in (*llama.named_parameters(), *llama.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"as_llama: {left[0]} was not given a tensor of the model")
    return llama.eval()
