#!/usr/bin/env bash
# The GPU runs of docs/deployment-sizing.md and docs/performance.md, one device call at a time:
#   bash benchmarks/gpu_runs.sh STAGE...        (from the checkout's root, on the GPU machine)
# Each stage writes its raw output (log, JSON) under $OUT, as printed; stages run in the order given and
# share the call's time: a stage gets what is left of BUDGET_S (default 560 s) less a margin, so the call
# ends inside its 10 minutes and whatever ran comes back. Wheels the machine lacks travel in the
# checkout's `.whl/` folder; they are installed first when present.
#
# Stages (H200 for the 78-layer ones: TP 8's weights are about 95 GB a rank; on an H100, LAYERS=40
# runs them at the depth that fits; MEMCHECK_JOBS test files at once under the sanitizer, default 2):
#   smoke     TP 8 rank at 4 and 8 layers, batches 1 / 64, 8k context, MTP 0 / 3, warm-up: the CUDA path
#   rank8k    TP 8 SP off, 78 layers, batches 1 / 16 / 64 / 256, 8k context, MTP 0 / 3
#   warmup    TP 8 SP off, 78 layers: the engine's build and warm-up as served (graphs up to 256, MTP 3)
#   serve78   spmoe serve as that rank (defaults, MTP 3, FP8 KV): ready time, memory, 64 / 256 streams
#   rank128k  TP 8 SP off, 78 layers, batches 1 / 16, 128k context, MTP 0 / 3
#   serve     bench_serve_vs_generate at GLM-5.2's widths: 16 / 64 / 256 streams, 128->256 and 1024->128
#             (SERVE_SHAPES="128x256" for one; API_SERVER_COUNT=N front end processes, default 1)
#   streaming bench_streaming on this machine's CPUs: the front end against a scripted engine, 16 / 64 /
#             256 streams, and the bench client's own ceiling (no GPU used; a minute or two)
#   spon      TP 8 SP on, 78 layers (as rank8k)
#   dp8       DP 8 x EP 8, 78 layers, batches 1 / 2 / 8 / 32 a rank, and bench_dp_host on this machine
#   depths    TP 8 SP off at 20 and 40 layers (an H100 holds both), batches 1 / 16 / 64 / 256, 8k
#             context, MTP 0 / 3, the kernels by name: two depths for project_node.py's extrapolation
#   spec      bench_speculative on code edits: MTP, n-gram and both, batch 1 and 16, graphs
#   gputests  pytest -m gpu, the DP graphs test, the trained checkpoint's perplexity graphs vs eager
#   memcheck  compute-sanitizer over every GPU kernel test file
#   fp8       bench_decode_step bf16 vs fp8 weights, and bench_fp8_linear
set -uo pipefail
: "${OUT:?OUT must name the folder the results go to}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
began=$SECONDS
budget=${BUDGET_S:-560}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$root
else
  export PYTHONPATH=$root
fi
{ date -u +%FT%TZ; git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

left() { echo $((budget - (SECONDS - began) - 10)); }

# run NAME CMD...: CMD under what is left of the budget, its output to $OUT/NAME.log and the screen
run() {
  local name=$1 limit
  shift
  limit=$(left)
  if ((limit < 30)); then
    echo "== $name: skipped, ${limit}s left" | tee -a "$OUT/skipped.txt"
    return
  fi
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - began))s" | tee -a "$OUT/$name.log"
}

# an array, not a function: `run` hands its command to `timeout`, which runs programs only
size=(python3 benchmarks/size_rank.py --kv-cache-dtype fp8 --reps 10)
# GLM-5.2's depth; an H100 holds about 40 of its layers at TP 8 (LAYERS=40 there)
layers=${LAYERS:-78}

