#!/bin/bash
# One device call (nvidia-h200-x2, or NPROC=4 on nvidia-h200-x4) that builds the extension, runs the GPU tests (single-GPU N-rank and
# 2-rank torchrun checks), the example on 2 GPUs and the op benchmark.  Everything lands in $OUT:
#   build.log, _C*.so, gpu_tests.log, example.log, bench_ops.log, h200x<N>_tp<N>_ops.{json,png},
#   tuning/<device>_tp<N>.json, bench_model.log, h200x<N>_tp<N>_model.json  (N = NPROC, default 2)
#   sweep: sweep_ag.{json,log} (GPU 0) and sweep_rs.{json,log} (GPU 1), kernel configurations vs cuBLAS
#   gtests (one GPU): the single-GPU tests.  tails (one GPU): tail_tests.log, sweep_rs_split.{json,log} (the split
#   GEMM+RS GEMMs) and sweep_ag_tails.{json,log}, tail split off / on, one or two waves
# Usage (device tool, carry [".whl"]):  GIT_SHA=<sha> STEPS="tests example bench" bash benchmarks/device_run.sh
# BENCH_SUFFIX names the bench step's JSON apart (an A/B of two settings in one call); step tailsab is the bench with
# both tail splits off (STEPS="bench tailsab" for that A/B).
# mbench: bench_ops on the Llama-style models' shapes (MODEL_SHAPES), into the same table as bench.
# pingab (TUNING=1): bench_ops with AG+GEMM's ping-pong tuning variant 5 vs the default.
# STEPS="none" only builds.  host: host cost per call of each dispatch path.  probe: NVLink transport probe.  dtests: only the multi-rank torchrun checks (NPROC ranks).  TUNING=1 builds the tuning variants too (CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON).
# The bench step merges its rows into a copy of the packaged cost-model table in $OUT/tuning, and the model step
# runs with that table (FLUXINDUCTOR_TUNING_DIR), so a bench of new shapes feeds the model run that follows.
set -u
export PYTHONUNBUFFERED=1 FLUXINDUCTOR_BUILD_JOBS=16 FLUXINDUCTOR_REQUIRE_EXTENSION=1
# The device copy's .git can lag the working tree it was given: results record GIT_SHA when it is set.
if [ -n "${GIT_SHA:-}" ]; then export FLUXINDUCTOR_GIT_SHA=$GIT_SHA; fi
OUT=${OUT:-/tmp/fluxinductor_out}
STEPS=${STEPS:-"tests example bench model"}
MODEL_SHAPES=${MODEL_SHAPES:-4096x8192x28672,4096x28672x8192,4096x8192x10240,4096x8192x57344,4096x8192x8192,4096x10240x8192,4096x57344x8192}
NPROC=${NPROC:-2}
TAG=h200x${NPROC}_tp${NPROC}
mkdir -p "$OUT/tuning"
cp fluxinductor/tuning/*.json "$OUT/tuning/"
if [ "${TUNING:-0}" = 1 ]; then export CMAKE_ARGS="${CMAKE_ARGS:-} -DFLUXINDUCTOR_KERNEL_TUNING=ON"; fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
if [ "$NPROC" -gt 2 ]; then nvidia-smi topo -m | head -8; fi
python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl
start=$(date +%s)
if [ -n "${PREBUILT:-}" ]; then
  # Reuse a carried extension built from the same csrc/ (PREBUILT=path/to/_C*.so).
  FLUXINDUCTOR_BUILD_EXTENSION=0 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
  cp "$PREBUILT" fluxinductor/
elif ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
so=$(python3 -c "import fluxinductor._C as c; print(c.__file__)") || exit 1
cp "$so" "$OUT/"
for step in $STEPS; do
  case $step in
    tests)
      { timeout 300 python3 -m pytest -q -rs tests/gpu -k "not torchrun"
        timeout 120 torchrun --nproc-per-node "$NPROC" tests/gpu/run_ag_gemm_2rank.py --calls 1000
        timeout 120 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py; } > "$OUT/gpu_tests.log" 2>&1
      grep -E "passed|failed|error|FAIL|OK|ok" "$OUT/gpu_tests.log" | tail -15 ;;
    dtests)
      { timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_ag_gemm_2rank.py --calls 1000
        timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py
        timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_dynamic_2rank.py; } > "$OUT/dist_tests.log" 2>&1
      grep -E "PASSED|FAIL|Error|error" "$OUT/dist_tests.log" | sort | uniq -c | tail -15 ;;
    example)
      timeout 240 torchrun --nproc-per-node "$NPROC" examples/sp_transformer_block.py > "$OUT/example.log" 2>&1
      echo "example rc=$?"; tail -25 "$OUT/example.log" ;;
    model)
      FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} FLUXINDUCTOR_TUNING_DIR=$OUT/tuning timeout ${MODEL_TIMEOUT:-330} torchrun --nproc-per-node "$NPROC" benchmarks/bench_model.py \
        --out "$OUT/${TAG}_model" --contender-timeout 120 ${MODEL_ARGS:-} > "$OUT/bench_model.log" 2>&1
      echo "bench_model rc=$?"; tail -c 5000 "$OUT/bench_model.log" ;;
    sweep)
      FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/sweep_kernels.py \
        --op ag --out "$OUT/sweep_ag.json" ${SWEEP_ARGS:-} > "$OUT/sweep_ag.log" 2>&1 &
      FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} CUDA_VISIBLE_DEVICES=1 timeout 300 python3 benchmarks/sweep_kernels.py \
        --op rs --out "$OUT/sweep_rs.json" ${SWEEP_ARGS:-} > "$OUT/sweep_rs.log" 2>&1
      wait
      cat "$OUT/sweep_ag.log" "$OUT/sweep_rs.log" | grep -v "^   " ;;
    split)
      # the split GEMM+RS transport: single-GPU two-rank simulation and the torchrun checks with it
      { timeout 300 python3 -m pytest -q -rs tests/gpu/test_gemm_rs.py -k "split or peer_never"
        timeout 150 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py --pushes split; } \
        > "$OUT/split_tests.log" 2>&1
      grep -E "passed|failed|error|Error|FAIL|all checks" "$OUT/split_tests.log" | tail -12 ;;
    gtests)
      # the single-GPU tests only (one GPU is enough; the torchrun checks need NPROC GPUs: step dtests)
      timeout ${GTESTS_TIMEOUT:-300} python3 -m pytest -q -rs tests/gpu -k "not torchrun" > "$OUT/gpu_tests.log" 2>&1
      echo "gpu tests rc=$?"; grep -E "passed|failed|FAIL|Error" "$OUT/gpu_tests.log" | tail -15 ;;
    tails)
      # the tail splits, one GPU is enough: their tests, then the GEMMs with communication off against cuBLAS, round-
      # robin, with the tail split off and on (TAIL_SPLITS) over one or two waves (TAIL_WAVES): the split GEMM+RS
      # transport's GEMMs on the default shapes, AG+GEMM on TAIL_AG_SHAPES
      timeout 300 python3 -m pytest -q -rs tests/gpu -k "tail_split" > "$OUT/tail_tests.log" 2>&1
      echo "tail tests rc=$?"; tail -5 "$OUT/tail_tests.log"
      FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/sweep_kernels.py \
        --op rs-split --tail-splits "${TAIL_SPLITS:-1,4}" --tail-waves "${TAIL_WAVES:-1,2}" \
        --out "$OUT/sweep_rs_split.json" ${SWEEP_ARGS:-} > "$OUT/sweep_rs_split.log" 2>&1
      echo "rs-split sweep rc=$?"; cat "$OUT/sweep_rs_split.log"
      FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/sweep_kernels.py \
        --op ag --quick --tail-splits "${TAIL_SPLITS:-1,4}" --tail-waves "${TAIL_WAVES:-1,2}" \
        --shapes "${TAIL_AG_SHAPES:-4096,8192,28672;4096,12288,49152;3072,8192,28672}" \
        --out "$OUT/sweep_ag_tails.json" ${SWEEP_ARGS:-} > "$OUT/sweep_ag_tails.log" 2>&1
      echo "ag sweep rc=$?"; cat "$OUT/sweep_ag_tails.log" ;;
    rstests)
      timeout 300 python3 -m pytest -q -rs tests/gpu/test_gemm_rs.py -k "tuning or n_ranks or gemm_only or copy_engine or peer_never" \
        > "$OUT/rstests.log" 2>&1; echo "rstests rc=$?"; tail -5 "$OUT/rstests.log" ;;
    rsbench)
      # fused GEMM+RS per kernel variant on NPROC ranks (RS_CONFIGS: 'config,swizzle,raster[,push=..][,bands=..];...')
      timeout 300 torchrun --nproc-per-node "$NPROC" tests/gpu/run_gemm_rs_2rank.py --skip-checks --bench \
        --configs "${RS_CONFIGS:-0,4,2;6,4,2}" ${RS_SHAPES:+--shapes "$RS_SHAPES"} \
        --json "$OUT/rs_configs_tp${NPROC}.json" > "$OUT/rsbench_tp${NPROC}.log" 2>&1
      echo "rsbench rc=$?"; grep -v Warning "$OUT/rsbench_tp${NPROC}.log" | tail -30 | cut -c1-400 ;;
    host)
      # host cost per call of each dispatch path (benchmarks/host_overhead.py)
      timeout 300 torchrun --nproc-per-node "$NPROC" benchmarks/host_overhead.py --out "$OUT/${TAG}_host_overhead.json" \
        ${HOST_ARGS:-} > "$OUT/host_overhead.log" 2>&1
      echo "host rc=$?"; grep -v Warning "$OUT/host_overhead.log" | tail -c 9000 ;;
    trace)
      # GPU timeline of one call per TRACES entry ('shape path [K=V ...]' separated by ';'; benchmarks/trace_op.py;
      # TRACE_ARGS=--hide-host: device-time gaps only)
      IFS=';' read -ra traces <<< "${TRACES:-rs:8192x8192x28672 fused}"
      i=0
      for t in "${traces[@]}"; do
        read -ra words <<< "$t"; envs=()
        for w in "${words[@]:2}"; do envs+=(--env "$w"); done
        timeout 120 torchrun --nproc-per-node "$NPROC" benchmarks/trace_op.py --shape "${words[0]}" \
          --path "${words[1]}" "${envs[@]}" ${TRACE_ARGS:-} --out "$OUT/${TAG}_trace_$i.json" > "$OUT/trace_$i.log" 2>&1
        echo "trace $i ($t) rc=$?"; grep -v Warning "$OUT/trace_$i.log" | grep -E "^(---|  stream)" | head -${TRACE_LINES:-60}
        i=$((i+1))
      done ;;
    probe)
      # NVLink transport probe: copy engine / SM, push / pull, alone and beside a GEMM (benchmarks/probe_transport.py)
      timeout 240 torchrun --nproc-per-node "$NPROC" benchmarks/probe_transport.py --out "$OUT/${TAG}_transport.json" \
        ${PROBE_ARGS:-} > "$OUT/probe_transport.log" 2>&1
      echo "probe rc=$?"; grep -v Warning "$OUT/probe_transport.log" | tail -30 ;;
    tailsab)
      # the op benchmark with both tail splits off (FLUXINDUCTOR_AG_TAIL_SPLIT=1, FLUXINDUCTOR_GEMM_RS_TAIL_SPLIT=1), to
      # set beside a bench step's run with the defaults; it writes no tuning table
      FLUXINDUCTOR_AG_TAIL_SPLIT=1 FLUXINDUCTOR_GEMM_RS_TAIL_SPLIT=1 FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} \
        FLUXINDUCTOR_TUNING_DIR=$OUT/tuning timeout ${BENCH_TIMEOUT:-420} torchrun --nproc-per-node "$NPROC" \
        benchmarks/bench_ops.py --out "$OUT/${TAG}_ops_tails_off" ${BENCH_ARGS:-} > "$OUT/bench_ops_tails_off.log" 2>&1
      echo "bench (tail splits off) rc=$?"; tail -c 6000 "$OUT/bench_ops_tails_off.log" ;;
    pingab)
      # TUNING=1 builds: AG+GEMM with the ping-pong 128x192 tuning variant (5) against the default (0), communication
      # on and off, one bench_ops run per variant.  (The split GEMM+RS configurations are bench_ops contenders now:
      # fused_split / fused_split2, split_nocomm / split2_nocomm.)
      for variant in 0 5; do
        FLUXINDUCTOR_AG_VARIANT=$variant FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} \
          timeout ${PINGAB_TIMEOUT:-170} torchrun --nproc-per-node "$NPROC" benchmarks/bench_ops.py \
          --out "$OUT/${TAG}_pingab_ag$variant" --ops ag_gemm --contenders gemm,fused_nocomm,fused \
          ${PINGAB_ARGS:-} > "$OUT/pingab_ag$variant.log" 2>&1
        echo "pingab AG variant $variant: rc=$?"; grep -v Warning "$OUT/pingab_ag$variant.log" | tail -12
      done ;;
    mbench)
      # the op benchmark on the models' shapes (MODEL_SHAPES), its rows merged into the same table as bench's
      FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} FLUXINDUCTOR_TUNING_DIR=$OUT/tuning timeout ${BENCH_TIMEOUT:-420} \
        torchrun --nproc-per-node "$NPROC" benchmarks/bench_ops.py --out "$OUT/${TAG}_ops_model_shapes${BENCH_SUFFIX:-}" \
        --emit-tuning "$OUT/tuning/{device_key}_tp{world}.json" --shapes "$MODEL_SHAPES" --no-plot ${BENCH_ARGS:-} \
        > "$OUT/bench_ops_model_shapes.log" 2>&1
      echo "bench (model shapes) rc=$?"; tail -c 4000 "$OUT/bench_ops_model_shapes.log" ;;
    bench)
      FLUXINDUCTOR_GIT_SHA=${GIT_SHA:-unknown} FLUXINDUCTOR_TUNING_DIR=$OUT/tuning timeout ${BENCH_TIMEOUT:-420} \
        torchrun --nproc-per-node "$NPROC" benchmarks/bench_ops.py --out "$OUT/${TAG}_ops${BENCH_SUFFIX:-}" \
        --emit-tuning "$OUT/tuning/{device_key}_tp{world}.json" ${BENCH_ARGS:-} > "$OUT/bench_ops.log" 2>&1
      echo "bench rc=$?"; tail -c 6000 "$OUT/bench_ops.log" ;;
  esac
done
# The device tool brings back only a few files: pack the logs and JSON into one archive.
tar czf /tmp/results.tgz -C "$OUT" --exclude '*.so' . && \
  find "$OUT" -mindepth 1 ! -name '*.so' -delete && mv /tmp/results.tgz "$OUT/"
