#!/usr/bin/env bash
# Every CUDA check in one command, for a machine with an NVIDIA GPU:
#   bash tests/gpu/run.sh            (the log and the JSON results, packed, under $OUT, default ./gpu-out)
#   GPU_PARTS="gpu-tests engine" bash tests/gpu/run.sh   (only those parts)
# The GPU tests, then the benchmarks of issue #33: the bundled model (AR, every K, adaptive;
# the context's drafts and both sources chosen live, #29, on held-out and editing prompts;
# 1 and 3 slots), the real-shape presets' steps, the language server and the pipeline on CUDA,
# and `ahead serve` to the first suggestion with a cold and a warm compile cache.
# Each part has its own time limit, so one that hangs does not cost the rest; the summary at
# the end says which passed. Wheels in .whl/ (what the machine lacks) are installed first;
# for the GPU image's Python 3.12 they come from (then `carry` .whl with the device tool):
#   pip download -d .whl --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
#     --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#     msgspec pygls lsprotocol cattrs watchfiles pytest-asyncio pytest-lsp
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
JSON=$OUT/json  # packed into $OUT/json.tar.gz at the end: the device tool returns 8 files
mkdir -p "$OUT" "$JSON"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# A cache of our own: the cold runs below are really cold.
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/ahead-cache} XDG_RUNTIME_DIR=/tmp/ahead-run \
    XDG_STATE_HOME=/tmp/ahead-state
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
AHEAD="python3 -m clients.cli"
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
SUMMARY=()
END=$(( $(date +%s) + ${GPU_RUN_SECONDS:-900} ))  # the whole run's budget
part() {  # part NAME SECONDS COMMAND...: run one check with a limit, its output in the log
    local name=$1 limit=$2 t0 rc left; shift 2
    [[ -n ${GPU_PARTS:-} && " $GPU_PARTS " != *" $name "* ]] && return  # GPU_PARTS="a b": those
    left=$(( END - $(date +%s) ))
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then SUMMARY+=("$(printf '%-22s skipped: out of time' "$name")"); return; fi
    echo "=== $name ($(date +%T), limit ${limit}s): $*"
    t0=$EPOCHREALTIME
    timeout -k 5 "$limit" "$@"; rc=$?
    SUMMARY+=("$(printf '%-22s rc=%-3s %6.1fs' "$name" "$rc" "$(since "$t0")")")
}
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
first() {  # `ahead serve` to the first suggestion, with the compile caches of /tmp/serve-cache
    python3 -m clients.cli stop
    local s=$EPOCHREALTIME
    XDG_CACHE_HOME=/tmp/serve-cache TRITON_CACHE_DIR=/tmp/serve-cache/triton \
        python3 -m clients.cli generate "def fibonacci(n):" --device cuda --stats
    local rc=$?
    echo "serve to first suggestion, $1: $(since "$s") s"
    python3 -m clients.cli status --json | python3 -c "import json, sys; d = json.load(sys.stdin)
print({k: d.get(k) for k in ('step', 'exact', 'quant', 'load_s')})"  # where loading went
    return $rc
}
export -f first since
# What the last run (H200) did not reach or measure first, then what a user meets first (the
# bundled model, serve to a suggestion), then the rest (docs/benchmarks.md, "On a GPU").
# Real-shape presets compile each kind of block once (7 s and 13 s on the H200, where their
# whole steps outlasted 76 s and 107 s on the H100); the same presets over eager kernels in
# the graphs (`--compile off`: 1,614 kernels a Qwen2-1.5B step, 2x slower) come last.
part gpu-tests 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py
part qwen2-1.5b 80 $AHEAD bench engine --preset qwen2-1.5b --device cuda --dtype bf16 \
    --synthetic-acceptance 0.9,0.8,0.7 --json "$JSON/qwen2.json"
part qwen3.5-2b 120 $AHEAD bench engine --preset qwen3.5-2b --device cuda --dtype bf16 \
    --synthetic-acceptance 0.9,0.8,0.7 --json "$JSON/qwen35.json"
part profile 70 python3 tests/gpu/profile_step.py --preset qwen2-1.5b
part engine 80 $AHEAD bench engine --device cuda --dtype bf16 --num-prompts 12 --json "$JSON/engine.json"
part serve-cold 150 bash -c "first cold"
part serve-warm 90 bash -c "first warm"
part engine-slots3 100 $AHEAD bench engine --device cuda --dtype bf16 --num-prompts 12 --slots 3 --json "$JSON/slots3.json"
part lsp 40 $AHEAD bench lsp --json "$JSON/lsp.json"
part pipeline 45 $AHEAD bench pipeline --json "$JSON/pipeline.json"
part qwen2-1.5b-int4 70 $AHEAD bench engine --preset qwen2-1.5b --device cuda --dtype bf16 \
    --quant int4 --synthetic-acceptance 0.9,0.8,0.7 --json "$JSON/qwen2-int4.json"
part engine-edit 90 $AHEAD bench engine --device cuda --dtype bf16 --num-prompts 12 --ks 8 \
    --workload edit --json "$JSON/engine-edit.json"
part qwen2-1.5b-eager 60 $AHEAD bench engine --preset qwen2-1.5b --device cuda --dtype bf16 \
    --compile off --synthetic-acceptance 0.9,0.8,0.7 --json "$JSON/qwen2-eager.json"
part qwen3.5-2b-eager 120 $AHEAD bench engine --preset qwen3.5-2b --device cuda --dtype bf16 \
    --compile off --synthetic-acceptance 0.9,0.8,0.7 --json "$JSON/qwen35-eager.json"
$AHEAD stop
cp "$XDG_STATE_HOME"/ahead/daemon.log "$JSON/" 2>/dev/null  # where the daemon's time went
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
} 2>&1 | tee "$JSON/log.txt"
