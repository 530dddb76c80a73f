#!/usr/bin/env bash
# Build llama.cpp's own llama-bench from the source vendored in llama-cpp-python 0.3.36 (the peer
# of `make bench-e2e`), for bench/e2e/big.py --llama-bench PATH; nothing goes inside the repository.
#   bash bench/llama_bench_build.sh [--src DIR | --src-tar PRUNED.tar.gz] [--out DIR] [-j N]
#   bash bench/llama_bench_build.sh --prune OUT.tar.gz [--prune-only]   # also write the pruned source
#   bash bench/llama_bench_build.sh --ggml bench/.ggml    # ggml's CPU backend, shared (bench-peers)
# The sdist's address and sha256 come from PyPI's simple index. Release, static, GGML_NATIVE on,
# server/tests/examples off; target llama-bench only (~12 min on 2 cores). The pruned copy keeps
# what building llama-bench reads (ggml without the non-CPU backends; 2.9 MB packed). Output:
# $LLAMA_BENCH_DIR (default ~/.cache/cpufuse-bench/llama-bench)/build/bin/llama-bench, the last line.
set -euo pipefail

VERSION=0.3.36
OUT="${LLAMA_BENCH_DIR:-${CPUFUSE_BENCH_MODELS:-$HOME/.cache/cpufuse-bench}/llama-bench}"
SRC="" SRC_TAR="" PRUNE="" PRUNE_ONLY=0 GGML=""
JOBS="$(nproc 2>/dev/null || echo 2)"
while [ $# -gt 0 ]; do
  case "$1" in
    --src) SRC="$2"; shift 2 ;;
    --src-tar) SRC_TAR="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --prune) PRUNE="$2"; shift 2 ;;
    --prune-only) PRUNE_ONLY=1; shift ;;
    --ggml) GGML="$2"; shift 2 ;;
    -j) JOBS="$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "llama_bench_build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

fetch_sdist() {  # -> $OUT/llama_cpp_python-$VERSION.tar.gz, sha256 checked
  local tgz="$OUT/llama_cpp_python-$VERSION.tar.gz"
  python3 - "$VERSION" "$tgz" <<'EOF'
import hashlib, os, re, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
name = f"llama_cpp_python-{version}.tar.gz"
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/", timeout=60).read().decode()
m = re.search(r'href="([^"]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
if not m:
    sys.exit(f"{name} is not listed on https://pypi.org/simple/llama-cpp-python/")
url, sha = m.group(1), m.group(2)
def ok():
    if not os.path.exists(dest):
        return False
    h = hashlib.sha256()
    with open(dest, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest() == sha
if not ok():
    print(f"downloading {url}", flush=True)
    urllib.request.urlretrieve(url, dest + ".part")
    os.replace(dest + ".part", dest)
    if not ok():
        sys.exit(f"{dest}: sha256 does not match the index's {sha}")
print(f"{dest}: sha256 {sha} ok")
EOF
  echo "$tgz"
}

if [ -n "$SRC_TAR" ]; then
  rm -rf "$OUT/src" && mkdir -p "$OUT/src"
  tar -xzf "$SRC_TAR" -C "$OUT/src" --strip-components=1
  SRC="$OUT/src"
elif [ -z "$SRC" ]; then
  tgz="$(fetch_sdist | tail -1)"
  if [ ! -f "$OUT/src/.extracted-$VERSION" ]; then
    rm -rf "$OUT/src" && mkdir -p "$OUT/src"
    tar -xzf "$tgz" -C "$OUT/src" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    touch "$OUT/src/.extracted-$VERSION"
  fi
  SRC="$OUT/src"
fi
SRC="$(cd "$SRC" && pwd)"

if [ -n "$PRUNE" ]; then
  P="$(mktemp -d)"
  D="$P/llama.cpp-$VERSION-pruned"
  mkdir -p "$D/ggml/src" "$D/tools"
  ( cd "$SRC"
    cp -a CMakeLists.txt LICENSE cmake include src common vendor "$D/"
    [ -d licenses ] && cp -a licenses "$D/"
    cp -a ggml/CMakeLists.txt ggml/cmake ggml/include "$D/ggml/"
    for f in ggml/src/*; do   # every file, and of the backend folders only ggml-cpu
      if [ -f "$f" ] || [ "$(basename "$f")" = ggml-cpu ]; then cp -a "$f" "$D/ggml/src/"; fi
    done
    cp -a tools/llama-bench "$D/tools/" )
  printf '# pruned by cpufuse bench/llama_bench_build.sh: llama-bench only\nadd_subdirectory(llama-bench)\n' > "$D/tools/CMakeLists.txt"
  find "$D" -name '*.py' -delete
  rm -rf "$D/vendor/miniaudio/"*.md 2>/dev/null || true
  tar -czf "$PRUNE" -C "$P" "$(basename "$D")"
  echo "pruned source: $PRUNE ($(du -sh "$D" | cut -f1) unpacked, $(du -h "$PRUNE" | cut -f1) packed)"
  rm -rf "$P"
  [ "$PRUNE_ONLY" = 1 ] && exit 0
fi

if [ -n "$GGML" ]; then   # the kernel tables' ggml column: the paths llama.cpp runs (llamafile, repack)
  B="$OUT/build-ggml"
  cmake -S "$SRC" -B "$B" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_BACKEND_DL=OFF \
    -DGGML_LLAMAFILE=ON -DGGML_CPU_REPACK=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF \
    > "$OUT/ggml-configure.log" 2>&1 \
    || { tail -40 "$OUT/ggml-configure.log"; exit 1; }
  cmake --build "$B" --target ggml-base ggml-cpu -j "$JOBS" > "$OUT/ggml-build.log" 2>&1 \
    || { tail -40 "$OUT/ggml-build.log"; exit 1; }
  mkdir -p "$GGML/lib" && find "$B" -name 'libggml-*.so*' -exec cp -a {} "$GGML/lib/" \;
  echo "$GGML/lib"
  exit 0
fi
B="$OUT/build"
cmake -S "$SRC" -B "$B" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON > "$OUT/cmake-configure.log" 2>&1 \
  || { tail -40 "$OUT/cmake-configure.log"; exit 1; }
cmake --build "$B" --target llama-bench -j "$JOBS" > "$OUT/cmake-build.log" 2>&1 \
  || { tail -40 "$OUT/cmake-build.log"; exit 1; }
"$B/bin/llama-bench" --help > /dev/null
echo "$B/bin/llama-bench"
