#!/bin/bash
export PYTHONPATH=$PWD/src
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)") > $OUT/versions.log 2>&1
LMFUSE_GPU_TESTS=1 timeout 240 python -m pytest -q tests/gpu/test_moe_gpu.py tests/gpu/test_generator_gpu.py -p no:cacheprovider > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
timeout 100 python bench/generate.py --no-mixed --peers "" --batches 1,16,64 --json $OUT/gen-after.json > $OUT/gen-after.log 2>&1
echo "gen rc=$?"; grep "^decode step" $OUT/gen-after.log | grep lmfuse
timeout 200 python gpurun/probe_swiglu.py > $OUT/probe_swiglu.log 2>&1
echo "probe rc=$?"; cat $OUT/probe_swiglu.log | tail -50
