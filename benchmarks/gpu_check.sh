#!/usr/bin/env bash
# make gpu-check: tierfs on one CUDA GPU, within 8 minutes. Uses the machine's python3 and its torch as they
# are: builds no .venv, installs nothing from the network and does not install tierfs (the repository root
# goes on PYTHONPATH). The one dependency a bare torch environment lacks, fastcrc, is unpacked from the wheel
# in benchmarks/wheels/ into a temporary directory when `import fastcrc` fails (without orjson, tierfs
# writes and reads its manifests with Python's json).
#
# Runs the gpu-marked tests (tests/test_gpu.py), then benchmarks/bench_gpu.py (even when the tests failed),
# and writes into $GPU_CHECK_OUT (default benchmarks/results/) at most 5 files, gpu_check-<stamp>-*:
#   -env.txt      the device (nvidia-smi), driver, torch, CUDA, python and git commit
#   -pytest.log   the tests' output
#   -bench.log    the benchmark's output; it writes bench_gpu-<stamp>.md and .json beside it
# Exit status: 0 when the tests passed and the benchmark ran; 1 when either failed (or the tests are
# missing); 2 without a CUDA device ("no CUDA device: gpu-check needs one") or without an importable tierfs.
#
# Environment: GPU_CHECK_OUT (results folder); GPU_CHECK_PYTHON (default: the first of python3,
# /opt/torch/.venv/bin/python3 and an existing .venv/bin/python that imports torch); GPU_CHECK_COMMIT (the
# commit to record where the copy has no .git); GPU_CHECK_BUDGET_S (seconds for everything, default 450);
# GPU_CHECK_BENCH_ARGS (more arguments for bench_gpu.py, e.g. "--shm /mnt/tmpfs" where /dev/shm is small).
# GPU_CHECK_DRY_RUN=1 checks this script on a machine without CUDA: no device needed, the benchmark runs
# with --cpu-dry-run (its figures mean nothing about a GPU).
set -u
cd "$(dirname "$0")/.."
start=$SECONDS
budget=${GPU_CHECK_BUDGET_S:-450}
out=${GPU_CHECK_OUT:-benchmarks/results}
dry=${GPU_CHECK_DRY_RUN:-0}

say() { echo "gpu-check: $*" >&2; }
left() { echo $((budget - (SECONDS - start))); }
cap() {  # the smaller of $1 seconds and what is left of the budget (at least 1)
    local l
    l=$(left)
    if ((l < $1)); then set -- "$l"; fi
    if (($1 < 1)); then set -- 1; fi
    echo "$1"
}

# -- python, CUDA --------------------------------------------------------------------------------------
py=
for c in ${GPU_CHECK_PYTHON:-python3 /opt/torch/.venv/bin/python3 .venv/bin/python}; do
    if timeout "$(cap 60)" "$c" -c 'import torch' 2>/dev/null; then
        py=$c
        break
    fi
done
if [ -z "$py" ]; then
    echo "no CUDA device: gpu-check needs one (and no python here imports torch: tried" \
        "${GPU_CHECK_PYTHON:-python3, /opt/torch/.venv/bin/python3, .venv/bin/python}; set GPU_CHECK_PYTHON)" >&2
    exit 2
fi
if [ "$dry" = 1 ]; then
    say "GPU_CHECK_DRY_RUN=1: no CUDA device needed; the benchmark runs with --cpu-dry-run"
elif ! timeout "$(cap 90)" "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)'; then
    echo "no CUDA device: gpu-check needs one ($py: torch.cuda.is_available() is False)" >&2
    exit 2
fi

# -- fastcrc, tierfs -------------------------------------------------------------------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tierfs-gpu-check-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
pypath=$PWD
fastcrc="installed"
if ! timeout "$(cap 60)" "$py" -c 'import fastcrc' 2>/dev/null; then
    wheels=(benchmarks/wheels/fastcrc-*.whl)
    if [ ! -f "${wheels[0]}" ]; then
        say "fastcrc is not importable and benchmarks/wheels/ has no fastcrc wheel"
        exit 2
    fi
    if ! timeout "$(cap 60)" "$py" -m pip install -q --no-index --no-deps --disable-pip-version-check \
            --target "$tmp/site" "${wheels[@]}" 2>"$tmp/pip.err"; then
        say "pip could not install ${wheels[*]} ($(tail -n 1 "$tmp/pip.err")); unpacking it instead"
        rm -rf "$tmp/site"
        timeout "$(cap 60)" "$py" -m zipfile -e "${wheels[0]}" "$tmp/site"
    fi
    pypath=$pypath:$tmp/site
    fastcrc="from ${wheels[*]} (temporary, $tmp/site)"
