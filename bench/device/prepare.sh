#!/usr/bin/env bash
# Run HERE (with network), once, before bench/device/xeon.sh on the lent Xeon (no network; Python 3.12
# without cffi / pycparser / gguf): .whl/ gets those wheels (cp312 manylinux x86_64, --no-deps) and
# .dev/ the pruned llama.cpp source that builds llama-bench (bench/llama_bench_build.sh --prune).
# Both are ignored by git and carried with each call: run(..., carry=[".whl", ".dev"]); ~5 MB.
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
# the server's pure-Python stack (and httpx for the load driver) for xeon.sh's `replicas` phase, ~4 MB
if [ ! -f .whl/serve/.done ]; then
  mkdir -p .whl/serve
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/serve \
    annotated-types anyio certifi click h11 httpcore httpx idna jinja2 markupsafe pydantic pydantic_core sniffio \
    starlette typing_extensions typing-inspection uvicorn python-multipart && touch .whl/serve/.done
fi
TAR=.dev/llama.cpp-0.3.36-pruned.tar.gz
[ -f "$TAR" ] || bash bench/llama_bench_build.sh --prune "$ROOT/$TAR" --prune-only
du -sh .whl .dev
