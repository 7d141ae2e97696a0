#!/usr/bin/env bash
# One command for a GPU machine (an H200, no network): build kvcore's CUDA library, run the
# native tests (CUDA ones included) and the GPU benchmark. Expected wall time 2-4 minutes.
#
#   bash benchmarks/run_gpu.sh            # logs and JSON under $OUT (default build/gpu_out, git-ignored)
#
# Needs python3 with a CUDA build of torch, and nvcc (CUDA_HOME or PATH). cffi, pytest and
# hypothesis are optional: without cffi the tests are skipped (the C module cannot be built),
# but the benchmark still runs, because it drives the CUDA library through ctypes. To bring
# the wheels along, `pip download cffi pycparser pytest hypothesis -d DIR` on a machine with
# network and point KVCORE_WHEELS at DIR (installed with --no-index into a venv that sees
# the system site-packages, so torch is reused).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="${OUT:-$ROOT/build/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STATUS=0
log() { echo "[run_gpu $(date +%H:%M:%S)] $*" | tee -a "$OUT/run_gpu.log"; }

log "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
  command -v nvcc && nvcc --version | tail -n 2
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} 2>&1 | tee -a "$OUT/run_gpu.log"

log "1/4 building the CUDA library (nvcc; KVCORE_CUDA_ARCH=${KVCORE_CUDA_ARCH:-90})"
if ! KVCORE_BUILD_CUDA=1 timeout 300 "$PY" native/build_cuda.py >>"$OUT/build_cuda.log" 2>&1; then
    log "CUDA build FAILED; see $OUT/build_cuda.log"; tail -n 30 "$OUT/build_cuda.log"; exit 1
fi

log "2/4 python environment"
if ! "$PY" -c "import cffi, pytest, hypothesis" 2>/dev/null; then
    for dir in "${KVCORE_WHEELS:-}" "$ROOT/shared/wheels" "$ROOT/benchmarks/wheels"; do
        [ -n "$dir" ] && [ -d "$dir" ] || continue
        log "installing cffi/pytest/hypothesis from $dir into build/venv-gpu (system site-packages)"
        "$PY" -m venv --system-site-packages "$ROOT/build/venv-gpu" \
            && "$ROOT/build/venv-gpu/bin/python" -m pip install -q --no-index --find-links "$dir" \
                cffi pycparser pytest hypothesis >>"$OUT/run_gpu.log" 2>&1 \
            && PY="$ROOT/build/venv-gpu/bin/python"
        break
    done
fi
HAVE_CFFI=0; "$PY" -c "import cffi" 2>/dev/null && HAVE_CFFI=1
HAVE_PYTEST=0; "$PY" -c "import pytest, hypothesis" 2>/dev/null && HAVE_PYTEST=1
log "cffi=$HAVE_CFFI pytest+hypothesis=$HAVE_PYTEST python=$PY"

if [ "$HAVE_CFFI" = 1 ]; then
    log "building kvcore (C module) in place"
    if KVCORE_BUILD_CUDA=1 "$PY" setup.py -q build_ext --inplace >>"$OUT/build_c.log" 2>&1; then
        # kvcore.spec lives in spec/ (package-dir mapping); a shim package puts both together
        # without pip, so no network, setuptools version or write access to site-packages
        # is needed.
        SHIM="$OUT/shim/kvcore"; rm -rf "$OUT/shim"; mkdir -p "$SHIM"
        for f in "$ROOT"/kvcore/*; do ln -s "$f" "$SHIM/"; done
        ln -s "$ROOT/spec" "$SHIM/spec"
        export PYTHONPATH="$OUT/shim${PYTHONPATH:+:$PYTHONPATH}"
        export KVCORE_NATIVE_DIR="$ROOT/native"
    else
        log "C module build FAILED (see $OUT/build_c.log); tests skipped"; HAVE_CFFI=0; STATUS=1
    fi
fi

if [ "$HAVE_CFFI" = 1 ] && [ "$HAVE_PYTEST" = 1 ]; then
    log "3/4 native tests (CUDA tests included)"
    if timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs --rootdir="$ROOT" \
            -o addopts="" tests/native >"$OUT/pytest_native.log" 2>&1; then
        log "tests passed: $(tail -n 1 "$OUT/pytest_native.log")"
    else
        log "tests FAILED: $(tail -n 1 "$OUT/pytest_native.log")"; STATUS=1
        tail -n 40 "$OUT/pytest_native.log"
    fi
else
    log "3/4 native tests SKIPPED (need cffi, pytest and hypothesis; see KVCORE_WHEELS above)"
fi

log "4/4 GPU benchmark"
if timeout 300 "$PY" benchmarks/gpu_bench.py --json "$OUT/gpu_bench.json" \
        2>&1 | tee "$OUT/gpu_bench.log"; then
    log "benchmark done"
else
    log "benchmark FAILED (exit ${PIPESTATUS[0]}); see $OUT/gpu_bench.log"; STATUS=1
fi
log "5/5 vLLM end to end with KvcoreConnector (needs vllm with CUDA and a local model)"
# KVCORE_VLLM_MODEL: a local model directory with an MTP head (or set KVCORE_VLLM_DRAFT to
# an EAGLE drafter and KVCORE_VLLM_METHOD=eagle). Skipped without a GPU, vllm or a model.
if [ -n "${KVCORE_VLLM_MODEL:-}" ] && "$PY" -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
    if timeout 900 "$PY" benchmarks/vllm_e2e.py --model "$KVCORE_VLLM_MODEL" \
            ${KVCORE_VLLM_DRAFT:+--draft "$KVCORE_VLLM_DRAFT"} --method "${KVCORE_VLLM_METHOD:-mtp}" \
            --json "$OUT/vllm_e2e.json" >"$OUT/vllm_e2e.log" 2>&1; then
        log "vLLM end to end passed (identical outputs, CPU-tier hits); see $OUT/vllm_e2e.json"
    else
        log "vLLM end to end FAILED; see $OUT/vllm_e2e.log"; tail -n 30 "$OUT/vllm_e2e.log"; STATUS=1
    fi
else
    log "vLLM end to end SKIPPED (set KVCORE_VLLM_MODEL to a local model; needs vllm and a GPU)"
fi
log "exit $STATUS"
exit $STATUS
