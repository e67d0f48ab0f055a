#!/usr/bin/env bash
# The package's C extensions built with AddressSanitizer and UndefinedBehaviorSanitizer in a
# scratch copy of the tree (the install is untouched), and the tests of the native code run
# there with the sanitizers' runtimes preloaded: a read or write out of a buffer, a use after
# free or undefined behaviour fails the run. GCC on Linux.
#
#   bash scripts/sanitize_natives.sh                    # the native tests below
#   bash scripts/sanitize_natives.sh tests/test_x.py    # these instead
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
CC=${CC:-gcc}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$ROOT"
git ls-files -z | xargs -0 cp --parents -t "$WORK"
cd "$WORK"
# the package as it is installed: backends/ is kvtier.backends, benchmarks/ kvtier.tools.bench.scripts
rm -rf kvtier/backends kvtier/tools/bench/scripts
cp -r backends kvtier/backends
mkdir -p kvtier/tools/bench
cp -r benchmarks kvtier/tools/bench/scripts
INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SUFFIX=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
# every extension pyproject.toml names, from its sources, where the install would put it
"$PY" - "$CC" "$INC" "$SUFFIX" <<'BUILD'
import os, subprocess, sys, tomllib
cc, include, suffix = sys.argv[1:]
flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-O1", "-g", "-shared", "-fPIC", f"-I{include}"]
with open("pyproject.toml", "rb") as f:
    extensions = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
for ext in extensions:
    sources = ext["sources"]
    dirs = sorted({f"-I{os.path.dirname(s)}" for s in sources})
    out = ext["name"].replace(".", "/") + suffix
    print("built", out, flush=True)
    subprocess.run([cc, *flags, *dirs, *sources, "-o", out], check=True)
BUILD
if [ $# -eq 0 ]; then
    set -- tests/test_gmac_native.py tests/test_block_copy.py tests/test_block_copy_team.py tests/test_lmdb_rowguard.py \
        tests/test_lmdb_one_read.py tests/test_lmdb_close_reads.py tests/test_file_closed_reads.py tests/test_xxcopy.py \
        tests/test_xxcopy_check.py tests/test_xxcopy_read_check.py tests/test_native_bounds.py tests/test_file_syncs.py \
        tests/test_lmdb_direct.py tests/test_key_order.py tests/test_file_row_jobs.py tests/test_lmdb_job_save.py \
        tests/test_lmdb_row_storage.py tests/test_key_index.py tests/test_key_index_ready.py tests/test_lookup_probe.py
fi
# (leaks are not asked: the interpreter's own are not the extensions'; SIGBUS is left to the
# process: tests that show a mapped file cut short kills it expect the signal itself)
LD_PRELOAD="$("$CC" -print-file-name=libasan.so) $("$CC" -print-file-name=libubsan.so)" \
    ASAN_OPTIONS=detect_leaks=0:handle_sigbus=0 UBSAN_OPTIONS=print_stacktrace=1 PYTHONPATH="$WORK" \
    "$PY" -m pytest -q -p no:cacheprovider "$@"
