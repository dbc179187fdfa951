"""``lmfuse.serving.Generator``: continuous-batching generation for a Hugging Face causal LM
on lmfuse's paged KV cache and decode kernels."""

from __future__ import annotations

import math
import numbers
import random
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from .._collectives import all_gather_stacked, check_group, group_size
from .._dispatch import IMPLS, check_choice, check_int, check_number
from .._launch import DTYPE_NAMES, KERNEL_DTYPES, dtype_name, dtype_named
from ..attention.kv_cache import KVCacheFullError, PagedKVCache
from .attention import ATTENTION_NAME, paged_attention
from .request import OP, Request, SamplingParams, Status
from .fused import replaced_modules
from .runner import ModelRunner, bus_copies, bus_copy
from .sharded import BatchShards, ContextShards
from .sampling import sample
from .scheduler import Scheduler

#: ``config.model_type`` values the Generator takes.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma",
                                          "gemma2", "gemma3_text", "gpt_oss", "mixtral",
                                          "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")
#: The KV cache dtypes the Generator takes (by any of their names in ``DTYPE_NAMES``).
_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
#: ``decode_path`` values: fused decode layers where the family has them, else the
#: model's forward ("auto"); always the fused layers (an error where they cannot run); the
#: model's own forward ("model").
DECODE_PATHS = ("auto", "fused", "model")
_FP8_MAX = 448.0
# Memory kept free on the GPU beside the block pool: activations of a prefill, graphs.
_GPU_RESERVE = 2 << 30


