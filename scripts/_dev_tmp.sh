#!/usr/bin/env bash
# one short call: the staged D = 64 one-key forward against the default (with its checks)
L=$OUT/logs; mkdir -p $L
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt
timeout 300 python3 scripts/mma_fwd_probe.py --variants "PW_FWD_ONE_K_D64=1" \
  --tiles "64:128x64x4,128x128x4" --lengths 2048,8192 --dtypes bf16,fp16 --rounds 2 \
  --control --out $L/fwd_d64.txt > $L/fwd_d64.log 2>&1
echo "fwd_d64 rc=$?" >> $L/rc.txt
cd $OUT && tar czf logs.tgz logs && rm -rf logs
