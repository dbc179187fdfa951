"""``lmfuse.serving.Generator`` with its KV cache split over NCCL ranks: ``kvdp_group`` (by
batch) and ``cp_group`` (by context) must give, on every rank, the tokens of one GPU's
Generator (and of ``model.generate``), on 2 or 4 GPUs, one a rank (``cuda:LOCAL_RANK``)::

    torchrun --nproc_per_node 2 tests/gpu/generator_nccl.py --out generator2.json

Dry run on the CPU (gloo ranks, Triton interpreter)::

    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 tests/gpu/generator_nccl.py \\
        --backend gloo --device cpu

(The script sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` before it imports torch.)

Every rank builds the same tiny random-weight model of each family (``tests/helpers.py``'s
``tiny_causal_lm``: float32, so that every path computes the same argmax; TF32 off) on its
GPU, and computes there the single-GPU answers: ``model.generate``'s greedy tokens and a
Generator's without a group (its CUDA graphs on). Then the sharded Generator (its decode
steps in CUDA graphs with the collectives captured; eagerly in the "eager" cases) generates the
same prompts (lengths 1 to 40, 12 new tokens, no end-of-sequence stop) and every rank's
tokens must equal both. Cases: each family on both kernel paths, batch-split (``kvdp``;
sliding windows, Gemma 2's soft-caps, GPT-OSS's sinks and experts included) and, for the
families without sliding-window layers, context-split (``cp``); pools so small that requests
are preempted; seeded sampling (the same draws as one GPU's). Collectives: all-gathers only
(the query/output exchange of KVDP, the partials of CP). Cases run in lockstep through
``sharded_decode_nccl.py``'s ``Runner`` (a failure is reported, a hang aborts every rank).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")
_TESTS = Path(__file__).resolve().parents[1]
for _dir in (str(_TESTS), str(_TESTS / "distributed"), str(_TESTS / "gpu")):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)
sys.path.append(str(_TESTS.parent / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import tiny_causal_lm  # noqa: E402
from sharded_decode_nccl import Checks, Runner, _triton_version  # noqa: E402
from spawn import count_collectives  # noqa: E402

from lmfuse._dispatch import interpreter_active  # noqa: E402
from lmfuse.serving import Generator  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(20, 60)), [90, 2, 2, 2, 41],
           list(range(70, 87))]  # the tiny models' vocabulary: 97
NEW = 12
SLIDING = ("mistral", "gemma2", "gemma3_text", "gpt_oss")
FAMILIES = ("llama", "qwen3", "gemma", "mistral", "gemma2", "gpt_oss")
ALLOWED = {"all_gather_into_tensor", "all_gather_single", "all_gather"}


def hf_tokens(model: Any, prompt: list[int], new: int, device: torch.device) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class Case:
    """One family's model and its single-GPU answers, built once for the cases that use it."""

    def __init__(self, family: str, device: torch.device) -> None:
        self.model = tiny_causal_lm(family).to(device)
        self.hf = [hf_tokens(self.model, p, NEW, device) for p in PROMPTS]
        gen = Generator(self.model, block_len=4, num_blocks=128, impl="triton"
                        if device.type == "cuda" else "torch")
        self.one = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
        self.one_graphs = gen.stats["cuda_graphs"]
        self.sampled = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[],
                                    temperature=1.0, seed=3)
        gen.close()


def sharded_case(c: Checks, case: Case, split: str, impl: str, num_blocks: int,
                 sampled: bool, copies: int = 1, block_len: int = 4,
                 graphs: bool = True) -> None:
    """``copies``: the prompts that many times over in one call (each copy's tokens are the
    prompt's own), so that a rank's share of the work stays as large on more ranks.
    ``graphs``: the decode steps in CUDA graphs (their collectives captured; NCCL), else
    eager."""
    gen = Generator(case.model, block_len=block_len, num_blocks=num_blocks, impl=impl,
                    cuda_graphs=graphs, **{f"{split}_group": dist.group.WORLD})
    with count_collectives() as calls:
        got = gen.generate(PROMPTS * copies, max_new_tokens=NEW, eos_token_id=[])
    c.check("collectives", lambda: _true(bool(calls) and set(calls) <= ALLOWED,
                                         f"collectives {sorted(set(calls))}"))
    if graphs and impl != "torch" and case.model.device.type == "cuda" \
            and "nccl" in str(dist.get_backend()):
        c.check("CUDA graphs", lambda: _true(
            gen.stats["graph_failures"] == 0 and gen.stats["cuda_graphs"] > 0,
            f"{gen.stats['cuda_graphs']} graphs, failure: {gen.runner.graph_failure}"))

    def same(what: str, want: list[list[int]], have: list[list[int]]) -> None:
        def run() -> None:
            bad = [i for i, (a, b) in enumerate(zip(have, want)) if a != b]
            assert not bad, f"prompts {bad} differ: got {[have[i] for i in bad]}, want " \
                            f"{[want[i] for i in bad]}"
        c.check(what, run)

    same("single-GPU Generator", case.one * copies, got)
    same("model.generate", case.hf * copies, got)
    if num_blocks < 16:
        c.check("preempted", lambda: _true(gen.stats["preemptions"] > 0,
                                          f"no preemption with {num_blocks} blocks a rank"))
    c.check("blocks freed", lambda: _true(gen.cache.num_free_blocks == num_blocks,
                                          f"{gen.cache.num_free_blocks} of {num_blocks} free"))
    if sampled:
        got = gen.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], temperature=1.0,
                           seed=3)
        same("seeded sampling", case.sampled, got)
    gen.close()


