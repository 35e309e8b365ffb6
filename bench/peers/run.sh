#!/usr/bin/env bash
# bench/peers/run.sh: forksafe against torch.multiprocessing and Python's multiprocessing, side by
# side, in one command (docs/peers.md), and forksafe's Python package against torch's, Python
# against Python:
#
#   bash bench/peers/run.sh
#
# 1. installs what is missing (python3-torch, python3-numpy, python3-matplotlib, via apt-get);
# 2. builds //bench/peers:peers_forksafe, :peers_forksafe_openmp, :peers_floor and
#    //:libforksafe.so with bazel (-c opt, from .bazelrc);
# 3. records the machine;
# 4. runs ROUNDS rounds (default 3). Each round: the floor, then the three systems in an order
#    that rotates from round to round (forksafe, torch, mp / torch, mp, forksafe / ...), then
#    workloads 1 and 2 again with the processes pinned (both on one CPU; then on two CPUs, apart), then
#    forksafe's breakdowns. Every
#    program prints JSON lines (collected in bench/peers/out/results.jsonl) and progress on
#    stderr;
# 5. writes bench/peers/results.md (table), results.json (per-round medians) and latency.png.
#
# Environment: PEERS_ROUNDS (default 3), PEERS_PLAN (default bench/peers/plan.txt), PEERS_ONLY (comma-separated workload prefixes, for a
# partial run: then results go to bench/peers/out/ only, the committed files stay).
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=bench/peers
OUT=$PEERS/out
PY=/usr/bin/python3  # Debian's interpreter, where python3-torch lives (not a pyenv python)
ROUNDS=${PEERS_ROUNDS:-3}
PLAN=${PEERS_PLAN:-$PEERS/plan.txt}
ONLY=${PEERS_ONLY:-}
T0=$(date +%s)
log() { printf '[peers %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }

# ---- 1. dependencies ------------------------------------------------------------------------------
missing=()
$PY -c 'import torch' 2>/dev/null || missing+=(python3-torch)
$PY -c 'import numpy' 2>/dev/null || missing+=(python3-numpy)
$PY -c 'import matplotlib' 2>/dev/null || missing+=(python3-matplotlib)
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  log "installing ${missing[*]} (apt-get)"
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}"; then
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
  fi
fi
command -v taskset >/dev/null || { log "taskset (util-linux) is needed"; exit 1; }

# ---- 2. build -----------------------------------------------------------------------------------------
log "building //bench/peers:peers_forksafe, :peers_forksafe_openmp, :peers_floor, //:libforksafe.so"
bazel build //bench/peers:peers_forksafe //bench/peers:peers_forksafe_openmp \
  //bench/peers:peers_floor //:libforksafe.so //python:_forksafe.so //mp:forksafe-shm-manager
BIN=$(bazel info bazel-bin 2>/dev/null)
rm -rf "$OUT"
mkdir -p "$OUT/bin"
# A private copy: another bazel command in this checkout may rebuild or relink meanwhile.
cp "$BIN/bench/peers/peers_forksafe" "$BIN/bench/peers/peers_forksafe_openmp" \
  "$BIN/bench/peers/peers_floor" "$BIN/libforksafe.so" "$OUT/bin/"
# forksafe.multiprocessing, the Python column (peers_torch.py with PEERS_PY_SYSTEM=forksafe_py):
# the package assembled as tools/python_package.sh does, from the same build.
bash python/assemble_package.sh "$OUT/pypkg" "$BIN/python/_forksafe.so" "$BIN/libforksafe.so" \
  "$BIN/mp/forksafe-shm-manager"
# torch's workload 6 has a variant with forksafe loaded into the interpreter (peers_torch.py).
export PEERS_FORKSAFE_LIB="$PWD/$OUT/bin/libforksafe.so"
T_BUILD=$(( $(date +%s) - T0 ))
log "built in ${T_BUILD}s"

# ---- 3. the machine -------------------------------------------------------------------------------
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
machine() {
  $PY - "$@" <<'EOF'
import json, os, platform, re, subprocess, sys
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except Exception:
        return "?"
import numpy, torch
cpu = re.search(r"model name\s*:\s*(.*)", open("/proc/cpuinfo").read())
mem = int(re.search(r"MemTotal:\s*(\d+)", open("/proc/meminfo").read()).group(1)) // (1 << 20)
blas = sh("readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3")
d = dict(
    date=sh("date -u '+%Y-%m-%d %H:%M UTC'"), cpus=os.cpu_count(),
    cpu_model=cpu.group(1) if cpu else "?", mem_gib=mem, kernel=platform.release(),
    os=sh(". /etc/os-release && echo $PRETTY_NAME"),
    gxx=sh("g++ -dumpfullversion"),
    bazel=sh("dpkg-query -W -f='${Version}' bazel-bootstrap 2>/dev/null") or sh("bazel --version"),
    python=platform.python_version(), torch=torch.__version__,
    torch_deb=sh("dpkg-query -W -f='${Version}' python3-torch"), numpy=numpy.__version__,
    blas=os.path.basename(os.path.dirname(blas)) + "/" + os.path.basename(blas),
    commit=sh("git rev-parse --short HEAD") + (" + uncommitted changes" if sh("git status --porcelain") else ""),
)
d.update(json.loads(sys.argv[1]))
print(json.dumps(d, indent=1))
EOF
}

