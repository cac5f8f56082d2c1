#!/usr/bin/env bash
# Everything a session lent a GPU runs, in one call, under 9 minutes (the device time is 15 minutes a session, the
# machine's start included; this leaves room to rerun one piece):
#
#     bash benchmarks/gpu_session.sh "$OUT"               # on the GPU machine (torch, triton, safetensors, pytest)
#     bash benchmarks/gpu_session.sh "$OUT" cgc cdb       # a rerun of some steps only: tests, cgc, cdb (env always)
#
# A rerun after a fix lands on a fresh machine (a warm one goes back 30 s after a call), so it pays the start again:
# name only the steps that broke. CGC_ARGS and CDB_ARGS add flags to those steps (e.g. CDB_ARGS="--backends triton").
#
# 1. the machine: GPU, driver, torch, triton (env.txt)
# 2. the CUDA tests, which skip on CPU: FULL and PIECEWISE replays give eager's tokens, the KV sizing (pytest.log;
#    building the tiny models comes first)
# 3. the session-2 check: capture, FULL vs eager tokens, step times per mode, torch then triton (cgc.json, cgc.log)
# 4. the issue-13 device script: kernel bandwidth against the copy, arrivals x rule x K x backend x mode
#    (cdb.json, cdb.log); it writes partial JSON after every run, so a timeout still leaves results
# Each step has its own timeout and a failing step does not stop the next. Six files come back, within the tool's
# limit of eight.
set -u
OUT=${1:?usage: gpu_session.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
shift
STEPS=${*:-tests cgc cdb}
for s in $STEPS; do
  case $s in tests|cgc|cdb) ;; *) echo "gpu_session.sh: unknown step '$s' (steps: tests cgc cdb)" >&2; exit 2;; esac
done
want() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }

{ date; nvidia-smi; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, torch.cuda.get_device_name())"; } >"$OUT/env.txt" 2>&1
echo "== env: rc $?"
if want tests; then
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py >"$OUT/pytest.log" 2>&1
  echo "== cuda tests: rc $?"; tail -3 "$OUT/pytest.log"
fi
if want cgc; then
  # shellcheck disable=SC2086  # the extra flags are meant to split
  timeout 150 $PY benchmarks/cuda_graph_check.py --out "$OUT/cgc.json" ${CGC_ARGS:-} >"$OUT/cgc.log" 2>&1
  echo "== cuda_graph_check: rc $?"; tail -5 "$OUT/cgc.log"
fi
if want cdb; then
  # shellcheck disable=SC2086
  timeout 200 $PY benchmarks/cuda_decode_bench.py --time-limit 150 --out "$OUT/cdb.json" ${CDB_ARGS:-} \
    >"$OUT/cdb.log" 2>&1
  echo "== cuda_decode_bench: rc $?"; tail -25 "$OUT/cdb.log"
fi
