#!/usr/bin/env bash
# kvtier's GPU check: the CUDA tests, benchmarks/bench_gpu.py and (where vLLM is installed)
# benchmarks/bench_vllm_e2e.py, in one run of a few minutes.
#
# On a machine with a CUDA device and no network, from the project root:
#   1. where there is network: fill .whl/ with wheels of what the GPU machine lacks (lmdb,
#      zstandard, pydantic and its dependencies, platformdirs, pytest-asyncio; cuda-bindings to
#      also check the batched-copy fallback) and a wheel of kvtier (pip wheel --no-deps . -w .whl)
#   2. there:  bash scripts/gpu_check.sh      # results in $OUT, else ./gpu-results
# See docs/tiers.md, "GPU figures".
#
# It installs .whl/*.whl (when present) into a private folder, runs `pytest -m cuda` on the test
# files that hold CUDA tests (among them the memory tiers' copy orderings in test_cuda_tiers.py:
# a call's copies have landed when it returns, it waits on the devices it touched only, never
# on the compute stream; a gpu tier's batched read into host rows and a store staged on the
# device writing through to a byte tier from one host copy per job give the engine's bytes;
# the two-device one needs a second GPU), then bench_gpu.py, and writes
# into the results folder:
#   env.json          python, torch, CUDA, device, kvtier version
#   pytest-cuda.txt   the test output (and pytest-cuda.xml, JUnit)
#   bench_gpu.json    the benchmark's JSON object (bench_gpu.txt: its stderr)
#   bench_vllm_e2e.json  TTFT / throughput under vLLM with and without kvtier, where vLLM is
#                     installed (bench_vllm_e2e.txt: its table and progress)
#   summary.txt       one line per step and the verdict
# Exit status: 0 all passed; 2 no CUDA device; 3 the install failed; 1 a test or the benchmark failed.
set -u
cd "$(dirname "$0")/.." || exit 1
RESULTS="${OUT:-$PWD/gpu-results}"
mkdir -p "$RESULTS"
: > "$RESULTS/summary.txt"
PY="${PYTHON:-python3}"
say() { echo "[gpu_check] $*" | tee -a "$RESULTS/summary.txt" >&2; }
started=$(date +%s)

if ls .whl/*.whl > /dev/null 2>&1; then
  SITE="${TMPDIR:-/tmp}/kvtier-gpu-check-site"
  rm -rf "$SITE"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
      > "$RESULTS/install.txt" 2>&1; then
    say "FAILED: installing the carried wheels (.whl/): see install.txt"
    exit 3
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  say "installed $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
else
  say "no .whl/ folder: using the Python packages already installed"
fi
# The checkout's kvtier/ folder must not shadow the installed wheel (entry points need the install).
export PYTHONSAFEPATH=1

"$PY" - > "$RESULTS/env.json" 2> "$RESULTS/env.txt" <<'EOF'
import json, platform, sys
import torch
info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["device"] = torch.cuda.get_device_name()
    info["device_count"] = torch.cuda.device_count()
try:
    import kvtier
    info["kvtier"] = getattr(kvtier, "__version__", "?")
    info["kvtier_file"] = kvtier.__file__
except Exception as exc:  # reported, and the tests below will say more
    info["kvtier_error"] = repr(exc)
try:
    import cuda.bindings
    info["cuda_bindings"] = getattr(cuda.bindings, "__version__", "yes")
except ImportError:
    info["cuda_bindings"] = None
print(json.dumps(info))
EOF
say "environment: $(cat "$RESULTS/env.json" 2>/dev/null || echo unknown)"
if ! grep -q '"cuda_available": true' "$RESULTS/env.json"; then
  say "NO CUDA: torch.cuda.is_available() is False here; nothing checked"
  exit 2
fi

status=0
mapfile -t files < <(grep -l "mark.cuda" tests/test_*.py)
say "CUDA tests in: ${files[*]}"
timeout 120 "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --junitxml="$RESULTS/pytest-cuda.xml" \
  "${files[@]}" > "$RESULTS/pytest-cuda.txt" 2>&1
rc=$?
say "pytest -m cuda: exit $rc, $(tail -n 1 "$RESULTS/pytest-cuda.txt")"
if [ "$rc" -ne 0 ]; then status=1; fi
if grep -q "CUDA TESTS NOT RUN" "$RESULTS/pytest-cuda.txt"; then
  say "FAILED: CUDA tests were skipped although a device is present"
  status=1
fi

timeout 150 "$PY" benchmarks/bench_gpu.py --out "$RESULTS/bench_gpu.json" > /dev/null 2> "$RESULTS/bench_gpu.txt"
rc=$?
say "bench_gpu.py: exit $rc; $(tail -n 1 "$RESULTS/bench_gpu.txt")"
if [ "$rc" -ne 0 ]; then status=1; fi

# vLLM end to end (benchmarks/bench_vllm_e2e.py): TTFT and throughput with and without kvtier,
# every arm a fresh vLLM process; skipped where vLLM is not installed. A random Llama of 16
# layers x 2048 (about 1B parameters, bfloat16 on the device: 64 KiB of KV per token) and
# 4,064-token documents, so that a hit skips a prefill worth measuring.
if "$PY" -c "import vllm" > /dev/null 2>&1; then
  timeout 900 "$PY" benchmarks/bench_vllm_e2e.py --quick --layers 16 --hidden 2048 --doc-tokens 4064 \
    --turn-tokens 1024 --cache-blocks 640 --json "$RESULTS/bench_vllm_e2e.json" \
    > /dev/null 2> "$RESULTS/bench_vllm_e2e.txt"
  rc=$?
  say "bench_vllm_e2e.py: exit $rc; $(tail -n 1 "$RESULTS/bench_vllm_e2e.txt")"
  if [ "$rc" -ne 0 ]; then status=1; fi
else
  say "bench_vllm_e2e.py: skipped (vLLM is not installed here)"
fi

say "done in $(( $(date +%s) - started )) s: $([ "$status" -eq 0 ] && echo PASSED || echo FAILED)"
exit "$status"
