#!/usr/bin/env bash
# compute-sanitizer memcheck over the GPU kernel tests: one sanitizer run per test file, each to its
# "ERROR SUMMARY" line (or its time limit), `-j` files at once on the one GPU. Graph captures are left out:
# memcheck needs PYTORCH_NO_CUDA_MEMORY_CACHING=1 (each tensor its own allocation, so a stray access falls
# outside any), and without the caching allocator a capture refuses cudaMalloc.
#   bash benchmarks/memcheck_gpu_tests.sh OUT_DIR [JOBS] [SECONDS_PER_FILE]
# Writes OUT_DIR/memcheck.log (every file's output, one after another) and OUT_DIR/memcheck-summary.txt
# (per file: pytest's closing line and the sanitizer's ERROR SUMMARY, or "no summary: <why>").
set -uo pipefail
out=${1:?usage: memcheck_gpu_tests.sh OUT_DIR [JOBS] [SECONDS_PER_FILE]}
jobs=${2:-4}
limit=${3:-500}
mkdir -p "$out/files"
files=(
  tests/layers/test_fused_kernels_gpu.py tests/layers/test_fp8_kernels_gpu.py
  tests/layers/test_triton_experts.py tests/layers/test_sparse_attention_gpu.py
  tests/engine/test_top_k_top_p_gpu.py tests/engine/test_seeded_race_gpu.py
  tests/layers/test_seeded_routing_gpu.py
  tests/engine/test_sampling_gpu.py tests/engine/test_grammar.py tests/engine/test_engine_grammar.py
  tests/models/deepseek_v32/test_fp8_gpu.py tests/models/deepseek_v32/test_oracle_gpu.py
)
one() {
  local file=$1 out=$2 limit=$3 log
  log="$out/files/$(basename "$file" .py).log"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" compute-sanitizer --tool memcheck --print-limit 20 \
    python -m pytest -q -p no:cacheprovider -m gpu -k "not graph and not capture and not replay" "$file" \
    >"$log" 2>&1
  echo "exit $?" >>"$log"
}
export -f one
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} bash -c 'one "$@"' _ {} "$out" "$limit"
: >"$out/memcheck.log"
: >"$out/memcheck-summary.txt"
for file in "${files[@]}"; do
  log="$out/files/$(basename "$file" .py).log"
  { echo "===== $file"; cat "$log"; } >>"$out/memcheck.log"
  closing=$(grep -E "passed|failed|error|no tests ran" "$log" | grep -v "ERROR SUMMARY" | tail -1)
  summary=$(grep -E "ERROR SUMMARY" "$log" | tail -1)
  [[ -n "$summary" ]] || summary="no summary: $(tail -1 "$log")"
  printf '%s | %s | %s\n' "$file" "${closing:-no pytest line}" "$summary" >>"$out/memcheck-summary.txt"
done
rm -rf "$out/files"
cat "$out/memcheck-summary.txt"
