#!/usr/bin/env bash
# The GPU check in one call (about 6 minutes on an H200): round steps captured as CUDA graphs
# against eager for every method, the CUDA tests, and a forward-cost profile of the default
# model's shape. Installs nothing and downloads nothing (the machine's own torch).
#
#   OUT=/tmp/out bash graphs/device_check.sh                       # on a GPU machine
#   DEVICE=cpu BACKEND=compile QUICK=1 bash graphs/device_check.sh  # CPU dry run of the script
#   SECTIONS="inductor-profile tests inductor-checks" bash graphs/device_check.sh   # the second call
#
# Sections (SECTIONS, default "profile checks tests"): profile = forward costs of CUDA graphs of
# eager kernels; inductor-profile = a few of them with inductor's Triton kernels (slow to build);
# checks = round steps vs eager (aot_eager / uncompiled, every method; inductor for three);
# inductor-checks = inductor for every method (greedy; a process per method); tests = pytest -k cuda.
#
# Results: $OUT/profile_smollm2.json (+ .png) and $OUT/device_check.tgz (every log and check JSON);
# the table printed last says what passed.
set -u
OUT=${OUT:-/tmp/fastspec-device}
DEVICE=${DEVICE:-cuda}
BACKEND=${BACKEND:-cuda-graph}
PY=${PY:-python3}
WORK=$(mktemp -d)
mkdir -p "$OUT"
# A call killed at its limit still returns $OUT: the summary is written there line by line and
# the archive of logs is remade after every section.
ln -s "$OUT/summary.txt" "$WORK/summary.txt"
pack() { tar czf "$WORK/../pack_$BASHPID.tgz" -C "$WORK" --exclude shim --exclude summary.txt . 2>/dev/null && mv "$WORK/../pack_$BASHPID.tgz" "$OUT/device_check.tgz"; }
export PYTHONUNBUFFERED=1 FASTSPEC_INDUCTOR_MODE=${FASTSPEC_INDUCTOR_MODE:-default}

# fastspec without installing it: a package folder of links (fastspec.graphs, .cli and .evals
# live at the top level of the repository).
mkdir -p "$WORK/shim/fastspec"
for f in "$PWD"/fastspec/*; do ln -s "$f" "$WORK/shim/fastspec/"; done
for d in graphs cli evals; do ln -s "$PWD/$d" "$WORK/shim/fastspec/$d"; done
export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"
REPO=$PWD
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"   # a venv link stays a link
cd "$WORK"     # python -m puts the working directory first: the repository's fastspec/ lacks .graphs

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
          torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
  git -C "$PWD" log -1 --format='commit %h %s' 2>/dev/null; } > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"

if [ -n "${QUICK:-}" ]; then          # dry run: fewer, smaller steps
  P_BLOCKS=1,8; P_C=1,4; METHODS_A1=ar,linear; METHODS_A2=bastion; METHODS_A3=dflash
  LEVELS=1,4; SAMPLING=greedy; T_CHECK=600
else
  P_BLOCKS=1,4,8,16,32; P_C=1,4,16,64; METHODS_A1=ar,linear,recguide; METHODS_A2=d2sd,libraspec,bastion
  METHODS_A3=tidar,dflash; LEVELS=1,8; SAMPLING=greedy,filtered; T_CHECK=300
fi

SECTIONS=" ${SECTIONS:-profile checks tests} "
has() { [[ "$SECTIONS" == *" $1 "* ]]; }

# 1. The profile, alone on the device (timings): SmolLM2-135M's shape, random bf16 weights,
#    every step a CUDA graph of eager kernels (--compiler none: built in about a second).
t0=$(date +%s)
if has profile; then
  timeout -k 5 240 $PY -m fastspec.graphs.gpu_check --device "$DEVICE" --shape smollm2-135m --methods ar \
  --concurrency 1 --sampling greedy --new-tokens 16 --backend "$BACKEND" --compiler none \
  --profile-blocks "$P_BLOCKS" --profile-concurrency "$P_C" --context 512 \
  --out "$OUT/profile_smollm2.json" > "$WORK/profile.log" 2>&1
  echo "profile rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$WORK/summary.txt"
fi
if has inductor-profile; then
  t0=$(date +%s)
  timeout -k 5 "${T_IPROFILE:-150}" $PY -m fastspec.graphs.gpu_check --device "$DEVICE" --shape smollm2-135m --methods "" \
    --backend "$BACKEND" --profile-blocks 1,8 --profile-concurrency 1 --context 512 \
    --out "$OUT/profile_smollm2_inductor.json" > "$WORK/profile_inductor.log" 2>&1
  echo "inductor profile rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$WORK/summary.txt"
  cat "$WORK/profile_inductor.log" >> "$WORK/profile.log"
fi
pack

# 2. Round steps vs eager, in parallel processes (tracing is single-threaded host work): every
#    method under aot_eager (graph capture of the traced step), inductor's Triton kernels for
#    three methods, and uncompiled captures; plus the test suite's CUDA cases.
check() {
  local name=$1; shift
  local t=$(date +%s)
  OMP_NUM_THREADS=2 timeout -k 5 "$T_CHECK" $PY -m fastspec.graphs.gpu_check --device "$DEVICE" --tiny \
    --no-profile --backend "$BACKEND" --concurrency "$LEVELS" --sampling "$SAMPLING" "$@" \
    --out "$WORK/check_$name.json" > "$WORK/check_$name.log" 2>&1
  echo "check $name rc=$? ($(( $(date +%s) - t )) s): $(tail -1 "$WORK/check_$name.log")" >> "$WORK/summary.txt"
  pack
}
if has checks; then
  check a1 --compiler aot_eager --methods "$METHODS_A1" &
  check a2 --compiler aot_eager --methods "$METHODS_A2" &
  check a3 --compiler aot_eager --methods "$METHODS_A3" &
  check inductor --methods linear,recguide,bastion &
  check none --compiler none --methods "$METHODS_A1,$METHODS_A2,$METHODS_A3" &
fi
if has inductor-checks; then
  for m in ${INDUCTOR_METHODS:-recguide bastion d2sd libraspec tidar dflash}; do
    SAMPLING=greedy check "inductor_$m" --methods "$m" &
  done
fi
if [ "$DEVICE" = cuda ] && has tests; then
  ( t=$(date +%s); OMP_NUM_THREADS=2 timeout -k 5 "$T_CHECK" $PY -m pytest -q -p no:cacheprovider \
      $REPO/tests/test_runner.py $REPO/tests/test_round_step.py -k "cuda or moved" > "$WORK/pytest.log" 2>&1
    echo "pytest -k cuda rc=$? ($(( $(date +%s) - t )) s): $(tail -1 "$WORK/pytest.log")" >> "$WORK/summary.txt" ) &
fi
wait

grep -h "MISMATCH\|Error\|error" "$WORK"/check_*.log 2>/dev/null | sort | uniq -c | head -20 > "$WORK/failures.txt"
pack
echo "--- failures (first lines) ---"; cat "$WORK/failures.txt"
echo "--- profile (ms) ---"; grep -E "^ +[0-9]+×" "$WORK/profile.log" | head -48 | paste - - - -
echo "--- summary ---"; cat "$WORK/summary.txt"
