#!/usr/bin/env bash
# One call on the GPU machine for this round's acceptance: build (with the machine's torch),
# every gpu ctest, the acceptance scripts and benchmarks of the issues, a short table last.
#   scripts/gpu_round.sh [build] [ctest] [multi] [tms] [drop_in] [rl] [optim] [diag] [megatron] [megatron_dp2]
#     [overlap] [filetier] [ckpt] [stress] [stress_bg] [stress_wait] [bench] [compare] [fp32pair] [wheel] [nccl]
#     [vmm_probe] [sib] [megatron_bench] [curves] [arena_loop]
#   (default: all but multi, diag, megatron_dp2, drop_in, rl, filetier, compare, fp32pair, wheel, nccl,
#   vmm_probe, sib, megatron_bench, curves and arena_loop: the two-GPU steps, the diagnostic, the torch_memory_saver drop-in's benchmark and RL
#   cycle, the file tier against the disk, the before/after comparisons, the wheel's build and check, the
#   footprint of single-rank NCCL communicators, the driver's VMM call costs (needs no build), the
#   diagnosis of the step inside Megatron's backward, the Megatron benchmark and its loss curves,
#   the preload arenas' contention loop).
#   sib: benchmarks/megatron/sib.py, why step_in_backward costs more than the plain step under
#   megatron-core (newest wheel of .whl/megatron/, in /tmp/site-mc; HybridModel 0.54 G params, host
#   tier): resident, plain, inside, inside_noclip, inside_keep (keep_window:1), inside_b160m (bucket
#   160 M), auto, inside_after (clip policy after), inside_nosync, plain_pg (overlap_param_gather),
#   inside_fwd and auto_fwd (step_overlap_forward: the step across the next forward), one process each, 12 iterations
#   (auto 16), medians of the last 8, beside the duplex pinned-copy bound; about 4-6 minutes after a
#   build of deferalloc deferalloc_optimizer: a table, $R/sib.json.  DFA_SIB_SECONDS (default 420)
#   bounds the step (variants that would not end in time are skipped), DFA_SIB_ARGS adds arguments
#   (e.g. "--variants plain,inside,inside_noclip").
#   megatron_bench: benchmarks/megatron/bench_megatron.py (same megatron-core as sib), the rows
#   DFA_MB_ROWS (default host: resident, hdo, plain/inside x fp32/bf16/int8 on the host tier, auto
#   resident_mb plain/inside, fwd x fp32/bf16/int8 (step_overlap_forward); file: the file-tier rows
#   and odirect_file, the synchronous O_DIRECT
#   baseline, 0.54 G model only; or row names) of one model
#   (DFA_MB_ARGS, e.g. "--model gqa1b", or "--repeat 3": the rows in three rounds, each comparison
#   beside the rounds' spread, or "--profile-rows fwd_int8_host": where that row's link idled, its
#   trace in the logs; default the 0.54 G model), one process each beside its bound
#   (duplex pinned copy, dd in /tmp); $R/megatron_bench_<model>_<rows>.json, one file per call, all
#   shown by plot.py.  DFA_MB_SECONDS (default 570) bounds the step (rows that would not end in time
#   are skipped: run the rest in another call).
#   curves: benchmarks/megatron/loss_curves.py (same megatron-core as sib): Megatron's own optimizer
#   and the host tier with fp32, bf16 and int8 moments, 200 steps each of a 21 M-param model on
#   train_gpt's --data pattern, one process each; fp32 bit-identical to Megatron's at every step,
#   bf16 / int8 within its tolerance; $R/megatron_loss_curves.json (plot.py draws the curves).
#   DFA_CURVES_SECONDS (default 570) bounds the step, DFA_CURVES_ARGS adds arguments (split at
#   spaces), DFA_CURVES_MODEL replaces the model (train_gpt.py's model options, one string).
#   DFA_STRESS_SECONDS sets the stress runs' length (default 60).
#   compare (and fp32pair) measure a build of .before/src.tar (git archive -o .before/src.tar BEFORE,
#   carried: carry [".before"]) against this tree's build (build compare), or, with
#   .before/after.tar beside it (git archive -o .before/after.tar AFTER), against that commit's
#   build (compare alone: neither side is this tree).
# Wheels the GPU machine lacks are installed from .whl/ (ignored by git) when it is there:
#   bash scripts/device_wheels.sh fetches them (what goes where: its header), then carry [".whl"].
# The device machine returns at most 8 files from $OUT, so $OUT holds three, refreshed after
# every step (a call cut at its time limit still brings back what ran): summary.txt (the
# table), logs.tar.gz, and results.tar.gz with the benchmarks' figures as <benchmark>.json
# (schema of benchmarks/bench_json.py: unpack into docs/data/<date>/ and run
# benchmarks/plot.py), their PNGs and the raw Google Benchmark JSON under gbench/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
L=$(mktemp -d)  # logs
R=$(mktemp -d)  # results: JSON and plots
pack() {
  tar -C "$L" -czf "$OUT/logs.tar.gz" . 2>/dev/null
  tar -C "$R" -czf "$OUT/results.tar.gz" . 2>/dev/null
}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build ctest tms optim megatron overlap ckpt stress bench)
has() { [[ " ${steps[*]} " == *" $1 "* ]]; }
B=${DFA_BUILD_DIR:-build-gpu}   # relative to the repository, or absolute (e.g. /tmp/dfa-build)
[[ $B = /* ]] || B=$PWD/$B
# bench_optimizer's rows of a round (bench) and of a before/after comparison (compare).
optbench_filter=${DFA_OPTBENCH_FILTER:-BM_pinned_duplex|BM_tier/host|BM_tier/device|BM_torch_fused}
summary=()
: > "$OUT/summary.txt"
row() { summary+=("$(printf '%-28s %s' "$1" "$2")"); printf '%-28s %s\n' "$1" "$2" >> "$OUT/summary.txt"; echo "== $1: $2"; pack; }
finish() {
  pack
  echo; echo "================ summary"; cat "$OUT/summary.txt"
}
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$L/gpu.txt" 2>&1
cat "$L/gpu.txt"
# The host beside the GPU (its CPUs and NUMA nodes): hosts of one GPU kind differ in what the
# CPU-side figures (HybridDeviceOptimizer, the training loop's launch rate) and the pinned
# copies reach.
{ lscpu; command -v numactl > /dev/null && numactl --hardware; nvidia-smi topo -m; } > "$L/host.txt" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$L/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} && site=/tmp/site
fi
# The pip_install test offline: scikit-build-core's wheels carried in .whl (scripts/pip_check.sh).
if ls .whl/scikit_build_core-*.whl >/dev/null 2>&1; then export DFA_PIP_FIND_LINKS=$PWD/.whl; fi
export DEFERALLOC_LIB=$B/allocator/libdeferalloc.so DEFERALLOC_OPTIMIZER_LIB=$B/optimizer/libdeferalloc_optimizer.so
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
run() {  # name, timeout seconds, command...
  local n=$1 t=$2; shift 2
  local s=$SECONDS
  timeout "$t" "$@" > "$L/$n.log" 2>&1
  local rc=$?
  local tail_line
  tail_line=$(grep -v '^\s*$' "$L/$n.log" | tail -1 | cut -c1-90)
  row "$n" "rc=$rc $((SECONDS - s))s | $tail_line"
  return $rc
}
if has build; then
  prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  # ctest's test_megatron_gpu_<part> run on the newest megatron-core of .whl/megatron/ (unpacked apart
  # from /tmp/site, so that the megatron step's per-version runs see only their own).
  mc_path=${site:-}
  newest=$(ls .whl/megatron/megatron_core-*.whl 2>/dev/null | sort -V | tail -1)
  if [ -n "$newest" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target /tmp/site-mc "$newest" > "$L/megatron-wheel.log" 2>&1; then
    mc_path=/tmp/site-mc
  fi
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DDEFERALLOC_BUILD_BENCHMARKS=ON \
        -DCMAKE_PREFIX_PATH="$prefix" -DDEFERALLOC_WITH_TORCH=ON -DDEFERALLOC_PYTHON="$(command -v python3)" \
        ${mc_path:+-DDEFERALLOC_MEGATRON_PATH=$mc_path} \
        > "$L/configure.log" 2>&1 || { tail -30 "$L/configure.log"; exit 1; }
  # DFA_BUILD_TARGETS: build only these (a short call), e.g. "bench_checkpoint".
  if ! cmake --build "$B" -j"$(nproc)" ${DFA_BUILD_TARGETS:+--target $DFA_BUILD_TARGETS} > "$L/build.log" 2>&1; then
    grep -E "error" "$L/build.log" | head -30; exit 1
  fi
  row build ok
fi
# The 10-minute C ABI stress across two calls (a call is limited to 10 minutes): stress_bg
# starts it in its own process session, which outlives the call while the machine is held
# (the next call must come within the idle release); stress_wait, in a later call without
# `build`, waits for it and reports.  Log and exit status under /tmp/dfa_stress.
if has stress_bg; then
  secs=${DFA_STRESS_SECONDS:-600}
  rm -rf /tmp/dfa_stress && mkdir -p /tmp/dfa_stress
  date +%s > /tmp/dfa_stress/start
  setsid bash -c "DEFERALLOC_CONF=driver:${DFA_STRESS_DRIVER:-cuda} DFA_STRESS_SECONDS=$secs timeout $((secs + 120)) $B/tests/test_c_api_stress \
      > /tmp/dfa_stress/c_api.log 2>&1; echo \$? > /tmp/dfa_stress/c_api.rc" < /dev/null > /dev/null 2>&1 &
  row stress_bg "started, $secs s"
fi
if has ctest; then
  # DFA_CTEST_ARGS picks a subset (a call is limited to 10 minutes on the device machine).
  # With two or more GPUs the selected tests are split into two shards balanced by their
  # usual duration, one ctest per GPU (CUDA_VISIBLE_DEVICES), run side by side: each test
  # still has a GPU to itself, so its memory figures mean what they mean on one GPU.
  read -r -a sel <<< "${DFA_CTEST_ARGS:--L gpu -LE multigpu}"
  # DFA_DEADLINE: seconds from the script's start by which the ctest step must end (a
  # call's limit is 600 s; later steps get what is left).
  cap=${DFA_CTEST_SECONDS:-540}
  [ -n "${DFA_DEADLINE:-}" ] && [ $((DFA_DEADLINE - SECONDS)) -lt "$cap" ] && cap=$((DFA_DEADLINE - SECONDS))
  ngpu=$(grep -c . "$L/gpu.txt")
  if [ "$ngpu" -ge 2 ] && [ -z "${DFA_CTEST_NOSHARD:-}" ]; then
    ctest --test-dir "$B" "${sel[@]}" -N > "$L/ctest-list.txt" 2>&1
    mapfile -t shard < <(python3 scripts/ctest_shards.py "$L/ctest-list.txt" 2)
    for k in 0 1; do
      [ -n "${shard[$k]:-}" ] || continue
      ( CUDA_VISIBLE_DEVICES=$k timeout "$cap" ctest --test-dir "$B" -R "${shard[$k]}" \
          --timeout 600 -j1 -V > "$L/ctest-gpu$k.log" 2>&1 ) &
    done
    wait
    cat "$L"/ctest-gpu[01].log > "$L/ctest-gpu.log" 2>/dev/null
    for k in 0 1; do
      [ -f "$L/ctest-gpu$k.log" ] && row "ctest ${sel[*]} (GPU $k)" "$(grep -E 'tests passed|tests failed' "$L/ctest-gpu$k.log" | tail -1)"
    done
  else
    timeout "$cap" ctest --test-dir "$B" "${sel[@]}" --timeout 600 -j1 -V > "$L/ctest-gpu.log" 2>&1
    row "ctest ${sel[*]}" "$(grep -E 'tests passed|tests failed' "$L/ctest-gpu.log" | tail -1)"
  fi
  grep -hE "^ *[0-9]+/[0-9]+ Test +#|\*\*\*" "$L/ctest-gpu.log" | sed 's/^ *//' | head -60
fi
if has multi; then
  # Two GPUs: ctest -L multigpu (test_distributed.nccl2, trainer_acceptance_ws2),
  # with NCCL's INFO output to see whether ncclCommRegister registers the VMM buffers.
  # test_megatron_dp2 (also labelled multigpu) runs in its own step, megatron_dp2.
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG run ctest_multigpu 540 ctest --test-dir "$B" -L multigpu -E test_megatron_dp2 \
    --timeout 600 -j1 -V
  grep -hE "^ *[0-9]+/[0-9]+ Test +#|\*\*\*" "$L/ctest_multigpu.log" | sed 's/^ *//'
  grep -hiE "regist" "$L/ctest_multigpu.log" | sed 's/^[0-9]*: //' | sort | uniq -c | sort -rn | head -12 > "$L/nccl_registration.txt"
  cat "$L/nccl_registration.txt"
fi
if has tms; then
  tms=$(ls .whl/torch_memory_saver-*.whl 2>/dev/null | head -1)
  run bench_tms 420 python3 benchmarks/pause_resume/bench_tms.py --build "$B" ${tms:+--tms-wheel $tms} \
    --json "$R/bench_tms.json"
  tail -14 "$L/bench_tms.log"
fi
# deferalloc.memory_saver (torch_memory_saver's API) against torch_memory_saver 0.0.10: 8 GiB in
# 512 tensors, both hook modes, CPU backup and discard (benchmarks/pause_resume/bench_drop_in.py).
# The preload arenas under contention on this machine's cores: tests/preload_arena_probe (its
# racing case (h) alone, `race N`) DFA_ARENA_LOOPS times (default 50) on the host driver and on
# CUDA, each run under a 120 s timeout; the first hang or failure stops its loop (after the
# build of preload_arena_probe). The row: runs passed per driver.
if has arena_loop; then
  for drv in host cuda; do
    conf="driver:$drv,pool_cache_mb:0"; [ "$drv" = host ] && conf="driver:host,host_granularity_kb:64,pool_cache_mb:0"
    ok=0; s=$SECONDS; n=${DFA_ARENA_LOOPS:-50}
    for i in $(seq "$n"); do
      if LD_PRELOAD=$B/allocator/libdeferalloc_preload.so DEFERALLOC_CONF=$conf timeout 120 \
           "$B/tests/preload_arena_probe" race 5 > "$L/arena_loop_$drv.log" 2>&1; then ok=$((ok + 1)); else
        echo "run $i rc=$?" >> "$L/arena_loop_$drv.log"; break; fi
    done
    row "arena_loop_$drv" "$ok of $n runs passed $((SECONDS - s))s"
  done
fi
if has drop_in; then
  tms=$(ls .whl/torch_memory_saver-*.whl 2>/dev/null | head -1)
  run bench_drop_in 420 python3 benchmarks/pause_resume/bench_drop_in.py --build "$B" ${tms:+--tms-wheel $tms} \
    --json "$R/bench_drop_in.json"
  tail -24 "$L/bench_drop_in.log"
fi
# The driver's own cost of a discard pause/resume of many VMM segments (benchmarks/pause_resume/
# vmm_cost_probe.cpp, CUDA driver API only, 10-30 s): cuMemCreate/Map/SetAccess/Unmap/Release per
# segment, one call over N adjacent mappings, one handle of the whole; the figures in
# $R/vmm_probe.json, one line a configuration (pause/resume ms) in the log, bench_drop_in's in a row.
if has vmm_probe; then
  probe=/tmp/vmm_cost_probe
  src=benchmarks/pause_resume/vmm_cost_probe.cpp
  if { { command -v nvcc && nvcc -O2 -o "$probe" $src -lcuda; } || g++ -O2 -std=c++17 -I/usr/local/cuda/include \
       -o "$probe" $src -L/usr/local/cuda/lib64/stubs -lcuda; } > "$L/vmm_probe_build.log" 2>&1; then
    run vmm_probe 120 "$probe" --json "$R/vmm_probe.json"
    python3 - "$R/vmm_probe.json" > "$L/vmm_probe_summary.txt" 2>&1 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
v, bad = {r["name"]: r["value"] for r in d["results"]}, d["extra"]["refused"]
short = {"one cuMemSetAccess over N mappings": "span setAccess", "one cuMemUnmap over N mappings": "span unmap",
         "cuMemUnmap of the first S of one N x S mapping": "part unmap"}
def ms(c, k):
    return next((f"{x:.3g}" for n, x in v.items() if n.startswith(f"{c}: {k}")), "-")
for c in dict.fromkeys(n.split(": ")[0] for n in [*v, *bad]):
    no = "; ".join(f"{short.get(n.split(': ')[1], n.split(': ')[1])} {e.replace('CUDA_ERROR_', '')}"
                   for n, e in bad.items() if n.startswith(c + ": "))
    print(f"{c} | pause/resume ms: today {ms(c, 'pause today')}/{ms(c, 'resume today')} | one range "
          f"{ms(c, 'pause, one range')}/{ms(c, 'resume, one range')} | one handle {ms(c, 'pause, one handle')}/"
          f"{ms(c, 'resume, one handle')} | refused: {no or 'none'}")
PY
    cat "$L/vmm_probe_summary.txt"
    row "vmm_probe 512 x 16 MiB" "$(grep -m1 '^8192 MiB = 512 x 16 MiB' "$L/vmm_probe_summary.txt" | cut -d'|' -f2-5)"
  else
    row vmm_probe "build failed: $(grep -m1 -i error "$L/vmm_probe_build.log" | cut -c1-80)"
  fi
fi
# The colocated RL cycle (examples/rl/check_cycle.py): a Megatron trainer (file tier) and a
# Hugging Face rollout process (CUDA graph) on the GPU, 5 RL steps each with
# deferalloc.memory_saver, with nobody sleeping, killed after step 3 + resumed, and with
# torch_memory_saver 0.0.10 (the real package, /tmp/site); the newest megatron-core of
# .whl/megatron/ (else the importable one).  About 3-4 minutes; the table last, the figures in
# $R/rl_cycle.json and a step's timeline in $R/rl_step.png.
if has nccl; then
  # What single-rank NCCL communicators hold outside every allocator (the RL trainer's "rest"),
  # and what gives it back: nccl_footprint.py's configurations, one process each (all by
  # default); DFA_NCCL_ARGS adds arguments, e.g. "--configs lazy,cumem0,destroy_recreate".
  run nccl 200 python3 benchmarks/pause_resume/nccl_footprint.py --json "$R/nccl_footprint.json" ${DFA_NCCL_ARGS:-}
  tail -40 "$L/nccl.log"
fi
if has rl; then
  rl_path=
  rl_mc=$(ls .whl/megatron/megatron_core-*.whl 2>/dev/null | sort -V | tail -1)
  if [ -n "$rl_mc" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target /tmp/site-rl "$rl_mc" > "$L/rl-wheel.log" 2>&1; then
    rl_path=/tmp/site-rl
  fi
  run rl 570 env CUBLAS_WORKSPACE_CONFIG=:4096:8 DEFERALLOC_CONF=driver:cuda \
    PYTHONPATH=${rl_path:+$rl_path:}$PYTHONPATH python3 examples/rl/check_cycle.py --device cuda \
    --json "$R/rl_cycle.json" --png "$R/rl_step.png" ${DFA_RL_ARGS:-}
  tail -48 "$L/rl.log"
fi
if has optim; then
  mc=$(ls .whl/megatron_core-*.whl 2>/dev/null | head -1)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 run optim_gpu 420 python3 tests/torch/test_optim_gpu.py ${mc:+--megatron-wheel $mc} \
    --json "$R/test_optim_gpu.json"
  tail -16 "$L/optim_gpu.log"
fi
if has diag; then  # StreamedAdamW vs torch's fused AdamW, element by element
  run diag_adamw 120 env DEFERALLOC_CONF=driver:cuda python3 tests/torch/diag_fused_adamw.py
  cat "$L/diag_adamw.log" | grep -v Warning | tail -14
fi
if has megatron && [ -f tests/torch/test_megatron_gpu.py ]; then
  # test_megatron_gpu's parts, DFA_MEGATRON_PARTS (default "exact file timing"; each part about
  # 2-3 minutes, so one or two parts to a 10-minute call; "all": the whole in one process, about
  # 7 minutes), each part once per megatron-core; the figures as JSON in
  # $R/test_megatron_gpu_<part>[_<version>].json (benchmarks/plot.py merges the parts' files by
  # name).  Each wheel in .whl/megatron/ (one per tested version, outside .whl/*.whl so that they
  # are not installed together) runs alone.  DFA_MEGATRON_VERSION=0.19.2 runs that one only.
  mcs=$(ls .whl/megatron/megatron_core-${DFA_MEGATRON_VERSION:-}*.whl 2>/dev/null)
  for part in ${DFA_MEGATRON_PARTS:-exact file timing}; do
    if [ -z "$mcs" ]; then
      CUBLAS_WORKSPACE_CONFIG=:4096:8 run "megatron_$part" 570 python3 tests/torch/test_megatron_gpu.py \
        --part "$part" --json "$R/test_megatron_gpu_$part.json" ${DFA_MEGATRON_ARGS:-}
      tail -24 "$L/megatron_$part.log"
    fi
    for w in $mcs; do
      v=$(basename "$w" | cut -d- -f2)
      CUBLAS_WORKSPACE_CONFIG=:4096:8 run "megatron_${part}_$v" 570 python3 tests/torch/test_megatron_gpu.py \
        --megatron-wheel "$w" --part "$part" --json "$R/test_megatron_gpu_${part}_$v.json" ${DFA_MEGATRON_ARGS:-}
      tail -24 "$L/megatron_${part}_$v.log"
    done
  done
fi
# A benchmark of benchmarks/megatron/ (sib, megatron_bench; the header says what runs) on the
# newest megatron-core of .whl/megatron/ first on the path (the build step unpacked it into
# /tmp/site-mc; unpacked here when this call did not build): step name, seconds, the line its
# table starts with, the script and its arguments.
megatron_script_step() {
  local n=$1 secs=$2 head=$3 mc
  shift 3
  mc=$(ls .whl/megatron/megatron_core-*.whl 2>/dev/null | sort -V | tail -1)
  if [ -n "$mc" ] && [ ! -d /tmp/site-mc/megatron/core ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-mc \
      "$mc" > "$L/$n-wheel.log" 2>&1
  fi
  if [ ! -f "$DEFERALLOC_OPTIMIZER_LIB" ]; then
    row "$n" "FAILED: no build in $B (run with build)"
    return
  fi
  CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=/tmp/site-mc:$PYTHONPATH run "$n" "$secs" python3 "$@"
  sed -n "/^$head/,\$p" "$L/$n.log"
}
if has sib; then
  ssecs=${DFA_SIB_SECONDS:-420}
  # shellcheck disable=SC2086
  megatron_script_step sib "$ssecs" "step inside backward diagnosis" benchmarks/megatron/sib.py \
    --json "$R/sib.json" --logs "$L/sib" --budget-s $((ssecs - 20)) ${DFA_SIB_ARGS:-}
fi
if has megatron_bench; then
  mbsecs=${DFA_MB_SECONDS:-570}
  # shellcheck disable=SC2086
  megatron_script_step megatron_bench "$mbsecs" "megatron bench:" benchmarks/megatron/bench_megatron.py \
    --rows "${DFA_MB_ROWS:-host}" --dir /tmp --json-dir "$R" --logs "$L/megatron_bench" \
    --budget-s $((mbsecs - 30)) ${DFA_MB_ARGS:-}
fi
if has curves; then
  csecs=${DFA_CURVES_SECONDS:-570}
  cmodel=()
  [ -n "${DFA_CURVES_MODEL:-}" ] && cmodel=(--model-args "$DFA_CURVES_MODEL")
  # shellcheck disable=SC2086
  megatron_script_step curves "$csecs" "megatron loss curves:" benchmarks/megatron/loss_curves.py \
    --json "$R/megatron_loss_curves.json" --logs "$L/curves" --budget-s $((csecs - 20)) "${cmodel[@]}" \
    ${DFA_CURVES_ARGS:-}
fi
if has megatron_dp2 && [ -f tests/torch/test_megatron_dp2.py ]; then
  # Two GPUs: six torchrun runs at data-parallel size 2 and 1 (about 3 minutes);
  # the figures as JSON in $R/test_megatron_dp2.json.
  CUBLAS_WORKSPACE_CONFIG=:4096:8 run megatron_dp2 480 python3 tests/torch/test_megatron_dp2.py \
    --json "$R/test_megatron_dp2.json" ${DFA_MEGATRON_DP2_ARGS:-}
  tail -16 "$L/megatron_dp2.log"
fi
if has overlap && [ -f benchmarks/optimizer/bench_overlap.py ]; then
  # --budget-s skips the modes that would not end in time, so that the table and JSON come
  # (DFA_OVERLAP_ARGS picks the parts; the file tier's figures are step filetier's).
  osecs=${DFA_OVERLAP_SECONDS:-420}
  CUBLAS_WORKSPACE_CONFIG=:4096:8 run overlap "$osecs" python3 benchmarks/optimizer/bench_overlap.py --out "$R" \
    --json "$R/bench_overlap.json" --budget-s $((osecs - 30)) ${DFA_OVERLAP_ARGS:-}
  tail -28 "$L/overlap.log"
fi
if has filetier; then
  # The file tier against the disk (benchmarks/optimizer/bench_file_tier.py): dd with direct I/O
  # on the step's bytes, the plain step with FP32 / BF16 / int8 moments, the overlap, and the
  # synchronous O_DIRECT baseline, 0.5 G params (about 6 GB each way per step, a 12 GB state
  # file) in DFA_FILETIER_DIR (default /tmp); about 3.5 minutes at 1.4 GB/s of disk.
  # --budget-s leaves out the rows that would not end in time, so that the table and JSON come.
  fsecs=${DFA_FILETIER_SECONDS:-300}
  if [ ! -f "$DEFERALLOC_OPTIMIZER_LIB" ]; then
    row filetier "FAILED: no build in $B (run with build)"
  else
    CUBLAS_WORKSPACE_CONFIG=:4096:8 run filetier "$fsecs" python3 benchmarks/optimizer/bench_file_tier.py \
      --dir "${DFA_FILETIER_DIR:-/tmp}" --json "$R/bench_file_tier.json" --budget-s $((fsecs - 30)) \
      ${DFA_FILETIER_ARGS:-}
    tail -40 "$L/filetier.log"
  fi
fi
if has ckpt && [ -x "$B"/benchmarks/bench_checkpoint ]; then
  # Ratios against dd on the same disk: write/read for the host tier, a copy for the file tier.
  run ckpt_host "${DFA_CKPT_SECONDS:-200}" "$B"/benchmarks/bench_checkpoint --driver cuda --tier host --gb 3 --dir /tmp \
    --json "$R/bench_checkpoint_host.json"
  tail -11 "$L/ckpt_host.log"
  run ckpt_file "${DFA_CKPT_SECONDS:-240}" "$B"/benchmarks/bench_checkpoint --driver cuda --tier file --gb 2 --dir /tmp \
    --json "$R/bench_checkpoint_file.json"
  tail -11 "$L/ckpt_file.log"
fi
if has wheel; then
  # The wheel built once here (pip wheel, offline: scikit-build-core from .whl/), installed into a
  # fresh venv with no nvcc on PATH: quick start, a StreamedAdamW step, a region pause / resume.
  # A wheel built elsewhere (the repaired manylinux wheel of scripts/wheel_check.sh's machine,
  # carried in an ignored folder) is checked as it is: DFA_WHEEL=.dist/deferalloc-....whl.
  if [ -n "${DFA_WHEEL:-}" ]; then
    w=$DFA_WHEEL
  else
    rm -rf /tmp/dfa-dist && mkdir -p /tmp/dfa-dist
    run wheel_build 420 python3 -m pip wheel . --no-deps --no-build-isolation --no-index -w /tmp/dfa-dist
    w=$(ls /tmp/dfa-dist/deferalloc-*.whl 2>/dev/null | head -1)
  fi
  if [ -n "$w" ]; then
    # torch from the machine's Python (the device image keeps it in a venv, not the system's).
    run wheel_check 240 env PYTHONPATH= bash scripts/wheel_check.sh "$w" /tmp/dfa-wheel-check "$(command -v python3)"
    tail -8 "$L/wheel_check.log"
  fi
fi
# tar_commit FILE: the commit a git archive tarball was made of (its pax header), else unknown.
tar_commit() {
  git get-tar-commit-id < "$1" 2> /dev/null || python3 -c '
import sys, tarfile
c = tarfile.open(sys.argv[1]).pax_headers.get("comment", "")
if not c:
  sys.exit(1)
print(c)' "$1" 2> /dev/null || echo unknown
}
# side_build STEP SIDE TAR SRC BLD: TAR unpacked into SRC, built in BLD with the libraries and the
# compared benchmarks (the options and target names of the build step, which older trees share).
# BLD is emptied unless it was built from the same commit: git archive gives every file the
# commit's time, so ninja would miss the files of a different commit that are older than BLD.
side_build() {
  local step=$1 side=$2 tar=$3 src=$4 bld=$5 id prefix b0=$SECONDS
  prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  id=$(tar_commit "$tar")
  if [ "$id" = unknown ] || [ "$(cat "$bld/.dfa-commit" 2> /dev/null)" != "$id" ]; then rm -rf "$bld"; fi
  rm -rf "$src" && mkdir -p "$src" "$bld" && tar -C "$src" -xf "$tar" &&
    cmake -S "$src" -B "$bld" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DDEFERALLOC_BUILD_BENCHMARKS=ON -DCMAKE_PREFIX_PATH="$prefix" -DDEFERALLOC_WITH_TORCH=ON \
      -DDEFERALLOC_PYTHON="$(command -v python3)" > "$L/$side-configure.log" 2>&1 &&
    cmake --build "$bld" -j"$(nproc)" --target deferalloc deferalloc_optimizer bench_reservations bench_optimizer \
      > "$L/$side-build.log" 2>&1 && echo "$id" > "$bld/.dfa-commit" &&
    row "$step: $side build" "ok $((SECONDS - b0)) s ($id)" && return 0
  row "$step: $side build" "FAILED (logs: $side-configure.log, $side-build.log)"
  return 1
}
if has fp32pair; then
  # StreamedAdamW's host-tier step with FP32 parameters, the before build (.before/src.tar,
  # carried as for compare; its libraries and Python package) and this tree's, alternating,
  # DFA_FP32_REPS times each (default 2), one JSON line per run in $R/fp32pair.jsonl.
  if [ ! -f .before/src.tar ]; then
    row fp32pair "no .before/src.tar (git archive -o .before/src.tar COMMIT, carried)"
  else
    BS=/tmp/dfa-before-src BB=${DFA_BEFORE_BUILD_DIR:-/tmp/dfa-before-build}
    side_build fp32pair before .before/src.tar $BS $BB &&
    for rep in $(seq 1 "${DFA_FP32_REPS:-2}"); do
      if [ $((rep % 2)) -eq 1 ]; then sides=(before after); else sides=(after before); fi
      for side in "${sides[@]}"; do
        if [ "$side" = before ]; then src=$BS bld=$BB; else src=$PWD bld=$B; fi
        DEFERALLOC_LIB=$bld/allocator/libdeferalloc.so DEFERALLOC_OPTIMIZER_LIB=$bld/optimizer/libdeferalloc_optimizer.so \
          PYTHONPATH=$src/python timeout 240 python3 benchmarks/optimizer/bench_fp32_params.py \
          ${DFA_FP32_ARGS:-} --label "$side-$rep" >> "$R/fp32pair.jsonl" 2>> "$L/fp32pair.log"
        row "fp32pair $side-$rep" "$(tail -1 "$R/fp32pair.jsonl" | cut -c1-160)"
      done
    done
  fi
fi
if has stress; then
  secs=${DFA_STRESS_SECONDS:-60}
  # Both at once on the one GPU (more contention, half the wall time).
  ( DFA_TEST_DRIVER=cuda DFA_STRESS_SECONDS=$secs timeout $((secs + 120)) "$B"/tests/test_caching_stress \
      > "$L/stress_caching.log" 2>&1; echo $? > "$L/stress_caching.rc" ) &
  DEFERALLOC_CONF=driver:cuda DFA_STRESS_SECONDS=$secs run stress_c_api $((secs + 120)) "$B"/tests/test_c_api_stress
  wait
  row stress_caching "rc=$(cat "$L/stress_caching.rc") | $(grep -v '^\s*$' "$L/stress_caching.log" | tail -1 | cut -c1-90)"
fi
if has stress_wait; then
  s0=$SECONDS
  while [ -d /tmp/dfa_stress ] && [ ! -f /tmp/dfa_stress/c_api.rc ] && [ $((SECONDS - s0)) -lt 560 ]; do sleep 5; done
  cp /tmp/dfa_stress/c_api.log "$L/stress_c_api_bg.log" 2>/dev/null
  el=$(( $(date +%s) - $(cat /tmp/dfa_stress/start 2>/dev/null || date +%s) ))
  row stress_c_api_bg "rc=$(cat /tmp/dfa_stress/c_api.rc 2>/dev/null || echo none) ${el}s since start | $(grep -h '\[stress\]' "$L/stress_c_api_bg.log" 2>/dev/null | tail -1 | cut -c1-150)"
fi
if has compare; then
  # A change that must not move the figures (a refactor): the same benchmarks on a build of the
  # "before" sources and on this tree, in one call, each benchmark's before and after runs side by
  # side (the order alternating from one repetition to the next) so that drift hits both;
  # benchmarks/compare_builds.py prints after / before per figure.
  # The before sources travel as an ignored file, carried with the call:
  #   mkdir -p .before && git archive -o .before/src.tar COMMIT      (run: carry [".before"])
  # With .before/after.tar beside it (git archive -o .before/after.tar COMMIT2) the after side is
  # that commit, not this tree: built the same way as the before side, its benchmarks, python/ and
  # bench_overlap.py run as the before side's are, and the build step is not needed.  This tree's
  # benchmarks/bench_json.py and compare_builds.py judge both sides.  The sides' commits (git
  # archive writes the commit id into the tarball) name them in compare_builds.json's extra.sides.
  # DFA_COMPARE_REPS (default 2) repetitions of DFA_COMPARE_BENCHES (default all three:
  # bench_reservations bench_optimizer bench_overlap; bench_reservations_host is bench_reservations
  # on the host driver, with no GPU visible); bench_reservations' VMM-bound rows spread
  # 14-42% from run to run, so each of its runs is DFA_COMPARE_GB_REPS (default 5) repetitions in
  # random order, read by their median (benchmarks/bench_json.py); DFA_COMPARE_OVERLAP_ARGS the
  # bench_overlap parts (default "--parts bound,split"); DFA_COMPARE_FIRST_REP numbers the
  # first repetition (a later call goes on from there, and so alternates the order).  A pair is
  # started only when it can end before DFA_COMPARE_DEADLINE seconds from the script's start
  # (default 570, a call being 600): a call then ends with what it measured instead of being cut.
  if [ ! -f .before/src.tar ]; then
    row compare "no .before/src.tar (git archive -o .before/src.tar COMMIT, carried)"
  elif bad=$(for g in ${DFA_COMPARE_BENCHES:-}; do
               case $g in bench_reservations|bench_reservations_host|bench_optimizer|bench_overlap) ;; *) echo "$g" ;; esac
             done) && [ -n "$bad" ]; then
    row compare "unknown in DFA_COMPARE_BENCHES: $bad (bench_reservations bench_reservations_host bench_optimizer bench_overlap)"
  elif [ ! -f .before/after.tar ] &&
       { [ ! -x "$B/benchmarks/bench_reservations" ] || [ ! -x "$B/benchmarks/bench_optimizer" ]; }; then
    # The machine went back since the build (30 s idle) or the build left the benchmarks out.
    row compare "no after build in $B (run with build, its targets including bench_reservations bench_optimizer)"
  else
    BS=/tmp/dfa-before-src BB=${DFA_BEFORE_BUILD_DIR:-/tmp/dfa-before-build}
    if [ -f .before/after.tar ]; then
      AS=/tmp/dfa-after-src AB=${DFA_AFTER_BUILD_DIR:-/tmp/dfa-after-build} after_id=$(tar_commit .before/after.tar)
    else
      AS=$PWD AB=$B after_id=$(git rev-parse HEAD 2> /dev/null)
      after_id="working tree${after_id:+ at $after_id}"
    fi
    before_id=$(tar_commit .before/src.tar)
    row "compare: sides" "before $before_id / after $after_id"
    if side_build compare before .before/src.tar $BS $BB &&
       { [ ! -f .before/after.tar ] || side_build compare after .before/after.tar $AS $AB; }; then
      mkdir -p "$R/compare"
      gpu=$(cut -d, -f1 "$L/gpu.txt" | head -1)
      oargs=${DFA_COMPARE_OVERLAP_ARGS-"--parts bound,split"}
      read -r -a benches <<< "${DFA_COMPARE_BENCHES:-bench_reservations bench_optimizer bench_overlap}"
      deadline=${DFA_COMPARE_DEADLINE:-570}
      # Seconds one run takes on the H200 (bench_reservations: about 28 s a repetition), raised to
      # a run's own time when one that succeeded took longer.
      declare -A took=([bench_reservations]=$((28 * ${DFA_COMPARE_GB_REPS:-5})) [bench_reservations_host]=60
                       [bench_optimizer]=50 [bench_overlap]=70)
      # cmp_run side rep benchmark: 0 measured, 1 failed (a row says so), 2 bench_overlap exited
      # nonzero with its JSON written (judged once both sides ran: kept_or_dropped).
      cmp_run() {
        local side=$1 rep=$2 g=$3 src bld extra
        if [ "$side" = before ]; then src=$BS bld=$BB; else src=$AS bld=$AB; fi
        if [ "$g" = bench_overlap ]; then
          local json=$R/compare/$side-$rep-bench_overlap.json
          # shellcheck disable=SC2086
          DEFERALLOC_LIB=$bld/allocator/libdeferalloc.so DEFERALLOC_OPTIMIZER_LIB=$bld/optimizer/libdeferalloc_optimizer.so \
            PYTHONPATH=$src/python${site:+:$site} CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 300 \
            python3 "$src/benchmarks/optimizer/bench_overlap.py" --out "$L/cmp-$side-$rep-overlap" \
            --json "$json" $oargs > "$L/cmp-$side-$rep-overlap.log" 2>&1 && return 0
          [ -f "$json" ] && return 2
          row "compare: $side-$rep $g" "failed, no pair: no JSON written (cmp-$side-$rep-overlap.log)"
          return 1
        fi
        local prog=$g env=() device=${gpu:-GPU} procs=1 tmo=240 k gbs=() ok=1 log=$L/cmp-$side-$rep-$g.log
        case $g in
          bench_reservations) extra=(--benchmark_min_time=0.3 "--benchmark_repetitions=${DFA_COMPARE_GB_REPS:-5}"
                                     --benchmark_enable_random_interleaving=true) ;;
          # The library's own share of the VMM-bound rows: the same program with no GPU visible runs
          # on the host driver, whose map and create cost little.  Its figures fall in modes about
          # 2x apart from one process to the next (either build), so it runs as five processes
          # read as one (bench_json.py convert; an odd count keeps the median a measured value):
          # their spread is then the build's own.
          bench_reservations_host) prog=bench_reservations env=(CUDA_VISIBLE_DEVICES=) procs=5 tmo=60
                                   device="$(nproc) CPUs of the GPU machine, host driver"
                                   extra=("--benchmark_filter=BM_materialize_release|BM_per_granule" --benchmark_min_time=0.3) ;;
          *) extra=("--benchmark_filter=$optbench_filter") ;;
        esac
        for k in $(seq "$procs"); do
          gbs+=("$L/cmp-$side-$rep-$g.p$k.gb.json")
          env "${env[@]}" timeout "$tmo" "$bld/benchmarks/$prog" "${extra[@]}" --benchmark_out="${gbs[-1]}" \
            --benchmark_out_format=json >> "$log" 2>&1 || { ok=0; break; }
        done
        [ $ok = 1 ] && python3 benchmarks/bench_json.py convert "${gbs[@]}" --name "$g" \
            --out "$R/compare/$side-$rep-$g.json" --device "$device" --command "$prog${env:+ ${env[*]}} ($side)" \
            > /dev/null 2>> "$log" && return 0
        row "compare: $side-$rep $g" "failed, no pair (cmp-$side-$rep-$g.log)"
        return 1
      }
      # A bench_overlap run that exited nonzero keeps its figures when it missed only performance
      # targets (bench_json.py missed; a check the before build's older script left unmarked takes
      # the after run's mark); a failed correctness check, a part cut short, or a nonzero exit
      # with no failed check makes no pair.
      kept_or_dropped() {  # side rep benchmark
        local json=$R/compare/$1-$2-$3.json other why
        if [ "$1" = before ]; then other=after; else other=before; fi
        if why=$(python3 benchmarks/bench_json.py missed "$json" --marks "$R/compare/$other-$2-$3.json") &&
           [ "$why" != none ]; then
          row "compare: $1-$2 $3" "figures kept, targets missed: $why"
        else
          rm -f "$json"
          row "compare: $1-$2 $3" "failed, no pair: ${why/#none/exited nonzero with no failed check} (cmp-$1-$2-overlap.log)"
        fi
      }
      pairs=() skipped=()
      first=${DFA_COMPARE_FIRST_REP:-1}
      for rep in $(seq "$first" $((first + ${DFA_COMPARE_REPS:-2} - 1))); do
        if [ $((rep % 2)) -eq 1 ]; then sides=(before after); else sides=(after before); fi
        for g in "${benches[@]}"; do
          if [ "$g" = bench_overlap ] && [ -z "$oargs" ]; then continue; fi
          if [ $((SECONDS + 2 * ${took[$g]:-120})) -gt "$deadline" ]; then skipped+=("$g#$rep"); continue; fi
          judge=()
          for side in "${sides[@]}"; do
            s0=$SECONDS
            cmp_run "$side" "$rep" "$g"
            case $? in
              0) [ $((SECONDS - s0)) -gt "${took[$g]}" ] && took[$g]=$((SECONDS - s0)) ;;
              2) judge+=("$side") ;;
            esac
          done
          for side in "${judge[@]}"; do kept_or_dropped "$side" "$rep" "$g"; done
          [ -f "$R/compare/before-$rep-$g.json" ] && [ -f "$R/compare/after-$rep-$g.json" ] &&
            pairs+=("$R/compare/before-$rep-$g.json" "$R/compare/after-$rep-$g.json")
          pack
        done
      done
      [ ${#skipped[@]} -gt 0 ] && row "compare: not started" "${skipped[*]} (deadline ${deadline} s)"
      if [ ${#pairs[@]} -eq 0 ]; then
        row compare "no pair measured (logs: cmp-*.log)"
      else
        python3 benchmarks/compare_builds.py "${pairs[@]}" --json "$R/compare_builds.json" --device "${gpu:-GPU}" \
          --before-label "$before_id" --after-label "$after_id" > "$L/compare.txt" 2>&1
        n=$((${#pairs[@]} / 2)); [ "$n" -eq 1 ] && w=pair || w=pairs
        row compare "$n $w | $(tail -1 "$L/compare.txt")"
        cat "$L/compare.txt"
      fi
    fi
  fi
fi
if has bench; then
  # Google Benchmark programs: reservations, the optimizer's tiers against the pinned-copy
  # bound and torch's fused AdamW, random allocations against PyTorch's caching allocator.
  declare -A bcmd=(
    [bench_reservations]="$B/benchmarks/bench_reservations --benchmark_min_time=0.3"
    [bench_optimizer]="$B/benchmarks/bench_optimizer --benchmark_filter=$optbench_filter"
    [bench_allocation]="$B/benchmarks/bench_allocation --benchmark_min_time=0.3")
  mkdir -p "$R/gbench"
  gpu=$(cut -d, -f1 "$L/gpu.txt" | head -1)
  for g in bench_reservations bench_optimizer bench_allocation; do
    [ -x "$B/benchmarks/$g" ] || continue
    read -r -a cmd <<< "${bcmd[$g]}"
    s0=$SECONDS
    timeout 300 "${cmd[@]}" --benchmark_out="$L/$g.json" --benchmark_out_format=json > "$L/$g.log" 2>&1
    row "$g" "rc=$? $((SECONDS - s0))s"
    # The raw JSON to $R/gbench/, the figures in the one schema to $R/<program>.json.
    cp "$L/$g.json" "$R/gbench/" 2>/dev/null &&
      python3 benchmarks/bench_json.py convert "$L/$g.json" --out "$R/$g.json" --device "${gpu:-GPU}" \
        --command "${bcmd[$g]} (scripts/gpu_round.sh bench)"
  done
  python3 benchmarks/report.py "$L"/bench_reservations.json "$L"/bench_optimizer.json > "$L/report.txt" 2>&1; cat "$L/report.txt"
  [ -f "$L/bench_allocation.json" ] && python3 benchmarks/allocation/report_allocation.py "$L/bench_allocation.json" | tee "$L/report_allocation.txt"
  pack
fi
