#!/bin/bash
# One call on a GPU machine: build the extension, then run the steps named in STEPS; logs and results land in $OUT
# (packed into $OUT/results.tgz at the end).  Run from the repository root:
#
#   GIT_SHA=$(git rev-parse HEAD) STEPS="tests example bench model" bash tools/device_run.sh
#
# Environment:
#   STEPS      steps to run, in order (default "tests example bench model"; "none" only builds)
#   NPROC      ranks (GPUs) for the multi-GPU steps (default 2); results are tagged h200x<NPROC>_tp<NPROC>
#   GIT_SHA    the sha results record (the copy's .git can lag the working tree it was given)
#   OUT        output folder (default /tmp/fluxinductor_out)
#   TUNING=1   build the tuning-only kernel variants too (CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON)
#   PREBUILT   path to a carried _C*.so built from the same csrc/ (skips the build)
#   BENCH_TUNING  --tuning for the bench, mbench and model steps (kernel-tuning fields, e.g. ag_variant=5)
#   BENCH_ARGS / MODEL_ARGS / SWEEP_ARGS / HOST_ARGS / PROBE_ARGS / TRACE_ARGS / PINGAB_ARGS  extra arguments per step
#
# Steps:
#   tests    the single-GPU GPU tests and the NPROC-rank torchrun checks (gpu_tests.log)
#   gtests   the single-GPU GPU tests only; dtests: the NPROC-rank torchrun checks only
#   split    the split GEMM+RS transport's tests and its torchrun check; rstests: the GEMM+RS kernel tests
#   agbench  the AG+GEMM 2-rank timings of tests/gpu/run_ag_gemm_2rank.py (ag_gemm_bench.json)
#   rsbench  fused GEMM+RS per kernel configuration (RS_CONFIGS 'config,swizzle,raster[,push=..][,bands=..];...')
#   example  examples/sp_transformer_block.py on NPROC GPUs
#   bench    benchmarks/bench_ops.py; its cost-model rows merge into a copy of the packaged tables in $OUT/tuning
#   mbench   bench_ops on the Llama-style models' shapes (MODEL_SHAPES), into the same table
#   model    benchmarks/bench_model.py, reading $OUT/tuning (so a bench of new shapes feeds it)
#   tailsab  bench_ops with both tail splits off (--tuning ag_tail_split=1,gemm_rs_tail_split=1), to set beside bench
#   pingab   TUNING=1 builds: AG+GEMM with the ping-pong tuning variant (--tuning ag_variant=5) against variant 0
#   sweep    benchmarks/probes/sweep_kernels.py, AG on GPU 0 and GEMM+RS on GPU 1, kernel configurations vs cuBLAS
#   tails    the tail-split tests, then the split GEMM+RS GEMMs and AG+GEMM with tail splits off / on (one GPU)
#   host     benchmarks/probes/host_overhead.py: host cost per call of each dispatch path
#   trace    benchmarks/probes/trace_op.py per TRACES entry ('shape path [key=value ...]' separated by ';')
#   probe    benchmarks/probes/probe_transport.py: the NVLink transports, alone and beside a GEMM
set -u
export PYTHONUNBUFFERED=1 FLUXINDUCTOR_BUILD_JOBS=16 FLUXINDUCTOR_REQUIRE_EXTENSION=1
if [ -n "${GIT_SHA:-}" ]; then export FLUXINDUCTOR_GIT_SHA=$GIT_SHA; fi
OUT=${OUT:-/tmp/fluxinductor_out}
STEPS=${STEPS:-"tests example bench model"}
MODEL_SHAPES=${MODEL_SHAPES:-4096x8192x28672,4096x28672x8192,4096x8192x10240,4096x8192x57344,4096x8192x8192,4096x10240x8192,4096x57344x8192}
NPROC=${NPROC:-2}
TAG=h200x${NPROC}_tp${NPROC}
BENCH_TUNING_ARGS=()
if [ -n "${BENCH_TUNING:-}" ]; then BENCH_TUNING_ARGS=(--tuning "$BENCH_TUNING"); fi
mkdir -p "$OUT/tuning"
cp fluxinductor/tuning/*.json "$OUT/tuning/"
if [ "${TUNING:-0}" = 1 ]; then export CMAKE_ARGS="${CMAKE_ARGS:-} -DFLUXINDUCTOR_KERNEL_TUNING=ON"; fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
if [ "$NPROC" -gt 2 ]; then nvidia-smi topo -m | head -8; fi
if ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then  # a machine without the package index: CUTLASS carried along
  python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl
fi
start=$(date +%s)
if [ -n "${PREBUILT:-}" ]; then
  FLUXINDUCTOR_BUILD_EXTENSION=0 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
  cp "$PREBUILT" fluxinductor/
elif ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
so=$(python3 -c "import fluxinductor._C as c; print(c.__file__)") || exit 1
cp "$so" "$OUT/"

bench_ops() {  # bench_ops() <log name> <timeout s> <bench_ops.py arguments...>
  local log=$1 limit=$2; shift 2
  FLUXINDUCTOR_TUNING_DIR=$OUT/tuning timeout "$limit" torchrun --nproc-per-node "$NPROC" benchmarks/bench_ops.py \
    "$@" > "$OUT/$log.log" 2>&1
}

for step in $STEPS; do
  case $step in
    tests)
      { timeout 300 python3 -m pytest -q -rs tests/gpu -k "not torchrun"
        timeout 120 torchrun --nproc-per-node "$NPROC" tests/gpu/run_ag_gemm_2rank.py --calls 1000
        timeout 120 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py; } > "$OUT/gpu_tests.log" 2>&1
      grep -E "passed|failed|error|FAIL|OK|ok" "$OUT/gpu_tests.log" | tail -15 ;;
    gtests)
      timeout "${GTESTS_TIMEOUT:-300}" python3 -m pytest -q -rs tests/gpu -k "not torchrun" > "$OUT/gpu_tests.log" 2>&1
      echo "gpu tests rc=$?"; grep -E "passed|failed|FAIL|Error" "$OUT/gpu_tests.log" | tail -15 ;;
    dtests)
      { timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_ag_gemm_2rank.py --calls 1000
        timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py
        timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_dynamic_2rank.py; } > "$OUT/dist_tests.log" 2>&1
      grep -E "PASSED|FAIL|Error|error" "$OUT/dist_tests.log" | sort | uniq -c | tail -15 ;;
    split)
      { timeout 300 python3 -m pytest -q -rs tests/gpu/test_gemm_rs.py -k "split or peer_never"
        timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py --pushes split; } \
        > "$OUT/split_tests.log" 2>&1
      grep -E "passed|failed|error|Error|FAIL|all checks" "$OUT/split_tests.log" | tail -12 ;;
    rstests)
      timeout 300 python3 -m pytest -q -rs tests/gpu/test_gemm_rs.py -k "tuning or n_ranks or gemm_only or copy_engine or peer_never" \
        > "$OUT/rstests.log" 2>&1; echo "rstests rc=$?"; tail -5 "$OUT/rstests.log" ;;
    agbench)
      timeout 240 torchrun --nproc-per-node "$NPROC" tests/gpu/run_ag_gemm_2rank.py --skip-checks \
        --bench "$OUT/ag_gemm_bench.json" > "$OUT/agbench.log" 2>&1
      echo "agbench rc=$?"; tail -20 "$OUT/agbench.log" ;;
    rsbench)
      timeout 300 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py --skip-checks --bench \
        --configs "${RS_CONFIGS:-0,4,2;6,4,2}" ${RS_SHAPES:+--shapes "$RS_SHAPES"} \
        --json "$OUT/rs_configs_tp${NPROC}.json" > "$OUT/rsbench_tp${NPROC}.log" 2>&1
      echo "rsbench rc=$?"; grep -v Warning "$OUT/rsbench_tp${NPROC}.log" | tail -30 | cut -c1-400 ;;
    example)
      timeout 240 torchrun --nproc-per-node "$NPROC" examples/sp_transformer_block.py > "$OUT/example.log" 2>&1
      echo "example rc=$?"; tail -25 "$OUT/example.log" ;;
    bench)
      bench_ops bench_ops "${BENCH_TIMEOUT:-420}" --out "$OUT/${TAG}_ops" \
        --emit-tuning "$OUT/tuning/{device_key}_tp{world}.json" \
        ${BENCH_TUNING_ARGS[@]+"${BENCH_TUNING_ARGS[@]}"} ${BENCH_ARGS:-}
      echo "bench rc=$?"; tail -c 6000 "$OUT/bench_ops.log" ;;
    mbench)
      bench_ops bench_ops_model_shapes "${BENCH_TIMEOUT:-420}" --out "$OUT/${TAG}_ops_model_shapes" \
        --emit-tuning "$OUT/tuning/{device_key}_tp{world}.json" --shapes "$MODEL_SHAPES" --no-plot \
        ${BENCH_TUNING_ARGS[@]+"${BENCH_TUNING_ARGS[@]}"} ${BENCH_ARGS:-}
      echo "bench (model shapes) rc=$?"; tail -c 4000 "$OUT/bench_ops_model_shapes.log" ;;
    tailsab)
      # no tuning table: these numbers are not the defaults'
      bench_ops bench_ops_tails_off "${BENCH_TIMEOUT:-420}" --out "$OUT/${TAG}_ops_tails_off" \
        --tuning ag_tail_split=1,gemm_rs_tail_split=1 ${BENCH_ARGS:-}
      echo "bench (tail splits off) rc=$?"; tail -c 6000 "$OUT/bench_ops_tails_off.log" ;;
    pingab)
      for variant in 0 5; do
        bench_ops "pingab_ag$variant" "${PINGAB_TIMEOUT:-170}" --out "$OUT/${TAG}_pingab_ag$variant" --ops ag_gemm \
          --contenders gemm,fused_nocomm,fused --tuning "ag_variant=$variant" ${PINGAB_ARGS:-}
        echo "pingab AG variant $variant: rc=$?"; grep -v Warning "$OUT/pingab_ag$variant.log" | tail -12
      done ;;
    model)
      FLUXINDUCTOR_TUNING_DIR=$OUT/tuning timeout "${MODEL_TIMEOUT:-330}" torchrun --nproc-per-node "$NPROC" \
        benchmarks/bench_model.py --out "$OUT/${TAG}_model" --contender-timeout 120 \
        ${BENCH_TUNING_ARGS[@]+"${BENCH_TUNING_ARGS[@]}"} ${MODEL_ARGS:-} > "$OUT/bench_model.log" 2>&1
      echo "bench_model rc=$?"; tail -c 5000 "$OUT/bench_model.log" ;;
    sweep)
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/probes/sweep_kernels.py \
        --op ag --out "$OUT/sweep_ag.json" ${SWEEP_ARGS:-} > "$OUT/sweep_ag.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=1 timeout 300 python3 benchmarks/probes/sweep_kernels.py \
        --op rs --out "$OUT/sweep_rs.json" ${SWEEP_ARGS:-} > "$OUT/sweep_rs.log" 2>&1
      wait
      cat "$OUT/sweep_ag.log" "$OUT/sweep_rs.log" | grep -v "^   " ;;
    tails)
      timeout 300 python3 -m pytest -q -rs tests/gpu -k "tail_split" > "$OUT/tail_tests.log" 2>&1
      echo "tail tests rc=$?"; tail -5 "$OUT/tail_tests.log"
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/probes/sweep_kernels.py \
        --op rs-split --tail-splits "${TAIL_SPLITS:-1,4}" --tail-waves "${TAIL_WAVES:-1,2}" \
        --out "$OUT/sweep_rs_split.json" ${SWEEP_ARGS:-} > "$OUT/sweep_rs_split.log" 2>&1
      echo "rs-split sweep rc=$?"; cat "$OUT/sweep_rs_split.log"
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/probes/sweep_kernels.py \
        --op ag --quick --tail-splits "${TAIL_SPLITS:-1,4}" --tail-waves "${TAIL_WAVES:-1,2}" \
        --shapes "${TAIL_AG_SHAPES:-4096,8192,28672;4096,12288,49152;3072,8192,28672}" \
        --out "$OUT/sweep_ag_tails.json" ${SWEEP_ARGS:-} > "$OUT/sweep_ag_tails.log" 2>&1
      echo "ag sweep rc=$?"; cat "$OUT/sweep_ag_tails.log" ;;
    host)
      timeout 300 torchrun --nproc-per-node "$NPROC" benchmarks/probes/host_overhead.py \
        --out "$OUT/${TAG}_host_overhead.json" ${HOST_ARGS:-} > "$OUT/host_overhead.log" 2>&1
      echo "host rc=$?"; grep -v Warning "$OUT/host_overhead.log" | tail -c 9000 ;;
    trace)
      # TRACES: 'shape path [key=value ...]' entries separated by ';', the key=value words kernel-tuning fields;
      # TRACE_ARGS=--hide-host: device-time gaps only
      IFS=';' read -ra traces <<< "${TRACES:-rs:8192x8192x28672 fused}"
      i=0
      for t in "${traces[@]}"; do
        read -ra words <<< "$t"
        tuning_args=()
        if [ "${#words[@]}" -gt 2 ]; then tuning_args=(--tuning "$(IFS=,; echo "${words[*]:2}")"); fi
        timeout 120 torchrun --nproc-per-node "$NPROC" benchmarks/probes/trace_op.py --shape "${words[0]}" \
          --path "${words[1]}" ${tuning_args[@]+"${tuning_args[@]}"} ${TRACE_ARGS:-} --out "$OUT/${TAG}_trace_$i.json" \
          > "$OUT/trace_$i.log" 2>&1
        echo "trace $i ($t) rc=$?"; grep -v Warning "$OUT/trace_$i.log" | grep -E "^(---|  stream)" | head -"${TRACE_LINES:-60}"
        i=$((i+1))
      done ;;
    probe)
      timeout 240 torchrun --nproc-per-node "$NPROC" benchmarks/probes/probe_transport.py \
        --out "$OUT/${TAG}_transport.json" ${PROBE_ARGS:-} > "$OUT/probe_transport.log" 2>&1
      echo "probe rc=$?"; grep -v Warning "$OUT/probe_transport.log" | tail -30 ;;
    none) ;;
    *) echo "unknown step $step" ;;
  esac
done
# Pack the logs and JSON into one archive (a device call may bring back only a few files).
tar czf /tmp/results.tgz -C "$OUT" --exclude '*.so' . && \
  find "$OUT" -mindepth 1 ! -name '*.so' -delete && mv /tmp/results.tgz "$OUT/"
