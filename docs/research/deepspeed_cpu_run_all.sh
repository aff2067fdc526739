#!/bin/bash
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PATH=/tmp/ds-venv/bin:$PATH
rm -f /tmp/ds_results.jsonl
run() { name=$1; shift; s=$(date +%s); timeout 600 torchrun --nproc_per_node=2 /tmp/ds_check.py "$@" > /tmp/log_$name.txt 2>&1; echo "$name rc=$? secs=$(( $(date +%s)-s ))" >> /tmp/run_all.status; }
: > /tmp/run_all.status
run z1 --stage 1
run z1off --stage 1 --offload
run z2 --stage 2
run z2off --stage 2 --offload
run z3 --stage 3
run z3off --stage 3 --offload
run z3p0 --stage 3 --persist0
run z3p0off --stage 3 --persist0 --offload
echo DONE >> /tmp/run_all.status
