#!/usr/bin/env bash
# Build llama-cpp-python (the bench-only peer of bench/peers.py) for THIS CPU, then print
# llama.cpp's system line so you can check what it will run.
#   bash bench/llama_cpp_build.sh            # build and install (tens of minutes on 2 cores)
#   bash bench/llama_cpp_build.sh --flags    # only print the CMake flags it would use
# Why not a native build: GGML_NATIVE=ON compiles with -march=native, and on VMs that advertise
# AMX but fault on its tile instructions that turns AMX_INT8 on even with the three GGML_AMX_*
# flags off (llama.cpp then dies with SIGILL: seen on an Intel Xeon). So: GGML_NATIVE=OFF and
# each vector extension /proc/cpuinfo lists turned on explicitly, AMX always off.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
args+=" -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
args+=" -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni)"
args+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
args+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
echo "CMAKE_ARGS=\"$args\""
[[ "${1:-}" == "--flags" ]] && exit 0
"$PY" -m pip install scikit-build-core==1.1.2
CMAKE_ARGS="$args" "$PY" -m pip install --no-build-isolation llama-cpp-python==0.3.36
"$PY" -c 'import llama_cpp; print("llama.cpp system line:", llama_cpp.llama_print_system_info().decode())'
