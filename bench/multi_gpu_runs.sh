#!/usr/bin/env bash
# The multi-GPU runs on one host of N GPUs (2 or 4): benchmarks first, each alone on the GPUs,
# then the correctness and fault harnesses side by side. Every output lands in OUT_DIR:
#   decode_sharded.json  cross_entropy_tp.json  linear_cross_entropy_tp.json   (benchmarks)
#   generate_sharded.json                                                      (benchmark)
#   nccl_decode.json  vocab_parallel.json  faults.json  generator_nccl.json    (harnesses)
#   runs.log                                                                   (everything)
#
#   bench/multi_gpu_runs.sh N OUT_DIR [bench|check|all]
#
# NVLink multicast stays off (the shared hosts can be put out of service by it). Each step has
# its own time limit so that one hang cannot eat the others' time.
set -u
N=${1:?usage: bench/multi_gpu_runs.sh N OUT_DIR [bench|check|all]}
OUT_DIR=${2:?usage: bench/multi_gpu_runs.sh N OUT_DIR [bench|check|all]}
WHAT=${3:-all}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT_DIR/runs.log"
SIZES=$(seq -s, 2 "$N" | sed 's/,3//')  # 2, or 2,4

step() {  # step NAME SECONDS COMMAND...: run it, log it, note its exit code and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >>"$LOG"
  timeout -k 10 "$limit" "$@" >>"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  tail -n 60 "$OUT_DIR/$name.log" >>"$LOG"
  rm -f "$OUT_DIR/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
nvidia-smi topo -m >>"$LOG" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"nccl", torch.cuda.nccl.version())' >>"$LOG" 2>&1

if [ "$WHAT" != check ]; then
  step decode_sharded 300 torchrun --nproc_per_node "$N" bench/decode_sharded.py --sizes "$SIZES" \
    --shapes all --graphs --calibrate --json "$OUT_DIR/decode_sharded.json"
  step cross_entropy_tp 150 python3 bench/cross_entropy_tp.py --world "$N" \
    --json "$OUT_DIR/cross_entropy_tp.json"
  step linear_cross_entropy_tp 150 python3 bench/linear_cross_entropy_tp.py --world "$N" \
    --json "$OUT_DIR/linear_cross_entropy_tp.json"
  step generate_sharded 240 torchrun --nproc_per_node "$N" bench/generate_sharded.py \
    --batches 48,$((48 * N)) --json "$OUT_DIR/generate_sharded.json"
fi
if [ "$WHAT" != bench ]; then
  # Correctness only: the three share the GPUs (their ports differ: torchrun's --master-port).
  step nccl_decode 400 torchrun --nproc_per_node "$N" --master-port 29511 \
    tests/gpu/sharded_decode_nccl.py --out "$OUT_DIR/nccl_decode.json" &
  step vocab_parallel 400 torchrun --nproc_per_node "$N" --master-port 29512 \
    tests/gpu/vocab_parallel_nccl.py --out "$OUT_DIR/vocab_parallel.json" &
  step faults 400 python3 tests/gpu/faults_nccl.py --world "$N" --out "$OUT_DIR/faults.json" &
  step generator_nccl 300 torchrun --nproc_per_node "$N" --master-port 29513 \
    tests/gpu/generator_nccl.py --out "$OUT_DIR/generator_nccl.json" &
  wait
fi
grep '^=== .*exit' "$LOG"