fi
export PYTHONPATH=$pypath${PYTHONPATH:+:$PYTHONPATH}
if ! err=$(timeout "$(cap 60)" "$py" -c 'import fastcrc, tierfs' 2>&1); then
    say "tierfs cannot be imported with $py: $(echo "$err" | tail -n 1)"
    exit 2
fi

# -- what ran where ------------------------------------------------------------------------------------
mkdir -p "$out"
stamp=$(date +%Y%m%d-%H%M%S)
envf=$out/gpu_check-$stamp-env.txt
commit=${GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo "unknown (no git)")}
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $commit"
    if dirty=$(git status --porcelain 2>/dev/null); then
        echo "uncommitted files: $(printf '%s' "$dirty" | grep -c .)"
    fi
    echo "python: $py, $("$py" -V 2>&1)"
    timeout "$(cap 60)" "$py" - <<'EOF'
import torch
print("torch:", torch.__version__)
print("cuda (torch's build):", torch.version.cuda)
if torch.cuda.is_available():
    print("cuda driver api:", torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else "?")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"device {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
else:
    print("device: none")
EOF
    echo "fastcrc: $fastcrc"
    echo "nvidia-smi (name, driver_version, memory.total):"
    timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "(nvidia-smi failed)"
    echo "driver: $(timeout 15 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
    echo "nvidia-smi's CUDA version: $(timeout 15 nvidia-smi 2>/dev/null | grep -o 'CUDA Version: *[0-9.]*' | head -n 1)"
    echo "cpus: $(nproc), $(grep MemTotal /proc/meminfo 2>/dev/null)"
    echo "/dev/shm: $(df -h /dev/shm 2>/dev/null | tail -n 1)"
    echo "locked-memory limit (ulimit -l): $(ulimit -l)"
    echo "kernel: $(uname -srm)"
} >"$envf" 2>&1
cat "$envf"

# -- tests ----------------------------------------------------------------------------------------------
tests_rc=0
plog=$out/gpu_check-$stamp-pytest.log
if [ -f tests/test_gpu.py ]; then
    say "tests: $py -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py (up to $(cap 150) s)"
    timeout -k 10 "$(cap 150)" "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$plog"
    tests_rc=${PIPESTATUS[0]}
    if ((tests_rc == 124 || tests_rc == 137)); then
        say "the tests ran past their time limit" 2>&1 | tee -a "$plog"
    elif ((tests_rc == 5)); then
        say "pytest collected no gpu-marked tests" 2>&1 | tee -a "$plog"
    fi
else
    say "tests/test_gpu.py is missing: no gpu tests ran" 2>&1 | tee "$plog"
    tests_rc=4
fi

# -- benchmark -------------------------------------------------------------------------------------------
blog=$out/gpu_check-$stamp-bench.log
t=$(cap 330)
limit=$((t - 60))
if ((limit < 30)); then limit=30; fi
bench=("$py" benchmarks/bench_gpu.py --out "$out" --time-limit "$limit")
if [ "$dry" = 1 ]; then bench+=(--cpu-dry-run); fi
# shellcheck disable=SC2206 # split on purpose: extra arguments, e.g. "--shm /mnt/tmpfs --states small,2gb"
bench+=(${GPU_CHECK_BENCH_ARGS:-})
say "benchmark: ${bench[*]} (up to $t s)"
GPU_CHECK_COMMIT=$commit timeout -k 10 "$t" "${bench[@]}" 2>&1 | tee "$blog"
bench_rc=${PIPESTATUS[0]}
if ((bench_rc == 124 || bench_rc == 137)); then
    say "the benchmark ran past its time limit (the states it finished are in $out)" 2>&1 | tee -a "$blog"
fi

say "tests: exit $tests_rc ($plog); benchmark: exit $bench_rc ($blog); $((SECONDS - start)) s in all"
if ((tests_rc != 0 || bench_rc != 0)); then
    exit 1
fi
exit 0