def _true(ok: bool, message: str) -> None:
    assert ok, message


def tokens_section(run: Runner, world: int, device: torch.device, families: list[str]) -> None:
    impls = ("triton", "torch")
    for family in families:
        case = Case(family, device)
        if run.rank == 0:
            print(f"  {family}: single-GPU Generator == model.generate: "
                  f"{case.one == case.hf}, graphs {case.one_graphs}", flush=True)
        for impl in impls:
            splits = ("kvdp",) if family in SLIDING else ("kvdp", "cp")
            for split in splits:
                run.case("tokens", f"{split} x{world} {family} {impl}",
                         lambda c, s=split, i=impl: sharded_case(c, case, s, i, 64,
                                                                 i == "triton"))
        if family == "llama":  # small pools: requests preempted on every rank
            # kvdp: 13 blocks hold the longest request (40 + 12 tokens); on 4 ranks a rank
            # would have too few requests to run out, so the prompts go twice. cp: the
            # scheduler counts blocks of world x block_len tokens, and keeps one of growth a
            # request (12 new tokens cross one 16-token block at most: never preempted), so
            # the blocks are 8 // world tokens: the same 8-token blocks on 2 and 4 ranks.
            copies = max(1, world // 2)
            run.case("tokens", f"kvdp x{world} llama preempted",
                     lambda c: sharded_case(c, case, "kvdp", "triton", 13, False, copies))
            run.case("tokens", f"cp x{world} llama preempted",
                     lambda c: sharded_case(c, case, "cp", "triton", 8, False,
                                            block_len=max(1, 8 // world)))
            for split in ("kvdp", "cp"):  # the eager steps (graphs off)
                run.case("tokens", f"{split} x{world} llama eager", lambda c, s=split:
                         sharded_case(c, case, s, "triton", 64, True, graphs=False))
        run.case("tokens", f"one GPU {family} (the oracle)", lambda c: c.check(
            "single-GPU Generator == model.generate",
            lambda: _true(case.one == case.hf, f"{case.one} != {case.hf}")))
        if device.type == "cuda":
            torch.cuda.empty_cache()


class GeneratorRunner(Runner):
    def summary(self, aborted: str | None = None) -> dict[str, Any]:
        return dict(super().summary(aborted), script="tests/gpu/generator_nccl.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write a JSON summary here (rank 0)")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a collective (and the per-case exchange) may wait")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
        if not interpreter_active():
            print("--device cpu runs the Triton path in the interpreter: set TRITON_INTERPRET=1",
                  file=sys.stderr)
            return 2
    timeout = datetime.timedelta(seconds=args.timeout)
    extra = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, timeout=timeout, **extra)
    status = dist.new_group(backend="gloo", timeout=timeout)
    run = GeneratorRunner(rank, world, status, args, device)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"Generator on {world} x {name}, backend {args.backend}, torch "
              f"{torch.__version__}, triton {_triton_version()}", flush=True)
    run.section("tokens", lambda: tokens_section(run, world, device, families))
    failed = [r for r in run.results if r["status"] == "FAIL"]
    if rank == 0:
        print(f"{len(run.results) - len(failed)} of {len(run.results)} cases passed on "
              f"{world} ranks in {time.perf_counter() - run.start:.1f} s"
              + (f"; FAILED: {len(failed)}" if failed else ""), flush=True)
    run.write()
    dist.barrier(group=status)
    dist.destroy_process_group()
    return 1 if failed or not run.results else 0


if __name__ == "__main__":
    sys.exit(main())