for stage in "$@"; do
  case $stage in
    smoke)
      run smoke "${size[@]}" --tp 8 --layers 4 8 --batches 1 64 \
        --contexts 8192 --mtp 0 3 --prefill 8192 \
        --timing-kv-gib 16 --warmup --graph-sizes 8 --out "$OUT/tp8_l4_8.json" ;;
    rank8k)
      run rank8k "${size[@]}" --tp 8 --sp off --layers "$layers" --batches 1 16 64 256 \
        --contexts 8192 --mtp 0 3 \
        --prefill 8192 --timing-kv-gib 24 --kernels --out "$OUT/tp8_spoff.json" ;;
    warmup)
      run warmup "${size[@]}" --tp 8 --sp off --layers "$layers" --batches 1 \
        --contexts 8192 --mtp 0 3 --prefill \
        --warmup --graph-sizes 256 --warmup-mtp 3 --warmup-kv-gib 24 --timing-kv-gib 4 \
        --out "$OUT/tp8_warmup.json" ;;
    serve78)
      run serve78 python3 benchmarks/serve_simulated_rank.py --layers "$layers" --concurrency 64 256 \
        --num-prompts 256 --input-len 1024 --output-len 128 --out "$OUT/serve78.json" -- \
        --kv-cache-dtype fp8 --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}' ;;
    rank128k)
      run rank128k "${size[@]}" --tp 8 --sp off --layers "$layers" --batches 1 16 \
        --contexts 131072 --mtp 0 3 \
        --prefill --max-model-len 132096 --timing-kv-gib 24 --out "$OUT/tp8_spoff_128k.json" ;;
    serve)
      # SERVE_SHAPES picks the shapes (both take more than one call's time), API_SERVER_COUNT the
      # server's front end processes; bench_serve's client runs in a process per 32 streams
      for shape in ${SERVE_SHAPES:-128x256 1024x128}; do
        set -- ${shape/x/ }
        run "serve_${1}_$2" python3 benchmarks/bench_serve_vs_generate.py --folder /tmp/glm_widths \
          --widths glm --vocab-size 154880 --concurrency 16 64 256 --num-prompts 512 \
          --api-server-count "${API_SERVER_COUNT:-1}" \
          --input-len "$1" --output-len "$2" -- --device cuda --dtype bfloat16 --cuda-graphs
      done ;;
    streaming)
      run streaming python3 benchmarks/bench_streaming.py --streams 16 64 256 --client-ceiling \
        --json "$OUT/streaming.json" ;;
    spon)
      run spon "${size[@]}" --tp 8 --sp on --layers "$layers" --batches 1 16 64 256 \
        --contexts 8192 --mtp 0 3 --prefill 8192 --timing-kv-gib 24 --out "$OUT/tp8_spon.json" ;;
    dp8)
      run dp8 "${size[@]}" --tp 1 --dp 8 --layers "$layers" --batches 1 2 8 32 \
        --contexts 8192 --mtp 0 3 --prefill 8192 --timing-kv-gib 16 --out "$OUT/dp8.json"
      run dp_host python3 benchmarks/bench_dp_host.py --dp 8 --batches 1 2 8 32 --tokens 1 3 \
        --out "$OUT/dp_host.json" ;;
    depths)
      run depths "${size[@]}" --tp 8 --sp off --layers 20 40 --batches 1 16 64 256 \
        --contexts 8192 --mtp 0 3 --prefill 8192 --timing-kv-gib 12 --kernels \
        --out "$OUT/tp8_spoff_l20_40.json" ;;
    spec)
      run spec python3 benchmarks/bench_speculative.py --workload edit --batches 1 16 --drafts 3 \
        --temperatures 0 --sources mtp mtp+ngram ngram --prompt-len 256 --new-tokens 256 ;;
    gputests)
      # tests/entrypoints needs the openai client, which the GPU machine lacks; none of it is GPU-only
      run gputests python3 -m pytest -q -p no:cacheprovider -m gpu -rs --ignore=tests/entrypoints tests
      run dp_graphs python3 -m pytest -q -p no:cacheprovider tests/engine/test_dp_graphs_gpu.py ;;
    memcheck)
      run memcheck bash benchmarks/memcheck_gpu_tests.sh "$OUT/memcheck" "${MEMCHECK_JOBS:-2}" "$(($(left) - 30))" ;;
    fp8)
      run fp8_step python3 benchmarks/bench_decode_step.py --weights bf16 fp8 \
        --cases 1x8192 16x8192 64x8192
      run fp8_linear python3 benchmarks/bench_fp8_linear.py --tp 8 --m 1 16 64 8192
      run fp8_sweep python3 benchmarks/bench_fp8_linear.py --tp 8 --m 1 16 64 --sweep ;;
    *)
      echo "unknown stage '$stage': expected smoke, rank8k, warmup, serve78, rank128k, serve, streaming," \
        "spon, dp8, depths, spec, gputests, memcheck or fp8" >&2
      exit 2 ;;
  esac
done