# ---- 4. rounds ----------------------------------------------------------------------------------------
RESULTS=$OUT/results.jsonl
: > "$RESULTS"
run() {  # run NAME TIMEOUT_S COMMAND...: appends its JSON lines; a failure is logged, not fatal
  local name=$1 limit=$2
  shift 2
  local rc=0
  timeout --kill-after=10 "$limit" "$@" >> "$RESULTS" || rc=$?
  if [ "$rc" != 0 ]; then
    log "$name exited with $rc (124: over its ${limit}s limit); its finished workloads are kept"
    printf '{"system": "%s", "round": %d, "workload": "run", "param": "", "error": "exit %d"}\n' \
      "$name" "$ROUND" "$rc" >> "$RESULTS"
  fi
}
system_cmd() {  # the command line of one system
  case $1 in
    floor) echo "$OUT/bin/peers_floor" ;;
    forksafe) echo "$OUT/bin/peers_forksafe" ;;
    torch) echo "$PY $PEERS/peers_torch.py" ;;
    mp) echo "$PY $PEERS/peers_mp.py" ;;
    forksafe_py) echo "env PYTHONPATH=$PWD/$OUT/pypkg PEERS_PY_SYSTEM=forksafe_py $PY $PEERS/peers_torch.py" ;;
  esac
}
SYSTEMS=(forksafe torch mp forksafe_py)
T_MEASURE=$(date +%s)
for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
  order=()
  for ((k = 0; k < ${#SYSTEMS[@]}; k++)); do
    order+=("${SYSTEMS[$(( (ROUND - 1 + k) % ${#SYSTEMS[@]} ))]}")
  done
  log "round $ROUND/$ROUNDS: floor, ${order[*]}, then workloads 1-2 pinned, then breakdowns"
  args=(--round "$ROUND" --plan "$PLAN")
  only=()
  [ -n "$ONLY" ] && only=(--only "$ONLY")
  run floor 60 $(system_cmd floor) "${args[@]}" "${only[@]}"
  for s in "${order[@]}"; do
    # The ping-pong again right before each system, so that the floor is sampled as often, and
    # under the same neighbours, as the systems are.
    run floor 30 $(system_cmd floor) "${args[@]}" --only floor_pingpong,floor_futex_pingpong
    log "round $ROUND: $s"
    run "$s" 240 $(system_cmd "$s") "${args[@]}" "${only[@]}"
    if [ "$s" = forksafe ]; then
      # Workload 6 with an OpenMP pool: a program of its own (libgomp stays out of the others).
      run forksafe 60 "$OUT/bin/peers_forksafe_openmp" "${args[@]}" "${only[@]}"
    fi
  done
  if [ -z "$ONLY" ] || [[ ",$ONLY," == *",w1"* || ",$ONLY," == *",w2"* ]]; then
    log "round $ROUND: workloads 1 and 2 with the processes pinned (same CPU, then apart)"
    # Where the two processes of a round trip run decides what a wake-up costs (docs/peers.md),
    # and unpinned that changes from run to run: measure both placements deterministically.
    # [1 CPU]: both on CPU 0. [2 CPUs apart]: the parent on CPU 0, the child on CPU 1.
    for placement in "1 CPU" "2 CPUs apart"; do
      child_cpu=""
      [ "$placement" = "2 CPUs apart" ] && child_cpu=1
      PEERS_CHILD_CPU=$child_cpu run floor 30 taskset -c 0 $(system_cmd floor) "${args[@]}" \
        --only floor_pingpong,floor_futex_pingpong --suffix " [$placement]"
      for s in "${order[@]}"; do
        # w2_create_send is not repeated pinned: its creation and fill, not a wake-up, decide it.
        w1only=w1,w2_fresh
        [ "$s" = forksafe ] && w1only=w1,w2_fresh,bd_queue_string
        PEERS_CHILD_CPU=$child_cpu run "$s" 60 taskset -c 0 $(system_cmd "$s") "${args[@]}" \
          --only "$w1only" --suffix " [$placement]"
      done
    done
  fi
  if [ -z "$ONLY" ] || [[ ",$ONLY," == *",bd"* ]]; then
    log "round $ROUND: forksafe breakdowns"
    run forksafe 120 $(system_cmd forksafe) "${args[@]}" --only bd
  fi
done
T_MEASURED=$(( $(date +%s) - T_MEASURE ))

# ---- 5. table and chart -----------------------------------------------------------------------------
extra=$(printf '{"rounds": %d, "measure_s": %d, "build_s": %d, "load_start": "%s", "load_end": "%s"}' \
  "$ROUNDS" "$T_MEASURED" "$T_BUILD" "$LOAD_START" "$(cut -d' ' -f1-3 /proc/loadavg)")
machine "$extra" > "$OUT/machine.json"
if [ -z "$ONLY" ]; then
  dest=(--md "$PEERS/results.md" --json "$PEERS/results.json" --png "$PEERS/latency.png")
else
  dest=(--md "$OUT/results.md" --json "$OUT/results.json" --png "$OUT/latency.png")
fi
$PY "$PEERS/aggregate.py" "$RESULTS" "$OUT/machine.json" "${dest[@]}"
log "done in $(( $(date +%s) - T0 ))s (build ${T_BUILD}s, measuring ${T_MEASURED}s); wrote ${dest[*]}"