class Generator:
    """Generate with a loaded ``transformers`` causal LM on lmfuse's paged KV cache.

    Args:
        model: a causal LM of one of :data:`SUPPORTED_MODEL_TYPES` (Llama, Mistral, Qwen2,
            Qwen3, Gemma, Gemma2, Gemma3 text, GPT-OSS, and the mixture-of-experts
            Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE), used in place (no weight
            copy; its forward runs with lmfuse's attention during the Generator's steps
            only).
        block_len: tokens per cache block.
        num_blocks: blocks in the pool; default: ``memory_fraction`` of the free GPU memory
            (less 2 GiB for activations and graphs), or 4096 blocks on the CPU; over a
            split cache every rank passes the same or none does (then the smallest of the
            ranks' defaults), as it passes the same ``block_len``, ``max_batch``,
            ``max_prefill_tokens`` and ``kv_dtype``: one all-gather at construction checks
            them, and every rank raises ``ValueError`` when they differ.
        memory_fraction: share of the free GPU memory the pool may take.
        kv_dtype: the cache's dtype (default the model's; ``torch.float8_e4m3fn`` or
            ``"fp8"``: e4m3 with per-layer, per-KV-head scales taken from the first
            prefill's largest magnitudes; where the fused layers prefill, the prompt's own
            attention reads the e4m3 cache too, as the decode steps do).
        max_batch: most requests decoded together.
        cuda_graphs: capture the decode step per batch bucket, and the fused layers'
            prefills per size bucket (CUDA, not with ``impl="torch"``, whose checks read
            values on the host).
        kvdp_group, cp_group: split the KV cache by batch (each sequence on one rank) or by
            context (each sequence's round-robin blocks over the ranks) over a process group
            (``torchrun``, one Generator per rank, every rank given the same requests, in
            the same order; their unseeded requests draw the same seeds): see
            ``sharded.py``. ``num_blocks`` is then per rank; prefix sharing is off; the
            decode step runs the model's forward (CUDA graphs with the collectives inside
            on an NCCL group); ``kvdp_group`` needs the query heads to divide over the ranks,
            ``cp_group`` refuses models with sliding-window layers. One of the two.
        max_prefill_tokens: new tokens computed in one prefill step; a longer prompt is
            prefilled in chunks of that many, one a step, with a decode step of the running
            requests between two (over a split cache: whole, alone). While requests run,
            at most four prefill steps come in a row before they decode a step (the
            scheduler's ``max_prefill_streak``): arrivals never stall running requests.
        prefix_sharing: share the full blocks of identical prompt prefixes.
        decode_path: how decode steps run the model. ``"auto"`` (default): the fused
            decode layers (``fused.py``: a few launches per layer over the model's own
            weights; Llama, Mistral, Qwen2, Qwen3, single process) where they apply, else
            the model's forward with lmfuse's paged attention; ``"fused"``: the fused layers
            or a ``ValueError`` saying why not; ``"model"``: always the model's forward.
            The fused layers read the weights alone: a model whose modules carry forward
            hooks (other than transformers' own), are of other classes, or have a forward
            set on them takes the model's forward; this is decided when the Generator is
            made (a hook registered afterwards makes :meth:`generate` raise, saying so;
            requests added one by one are not checked again: make another Generator).
            Prefills run the fused layers where decode steps do, on the Triton path (a
            GPU, or Triton's interpreter), else the model's forward.
        impl: the kernels' path, as every lmfuse op (``"auto"``: Triton on CUDA).
    """

    def __init__(self, model: Any, *, block_len: int = 16, num_blocks: int | None = None,
                 memory_fraction: float = 0.9, kv_dtype: Any = None, max_batch: int = 256,
                 cuda_graphs: bool = True, kvdp_group: Any = None, cp_group: Any = None,
                 max_prefill_tokens: int = 8192, prefix_sharing: bool = True,
                 decode_path: str = "auto", impl: str = "auto") -> None:
        self._agreed = False  # (set when the ranks of a split cache have gathered)
        try:
            self._setup(model, block_len, num_blocks, memory_fraction, kv_dtype, max_batch,
                        cuda_graphs, kvdp_group, cp_group, max_prefill_tokens, prefix_sharing,
                        decode_path, impl)
        except (TypeError, ValueError):
            # A rank that refuses its arguments before the ranks' agreement still joins
            # its all-gather, so that the others raise too instead of waiting in it.
            if not self._agreed:
                _agree_failed(kvdp_group if kvdp_group is not None else cp_group)
            raise

    def _setup(self, model, block_len, num_blocks, memory_fraction, kv_dtype, max_batch,
               cuda_graphs, kvdp_group, cp_group, max_prefill_tokens, prefix_sharing,
               decode_path, impl) -> None:
        config = _check_model(model)
        block_len = check_int(OP, "block_len", block_len, minimum=1)
        max_batch = check_int(OP, "max_batch", max_batch, minimum=1)
        max_prefill_tokens = check_int(OP, "max_prefill_tokens", max_prefill_tokens, minimum=1)
        fraction = check_number(OP, "memory_fraction", memory_fraction, allow_none=False)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"{OP}: memory_fraction must be in (0, 1], got {memory_fraction}")
        check_choice(OP, "impl", impl, IMPLS)
        check_choice(OP, "decode_path", decode_path, DECODE_PATHS)
        for name, flag in (("cuda_graphs", cuda_graphs), ("prefix_sharing", prefix_sharing)):
            if not isinstance(flag, bool):
                raise TypeError(f"{OP}: {name} must be True or False, got "
                                f"{type(flag).__name__} {flag!r}")
        if kvdp_group is not None and cp_group is not None:
            raise ValueError(f"{OP}: pass kvdp_group or cp_group, not both")
        for name, group in (("kvdp_group", kvdp_group), ("cp_group", cp_group)):
            if group is not None:
                _check_initialised(name)
                check_group(OP, name, group)
        if cp_group is not None:
            _check_cp(model, config, cp_group)
            prefix_sharing = False
        if kvdp_group is not None:
            _check_initialised("kvdp_group")
            if config.num_attention_heads % group_size(kvdp_group):
                raise ValueError(f"{OP}: kvdp_group of {group_size(kvdp_group)} ranks needs the "
                                 f"query heads ({config.num_attention_heads}) to divide over "
                                 "them")
            prefix_sharing = False
        param = next(model.parameters())
        self.model, self.config = model, config
        self.device = param.device
        self.model_dtype = param.dtype
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None)
                            or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        self.kv_dtype = _kv_dtype(kv_dtype, self.model_dtype)
        self.block_len = block_len
        group = kvdp_group if kvdp_group is not None else cp_group
        #: Over a split cache, where unseeded requests take their seeds from (the same on
        #: every rank: the ranks must sample the same tokens); None: a fresh seed each.
        self._seeds: random.Random | None = None
        if group is not None:  # every rank's scheduler counts the same pool
            self._agreed = True
            num_blocks, seed = _agree(group, self.device, num_blocks, fraction, self,
                                      block_len=block_len, max_batch=max_batch,
                                      max_prefill_tokens=max_prefill_tokens,
                                      kv_dtype=self.kv_dtype)
            self._seeds = random.Random(seed)
        elif num_blocks is None:
            num_blocks = self._default_blocks(fraction)
        num_blocks = check_int(OP, "num_blocks", num_blocks, minimum=1)
        # (an fp8 cache's scales: ones, a tensor each, calibrated by the first prefill)
        try:
            self.cache = PagedKVCache(num_blocks, block_len, self.kv_heads, self.head_dim,
                                      self.kv_dtype, self.device, num_layers=self.num_layers)
        except (RuntimeError, MemoryError) as exc:  # (torch.OutOfMemoryError among them)
            need = num_blocks * block_len * self.bytes_per_token
            raise ValueError(f"{OP}: a pool of num_blocks={num_blocks} blocks of "
                             f"block_len={block_len} tokens needs {need / 2**30:.3g} GiB "
                             f"({self.bytes_per_token} bytes a token) on {self.device}, "
                             f"which could not be allocated ({type(exc).__name__}); pass "
                             "fewer blocks") from exc
        self._calibrate = self.kv_dtype == torch.float8_e4m3fn
        self.shards = None if cp_group is None else ContextShards(cp_group, self.cache)
        batch_shards = None if kvdp_group is None else BatchShards(kvdp_group, self.cache)
        # What the scheduler counts: the pool itself; with a CP-split cache a virtual pool
        # of N-block-long blocks; with a batch-split one every rank's pool (sharded.py).
        self._pool = (self.shards.virtual_cache() if self.shards is not None
                      else batch_shards if batch_shards is not None else self.cache)
        self.scheduler = Scheduler(self._pool, max_batch=max_batch,
                                   max_prefill_tokens=max_prefill_tokens,
                                   prefix_sharing=prefix_sharing,
                                   max_blocks=self._pool.num_blocks,
                                   chunk_prefill=cp_group is None and kvdp_group is None)
        self.runner = ModelRunner(model, self.cache, impl=impl, cuda_graphs=cuda_graphs,
                                  max_batch=max_batch, shards=self.shards,
                                  batch_shards=batch_shards, scheduled=self._pool,
                                  decode_path=decode_path)
        self._requests: dict[int, Request] = {}
        self._next_rid = 0
        self._steps = {"prefill": 0, "decode": 0}
        self._closed = False
        self._inflight: _Inflight | None = None  # a decode step launched, not yet read
        #: Greedy decode steps run one ahead (see :meth:`step`); False: each step is read
        #: before the next is prepared (for hooks that inspect every step's logits).
        self.lookahead = True
        gen = getattr(model, "generation_config", None)
        self._default_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        self._default_penalty = getattr(gen, "repetition_penalty", None)
        _warn_unapplied(gen)

    # --- memory and state -------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token takes over all layers (K and V)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.kv_dtype.itemsize

    @staticmethod
    def kv_bytes_per_token(config: Any, kv_dtype: Any = torch.bfloat16) -> int:
        """:attr:`bytes_per_token` from a model config, before any Generator exists."""
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        dim = int(getattr(config, "head_dim", None)
                  or config.hidden_size // config.num_attention_heads)
        return 2 * int(config.num_hidden_layers) * heads * dim * _kv_dtype_named(
            kv_dtype).itemsize

    @property
    def stats(self) -> dict[str, Any]:
        """Counters since construction: steps of each kind, preemptions, prompt tokens
        taken from shared blocks, CUDA graphs captured (decode steps and prefills; the
        prefills' alone in ``prefill_graphs``) and failed captures."""
        return {"prefill_steps": self._steps["prefill"], "decode_steps": self._steps["decode"],
                "preemptions": self.scheduler.preemptions,
                "shared_prompt_tokens": self.scheduler.shared_tokens,
                "cuda_graphs": len(self.runner._graphs),
                "prefill_graphs": sum(k[0] == "prefill" for k in self.runner._graphs),
                "graph_failures": self.runner.graph_failures,
                "free_blocks": self.cache.num_free_blocks, "num_blocks": self.cache.num_blocks}

    def close(self) -> None:
        """Drop every request, the captured graphs and the block pool (their memory goes back
        to PyTorch's allocator); the Generator cannot be used afterwards."""
        if self._inflight is not None:
            self._inflight.read()
            self._inflight = None
        for rid in list(self._requests):
            self.abort(rid)
        self.runner._graphs.clear()
        self.runner._pool = None
        self.runner._logits_buf = None
        self.cache.k_caches.clear()
        self.cache.v_caches.clear()
        self._closed = True

    def _default_blocks(self, fraction: float) -> int:
        per_block = self.bytes_per_token * self.block_len
        if self.device.type != "cuda":
            return 4096
        free, _ = torch.cuda.mem_get_info(self.device)
        blocks = int((free * fraction - _GPU_RESERVE) // per_block)
        if blocks < 1:
            raise ValueError(f"{OP}: no GPU memory left for the KV cache ({free / 2**30:.1f} "
                             f"GiB free); pass num_blocks or free memory")
        return blocks

    @property
    def capacity_tokens(self) -> int:
        """The token rows the pool holds: a request of up to one token more (prompt + new
        tokens; its last token is never fed, so it takes no row) fits in it."""
        return self._pool.num_blocks * self._pool.block_len

    # --- requests -------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int,
                    temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, eos_token_id: Any = None,
                    seed: int | None = None, repetition_penalty: float | None = None) -> int:
        """Queue ``prompt`` (token ids); its request id. Nothing changes on bad input.
        Options as :meth:`generate`'s."""
        if self._closed:
            raise RuntimeError(f"{OP}: this Generator was closed")
        tokens = self._check_prompt(prompt, "prompt")
        params = self._sampling(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed,
                                repetition_penalty=repetition_penalty)
        self._check_fits(len(tokens), params.max_new_tokens, "prompt")
        return self._enqueue(tokens, params)

    def _sampling(self, *, eos_token_id: Any, repetition_penalty: Any,
                  **options: Any) -> SamplingParams:
        """Checked options; ``eos_token_id=None`` and ``repetition_penalty=None``: the
        model's ``generation_config``'s, whose errors say where the value came from."""
        defaulted = []
        if options.get("seed") is None and self._seeds is not None:
            # (every rank of a split cache draws the same: see _agree)
            options["seed"] = self._seeds.getrandbits(63)
        if eos_token_id is None:
            eos_token_id = self._default_eos
            defaulted.append("eos_token_id")
        if repetition_penalty is None:
            repetition_penalty = 1.0 if self._default_penalty is None else self._default_penalty
            defaulted.append("repetition_penalty")
        try:
            return SamplingParams.make(eos_token_id=eos_token_id,
                                       repetition_penalty=repetition_penalty,
                                       vocab_size=self.vocab_size, **options)
        except (TypeError, ValueError) as exc:
            name = next((n for n in defaulted if n in str(exc)), None)
            if name is None:
                raise
            raise type(exc)(f"{exc} (the model's generation_config.{name}, used when none is "
                            f"given; pass {name}= to override it)") from None

    def _enqueue(self, tokens: list[int], params: SamplingParams) -> int:
        rid = self._next_rid
        self._next_rid += 1
        self._requests[rid] = req = Request(rid, tokens, params)
        self.scheduler.add(req)
        return rid

    def _check_prompt(self, prompt: Any, name: str) -> list[int]:
        if not isinstance(prompt, torch.Tensor) and hasattr(prompt, "__array__"):
            prompt = torch.as_tensor(prompt)  # a NumPy array of ids (a tokenizer's "np")
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point:
                raise TypeError(f"{OP}: {name} must be a 1-D sequence of token ids, got a "
                                f"{prompt.dim()}-D {prompt.dtype} tensor")
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"{OP}: {name} must be a list of token ids (ints), got "
                            f"{type(prompt).__name__}")
        tokens = list(prompt)
        for i, t in enumerate(tokens):
            if type(t) is not int:
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(f"{OP}: {name} must hold ints (token ids), got "
                                    f"{type(t).__name__} {t!r}")
                tokens[i] = int(t)  # a NumPy integer
        if not tokens:
            raise ValueError(f"{OP}: {name} is empty; a prompt needs at least one token")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{OP}: {name} has token ids outside the vocabulary [0, "
                             f"{self.vocab_size}): {bad[:5]}")
        return tokens

    def _check_fits(self, prompt_len: int, max_new_tokens: int, name: str) -> None:
        # The last new token is never fed to the model: a request takes the positions and
        # cache rows of its prompt and all but one of its new tokens, as model.generate's.
        rows = prompt_len + max_new_tokens - 1
        limit = getattr(self.config, "max_position_embeddings", None)
        if isinstance(limit, int) and rows > limit:
            raise ValueError(f"{OP}: {name} of {prompt_len} tokens plus max_new_tokens="
                             f"{max_new_tokens} passes the model's max_position_embeddings "
                             f"({limit})")
        short = _longrope_limit(self.config)
        if short is not None and rows > short:
            raise ValueError(
                f"{OP}: {name} of {prompt_len} tokens plus max_new_tokens={max_new_tokens} "
                f"passes the longrope rotary's original_max_position_embeddings ({short}): "
                "past it transformers rotates a whole forward with the long factors, chosen "
                "by the longest sequence in it, so a request's tokens would depend on the "
                "requests batched with it; the Generator serves longrope models up to that "
                "length")
        need = math.ceil(rows / self._pool.block_len)
        if need > self._pool.num_blocks:
            raise ValueError(
                f"{OP}: {name} of {prompt_len} tokens plus max_new_tokens={max_new_tokens} "
                f"needs {need} blocks of {self._pool.block_len} tokens, more than the pool's "
                f"{self._pool.num_blocks} ({self.capacity_tokens} tokens): it could never "
                f"run; shorten it or give the Generator more blocks")

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished()

    def abort(self, rid: int) -> None:
        """Drop request ``rid`` (its blocks freed); unknown or finished ids are ignored."""
        req = self._requests.pop(rid, None)
        if req is not None and req.status != Status.FINISHED:
            self.scheduler.abort(req)
            if self.shards is not None:
                self.shards.sync(set(self._pool.sequences))
            if self._inflight is not None:  # a step run ahead for aborted requests only:
                self._inflight.drop_finished()  # nothing is left to read from it
                if not self._inflight.live:
                    self._inflight = None

    # --- steps ----------------------------------------------------------------------------

    def step(self) -> list[tuple[int, list[int], bool]]:
        """Run one prefill or decode step: ``[(request id, new token ids, finished)]`` for
        every request that advanced (finished ones are then forgotten; none for a long
        prompt's chunk before its last).

        Greedy decode steps run ahead (``lookahead``): a step's tokens stay on the device
        while the next step (fed those tokens there) is prepared and launched, and are read
        after; the next call returns that step's tokens. A request that finishes on an
        end-of-sequence token has then been computed one step too far; that token is
        dropped. The tokens returned are the same as without lookahead."""
        if self._closed:
            raise RuntimeError(f"{OP}: this Generator was closed")
        try:
            return self._step()
        except BaseException:
            self._recompute_all()
            raise

    def _recompute_all(self) -> None:
        """After a step that raised (an error, Ctrl-C, out of memory): the cache holds
        rows reserved for that step and never written, or written for tokens never read,
        so every running request goes back to the front of the queue with its blocks freed,
        to be computed again from its tokens (prompt and the new tokens returned so far) at
        its next admission; what it generates next is what it would have. A step run ahead
        is dropped unread."""
        self._inflight = None
        self.runner.take_greedy()  # (a step's argmax, if its graph ran: not this one's)
        self.scheduler.requeue_all()
        self._requests = {rid: r for rid, r in self._requests.items()
                          if r.status != Status.FINISHED}
        if self.shards is not None:
            self.shards.sync(set(self._pool.sequences))

    def _step(self) -> list[tuple[int, list[int], bool]]:
        if self._inflight is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            self._steps[batch.kind] += 1
            if batch.kind == "decode" and self._chainable(batch.requests):
                tokens = self.runner.decode_ahead(batch.requests, batch.step)
                if tokens is not None:
                    self._inflight = _Inflight.launch(batch.requests, tokens)
            if self._inflight is None:
                return self._run(batch)
        current = self._inflight
        self._inflight = self._chain(current)  # the next step starts before this one is read
        out = self._finish(current.requests, current.read())
        if self._inflight is not None:  # requests that just finished have no next token
            self._inflight.drop_finished()
            if not self._inflight.live:
                self._inflight = None  # (unread: see _Inflight.__del__)
        return out

    def _run(self, batch: Any) -> list[tuple[int, list[int], bool]]:
        reqs = batch.requests
        if batch.kind == "prefill":
            if self._calibrate:
                self._calibrate_fp8(reqs, batch.new)
            logits = self.runner.prefill(reqs, batch.new)
            if batch.partial:  # a long prompt's chunk before its last: no token yet
                self.runner.take_greedy()
                reqs[0].num_cached += len(batch.new[0])
                return []
        else:
            logits = self.runner.decode(reqs, batch.step)
        argmax = self.runner.take_greedy()
        if argmax is not None and all(r.params.plain_greedy for r in reqs):
            tokens = argmax  # computed in the decode step's graph
        else:
            # (a penalised request's tokens so far; no list built for the others)
            tokens = sample(logits, [r.params for r in reqs], [len(r.output) for r in reqs],
                            [r.tokens if r.params.repetition_penalty != 1.0 else None
                             for r in reqs])
        # The step's one host synchronisation.
        return self._finish(reqs, tokens.tolist(), prefill=batch.kind == "prefill")

    def _finish(self, reqs: list[Request], tokens: list[int],
                prefill: bool = False) -> list[tuple[int, list[int], bool]]:
        out = []
        for req, tok in zip(reqs, tokens):
            if req.status != Status.RUNNING:  # aborted while its step ran ahead
                continue
            req.num_cached = req.length
            if prefill:
                self.scheduler.register_prefix(req)
            done = req.append(int(tok))
            out.append((req.rid, [int(tok)], done))
            if done:
                self.scheduler.finish(req)
                self._requests.pop(req.rid, None)
        if self.shards is not None:  # this rank's blocks of the requests that left
            self.shards.sync(set(self._pool.sequences))
        return out

    def _chainable(self, reqs: list[Request]) -> bool:
        """Whether a decode step of ``reqs`` may run ahead: greedy requests, lookahead on."""
        return self.lookahead and all(r.params.plain_greedy for r in reqs)

    def _chain(self, current: _Inflight) -> _Inflight | None:
        """Launch the decode step after ``current`` (not yet read) when nothing else can
        come first: no request waits to be admitted, every request of ``current`` runs on
        (none reaches its ``max_new_tokens`` there, none was aborted) and the pool has the
        next token's blocks (else the next call schedules, and preempts, as usual)."""
        reqs = current.requests
        if (self.scheduler.waiting or self.scheduler.prefilling is not None
                or not self._chainable(reqs)
                or any(r.status != Status.RUNNING
                       or len(r.output) + 1 >= r.params.max_new_tokens for r in reqs)
                or reqs != self.scheduler.running):
            return None
        width = self.scheduler.width(ahead=1)
        # Straight into the decode graph's input buffer where one will replay the step.
        out = self.runner.step_buffer(len(reqs), width)
        kw = {} if out is None else {"out": out}
        try:
            step = self._pool.reserve([r.seq_id for r in reqs], 1, max_blocks=width, **kw)
        except KVCacheFullError:
            return None
        tokens = self.runner.decode_ahead(reqs, step, ids=current.tokens)
        self._steps["decode"] += 1
        return _Inflight.launch(list(reqs), tokens, keep=out)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: Any = None,
                 seed: int | None = None,
                 repetition_penalty: float | None = None) -> list[list[int]]:
        """Continue every prompt (lists of token ids of any lengths): each prompt's new
        tokens, ending with ``eos_token_id`` (included; default the model's
        ``generation_config``; ``[]``: none) or after ``max_new_tokens``. Greedy at
        ``temperature == 0``; with a ``seed`` the draws repeat from run to run (request
        ``i`` uses ``seed + i``; no seed: a random one). Sampling follows Hugging Face's
        order (penalty, temperature, top-k, top-p) with what is passed here only:
        ``top_k=None`` (or 0, as in Hugging Face's generation config) samples the whole
        vocabulary (``model.generate`` fills in ``top_k=50``), and the model's
        ``generation_config`` sampling settings (``do_sample``, ``temperature``, ``top_k``,
        ``top_p``) are not read.
        ``repetition_penalty`` (default the model's ``generation_config``'s, else none):
        Hugging Face's, on the tokens of the prompt and the output (:class:`SamplingParams`);
        a request with one takes its steps' logits to the host's sampler (no greedy step
        run ahead)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"{OP}: prompts must be a list of token-id lists, got "
                            f"{type(prompts).__name__}")
        if self.has_unfinished():
            raise RuntimeError(f"{OP}: generate() needs an idle Generator; finish or abort "
                               "the requests added with add_request first")
        if self.runner.decode_path == "fused":
            # (looked for once a generate() call: the request-level API does not pay for it)
            changed = replaced_modules(self.model)
            if changed is not None:
                raise ValueError(f"{OP}: the model changed since this Generator chose its fused "
                                 f"decode layers ({changed}): they would skip it; make a new "
                                 "Generator, which takes the model's forward")
        checked = [self._check_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        params = self._sampling(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed,
                                repetition_penalty=repetition_penalty)
        for i, p in enumerate(checked):
            self._check_fits(len(p), params.max_new_tokens, f"prompts[{i}]")
        rids = [self._enqueue(p, replace(params, seed=(params.seed + i) % (1 << 63)))
                for i, p in enumerate(checked)]
        results: dict[int, list[int]] = {rid: [] for rid in rids}
        try:
            while self.has_unfinished():
                for rid, toks, _ in self.step():
                    results[rid].extend(toks)
        except BaseException:
            # Its own requests leave with the error (the caller never saw their ids), so
            # the Generator stays usable; a step run ahead is dropped unread.
            self._inflight = None
            for rid in rids:
                if rid in self._requests:
                    self.abort(rid)
            raise
        return [results[rid] for rid in rids]

    # --- fp8 scales -----------------------------------------------------------------------

    def _calibrate_fp8(self, reqs: list[Request], new: list[list[int]]) -> None:
        """Per-layer, per-KV-head scales for an fp8 cache from the first prefill: each
        head's largest |K| and |V| over those tokens, with 2x headroom, mapped to e4m3's
        448. Taken once, before anything is stored."""
        from transformers import AttentionInterface

        self._calibrate = False
        amax: dict[str, list[torch.Tensor]] = {"k": [], "v": []}

        def probe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
            amax["k"].append(key.detach().abs().amax(dim=(0, 2, 3)).float())
            amax["v"].append(value.detach().abs().amax(dim=(0, 2, 3)).float())
            return paged_attention(module, query, key, value, *args, **kwargs)

        # One extra forward of the first prefill: it writes with the default scales, and the
        # step's real prefill then overwrites the same rows with the calibrated ones.
        AttentionInterface.register(ATTENTION_NAME, probe)
        try:
            self.runner.prefill(reqs, new, model=True)  # the probe sees the model's K/V
        finally:
            AttentionInterface.register(ATTENTION_NAME, paged_attention)
        for scales, tops in ((self.cache.k_scales, amax["k"]), (self.cache.v_scales, amax["v"])):
            for scale, top in zip(scales, tops):  # (one per layer)
                scale.copy_(torch.where(top > 0, top * 2.0 / _FP8_MAX, torch.ones_like(top)))


class _Inflight:
    """A greedy decode step launched and not yet read: its requests (the batch's rows) and
    its argmax tokens on the device, copied to pinned host memory behind an event (on the
    compute queue where :func:`bus_copies`). ``keep``: host memory the step reads on the
    GPU (its pinned input buffer), held until the step is read. A step dropped unread (its
    requests all finished) waits for its event when it is collected: its pinned buffers are
    unknown to PyTorch's pinned allocator, which would hand them out again at once."""

    def __init__(self, requests: list[Request], tokens: torch.Tensor, keep: Any = None) -> None:
        self.requests, self.tokens, self.keep = requests, tokens, keep
        self.host: torch.Tensor | None = None
        self.event: Any = None
        self.live = True  # some row's request still runs
        self.read_done = False

    @classmethod
    def launch(cls, requests: list[Request], tokens: torch.Tensor,
               keep: Any = None) -> _Inflight:
        step = cls(requests, tokens, keep)
        if tokens.is_cuda:
            step.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            if bus_copies(tokens.device) and tokens.is_contiguous():
                bus_copy(step.host, tokens)
            else:
                step.host.copy_(tokens, non_blocking=True)
            step.event = torch.cuda.Event()
            step.event.record(torch.cuda.current_stream(tokens.device))
        return step

    def read(self) -> list[int]:
        if self.event is None:
            return self.tokens.tolist()
        self.event.synchronize()
        self.keep, self.read_done = None, True  # the GPU is done with it
        return self.host.tolist()

    def __del__(self) -> None:
        if self.event is not None and not self.read_done:
            try:
                self.event.synchronize()
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to protect
                pass

    def drop_finished(self) -> None:
        """Forget the rows whose requests are no longer running (their tokens are
        dropped by the step that reads them)."""
        self.live = any(r.status == Status.RUNNING for r in self.requests)


_AGREED_SETTINGS = 4  # block_len, max_batch, max_prefill_tokens, kv_dtype (_agree's)


def _agree_failed(group: Any) -> None:
    """A rank's part in :func:`_agree`'s all-gather when it refused its own arguments before
    it: the other ranks see its failure and raise as well. Nothing for a group that is not
    a usable ProcessGroup (then no rank can have reached the all-gather with it)."""
    import torch.distributed as dist

    if group is None or not isinstance(group, dist.ProcessGroup) or not dist.is_initialized():
        return
    nccl = "nccl" in str(dist.get_backend(group))
    on = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    row = torch.tensor([1, -1, -1, 0] + [0] * _AGREED_SETTINGS, dtype=torch.int64, device=on)
    all_gather_stacked(row, group)


def _agree(group: Any, device: torch.device, num_blocks: Any, fraction: float, gen: Any,
           **settings: Any) -> tuple[int, int]:
    """``(num_blocks, seed)`` the same on every rank of a split cache's ``group``, from one
    all-gather: the ranks' schedulers must count the same pool and take the same steps, so
    ``settings`` (what the schedule depends on) and an explicit ``num_blocks`` must agree,
    or every rank raises ``ValueError`` (not one rank, leaving the others in a collective);
    without ``num_blocks`` the smallest of the ranks' defaults (each GPU's own free memory).
    ``seed``: rank 0's random draw, the root of the unseeded requests' seeds."""
    import torch.distributed as dist

    codes = {"kv_dtype": lambda d: list(DTYPE_NAMES.values()).index(d)
             if d in DTYPE_NAMES.values() else -1}
    error: Exception | None = None
    given, default = -1, -1
    try:
        if num_blocks is None:
            default = check_int(OP, "num_blocks", gen._default_blocks(fraction), minimum=1)
        else:
            given = check_int(OP, "num_blocks", num_blocks, minimum=1)
    except (TypeError, ValueError) as exc:
        error = exc
    row = [0 if error is None else 1, given, default, secrets.randbits(62)]
    row += [codes.get(k, int)(v) for k, v in settings.items()]
    on = device if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
    every = all_gather_stacked(torch.tensor(row, dtype=torch.int64, device=on), group).tolist()
    if error is not None:
        raise error
    failed = [r for r, e in enumerate(every) if e[0]]
    if failed:
        raise ValueError(f"{OP}: rank(s) {failed} of the split cache's group refused their "
                         "arguments (see their error)")
    names = list(settings)
    assert len(names) == _AGREED_SETTINGS
    dtypes = list(DTYPE_NAMES.values())
    for i, name in enumerate(names):
        values = [e[4 + i] for e in every]
        if name == "kv_dtype":
            values = [dtype_name(dtypes[v]) if 0 <= v < len(dtypes) else "another dtype"
                      for v in values]
        if len(set(values)) > 1:
            raise ValueError(f"{OP}: every rank of a split cache must pass the same {name} "
                             f"(the ranks' schedules must agree); got "
                             f"{', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}")
    givens = [e[1] for e in every]
    if len(set(givens)) > 1:
        shown = ", ".join(f"rank {r}: {'none' if g < 0 else g}" for r, g in enumerate(givens))
        raise ValueError(f"{OP}: every rank of a split cache must pass the same num_blocks, or "
                         f"none does (the ranks' schedulers count one pool); got {shown}")
    blocks = givens[0] if givens[0] > 0 else min(e[2] for e in every)
    return blocks, every[0][3]


#: ``generation_config`` fields whose non-default values change Hugging Face's greedy
#: tokens and that the Generator does not apply (its ``repetition_penalty`` it does), with
#: the values that leave the tokens alone.
_UNAPPLIED = {"no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,),
              "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
              "min_length": (None, 0), "min_new_tokens": (None, 0),
              "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
              "sequence_bias": (None,), "exponential_decay_length_penalty": (None,),
              "num_beams": (None, 1), "penalty_alpha": (None,), "dola_layers": (None,)}


def _warn_unapplied(gen: Any) -> None:
    """A ``UserWarning`` naming the model's ``generation_config`` settings the Generator
    does not apply, which ``model.generate`` would (its tokens then differ)."""
    if gen is None:
        return
    found = [f"{name}={getattr(gen, name)!r}" for name, neutral in _UNAPPLIED.items()
             if getattr(gen, name, None) not in neutral]
    if found:
        warnings.warn(f"{OP}: the model's generation_config sets {', '.join(found)}, which "
                      "the Generator does not apply (model.generate would): its tokens may "
                      "differ from model.generate's", UserWarning, stacklevel=3)


def _check_model(model: Any) -> Any:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, torch.nn.Module) or model_type is None:
        raise TypeError(f"{OP}: model must be a loaded transformers causal LM, got "
                        f"{type(model).__name__}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{OP}: model type {model_type!r} ({type(model).__name__}) is not "
                         f"supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    head = getattr(model, "get_output_embeddings", None)
    if head is None or head() is None or not any(True for _ in model.parameters()):
        raise ValueError(f"{OP}: {type(model).__name__} is not a causal LM (no output "
                         "embeddings); load it with AutoModelForCausalLM")
    if getattr(config, "use_bidirectional_attention", False) is True:
        # (EmbeddingGemma-style checkpoints: their prompts attend both ways, which the
        # Generator's causal prefill would silently change.)
        raise ValueError(f"{OP}: {type(model).__name__}'s config sets "
                         "use_bidirectional_attention=True; the Generator decodes causal "
                         "language models only")
    return config


def _longrope_limit(config: Any) -> int | None:
    """The smallest ``original_max_position_embeddings`` of the config's longrope rotaries
    (None: none is longrope). transformers picks a longrope rotary's short or long factors
    by the largest position of a whole forward, so within this length every sequence, alone
    or batched, gets the short ones, as ``model.generate`` gives it alone."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return None
    # One dict, or one per layer type (Gemma 3: {"full_attention": {...}, ...}).
    groups = (list(params.values()) if all(isinstance(v, dict) for v in params.values())
              else [params])
    limits = []
    for p in groups:
        if p.get("rope_type", p.get("type")) == "longrope":
            limit = (p.get("original_max_position_embeddings")
                     or getattr(config, "original_max_position_embeddings", None))
            if isinstance(limit, int):
                limits.append(limit)
    return min(limits) if limits else None


def _check_initialised(name: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{OP}: {name} needs torch.distributed initialised "
                         "(init_process_group) on every rank")


def _check_cp(model: Any, config: Any, cp_group: Any) -> None:
    _check_initialised("cp_group")
    windows = {getattr(m, "sliding_window", None) for m in model.modules()
               if hasattr(m, "layer_idx")}
    if config.model_type == "mistral":
        windows.add(getattr(config, "sliding_window", None))
    windows.discard(None)
    if windows:
        raise ValueError(f"{OP}: {type(model).__name__} has sliding-window attention layers "
                         f"(window {sorted(windows)}); they cannot run context-parallel "
                         "(a window's keys have no fixed place in round-robin shards)")


def _kv_dtype(kv_dtype: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype: the model's (``None``) or ``float8_e4m3fn``; a dtype the model's
    K/V are not in is refused here, not by the first step's attention."""
    if model_dtype not in KERNEL_DTYPES:
        raise TypeError(f"{OP}: the model's dtype must be float32, float16 or bfloat16 "
                        f"(model.to(...)), got {dtype_name(model_dtype)}")
    if kv_dtype is None:
        return model_dtype
    checked = _kv_dtype_named(kv_dtype)
    if checked not in (model_dtype, torch.float8_e4m3fn):
        raise ValueError(f"{OP}: kv_dtype must be the model's dtype "
                         f"({dtype_name(model_dtype)}) or fp8 (float8_e4m3fn), got "
                         f"{dtype_name(checked)}")
    return checked


def _kv_dtype_named(kv_dtype: Any) -> torch.dtype:
    if isinstance(kv_dtype, str):
        named = dtype_named(kv_dtype)
        if named not in _KV_DTYPES:
            names = sorted(n for n, d in DTYPE_NAMES.items() if d in _KV_DTYPES)
            raise ValueError(f"{OP}: kv_dtype must be one of {names} or a torch dtype, got "
                             f"{kv_dtype!r}")
        return named
    if kv_dtype not in _KV_DTYPES:
        raise TypeError(f"{OP}: kv_dtype must be float32, float16, bfloat16 or "
                        f"float8_e4m3fn, got {kv_dtype!r}")
    return kv_dtype
