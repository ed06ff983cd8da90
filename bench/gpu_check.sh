#!/usr/bin/env bash
# The whole GPU check in one script, for a lent CUDA machine (run from the repository root; ~6 minutes on
# one H200; each part has its own time limit, the most important first, so a run cut short still brings back
# what matters most). Log and results: ${OUT:-bench/gpu_out}.
#   1. the CUDA tests: no host sync in the routed FFN's forward, grouped GEMM == per-expert loop, liger loss,
#      the model under autocast compiles to one graph (torch.compile fullgraph);
#   2. ffn in bf16 at 8 x 2048 tokens, eager and through torch.compile (rows grouped by route tuple);
#   3. training steps with MFU against the datasheet bf16 peak: the 300m target configuration (liger loss,
#      torch.compile) at micro-batch 32 x 2048, then 100m and 300m eager and 300m compiled at 8 x 2048;
#   4. ffn grouped by expert, dispatch, the loss backends' memory at 4k-32k tokens;
#   5. a short end-to-end training run (hardware=cuda) whose metrics.csv comes back;
#   6. the planner's memory estimate against the measured peaks of real steps (bench/plan_memory.py).
# Packages the machine lacks (hydra-core, omegaconf, liger-kernel, ...) are taken from PYTHONPATH.
set -uo pipefail
OUT=${OUT:-bench/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRMOE_RESULTS="$OUT/results.jsonl"
PY=${PYTHON:-python3}
step() { echo; echo "== $* ($(date +%T))"; }
{
  step machine
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  step tests
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_loss_backends.py tests/test_model.py
  step ffn
  timeout 60 $PY -m trmoe.bench ffn
  timeout 120 $PY -m trmoe.bench ffn --compile
  step "train step, the target: 300m, loss=liger, torch.compile, micro-batch 32"
  timeout 180 $PY -m trmoe.bench step --model 300m --steps 5 --batch 32 --compile loss=liger
  step "train steps, eager (loss=chunked), then 300m with torch.compile"
  timeout 120 $PY -m trmoe.bench step --model 100m 300m --steps 5
  timeout 150 $PY -m trmoe.bench step --model 300m --steps 5 --compile
  step "ffn grouped by expert, dispatch"
  timeout 60 $PY -m trmoe.bench ffn --strategy random
  timeout 45 $PY -m trmoe.bench dispatch
  step loss
  timeout 75 $PY -m trmoe.bench loss --tokens 4096 16384 32768 --kinds chunked liger torch full --max-gb 60
  step "end-to-end training run"
  TRMOE_RUN_DIR=/tmp/trmoe_gpu_run timeout 90 $PY -m trmoe.train model=tiny hardware=cuda loss=auto \
    trainer.steps=60 trainer.micro_batch=16 trainer.seq_len=512 trainer.eval_every=30 run.progress=log
  cp /tmp/trmoe_gpu_run/metrics.csv "$OUT/metrics.csv" 2>/dev/null
  step "the planner's memory estimate against measured peaks (docs/distributed.md)"
  timeout 120 $PY bench/plan_memory.py "model=100m trainer.micro_batch=8 trainer.seq_len=1024" \
    "model=300m trainer.micro_batch=8 trainer.seq_len=2048 optimizer=muon_tr" \
    "model=1b trainer.micro_batch=4 trainer.seq_len=2048"
  step done
} 2>&1 | tee "$OUT/gpu_check.log"
