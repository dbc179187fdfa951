#!/bin/bash
export PYTHONPATH=$PWD/src
timeout 400 python bench/sweep_decode_attention.py --cases "4 active" --warps 4,8 --block-n 32,64,128 --stages 2,3,4 --ppsm 1,2,4,8 --json $OUT/sweep_4active.json > $OUT/sweep_4active.log 2>&1
echo "rc=$?"; grep -v "^   {" $OUT/sweep_4active.log | tail -20
