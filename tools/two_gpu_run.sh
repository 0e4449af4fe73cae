#!/usr/bin/env bash
# The run on a machine with two GPUs (NCCL, one process per GPU), in one command, so that a short lease of such a
# machine is enough:
#   1. the distributed tests with TEDEBUG_TEST_DIST_BACKEND=nccl (one GPU per rank; the whole pytest output, failures'
#      tracebacks included, in OUT_DIR/distributed_tests.log);
#   2. examples/train_gpt_tp.py under torchrun: TP=2, TP=2 with sequence parallelism, DP=2 (30 steps each; the
#      final losses should agree with the one-process run's to a few thousandths);
#   3. tools/bench_parallel.py, TP=2 and DP=2, at the example's size and at $BIG, with --trace (the waits inside
#      debug_api.step()) and --cprofile (each setting's host time per rank, under OUT_DIR).
#
#   bash tools/two_gpu_run.sh [OUT_DIR]          (default runs/two_gpus; run from the repository's root)
#
# tedebug must be importable: installed (make install), or the repository's root on PYTHONPATH with the links
# tedebug/features -> ../features and tedebug/kernels -> ../kernels that the editable install stands for.
#
# Environment: PYTHON (default python3), BIG (the large size's flags), MIN_GPUS (default 2: the run refuses a
# machine with fewer GPUs; 0 runs it on the CPU with gloo, to try the script itself with a small BIG).
# NVLink multicast stays off, as the lent machines require (a program using it can take shared GPUs down).
set -u
out=${1:-runs/two_gpus}
python=${PYTHON:-python3}
big=${BIG:---n-layer 12 --n-embd 2048 --n-head 16 --batch-size 512}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$python" -c "import sys, torch; n = torch.cuda.device_count(); sys.exit(f'needs {sys.argv[1]} GPUs, found {n}' if n < int(sys.argv[1]) else 0)" "${MIN_GPUS:-2}" || exit 2
mkdir -p "$out"
quiet() { grep -Ev '^W[0-9]{4} |\*{20,}|OMP_NUM_THREADS' || true; }
torchrun=("$python" -m torch.distributed.run --nproc-per-node 2)

echo "== distributed tests, NCCL"
SECONDS=0
TEDEBUG_TEST_DIST_BACKEND=nccl timeout 300 "$python" -m pytest -o addopts="" -m distributed tests/ -q -p no:cacheprovider -W ignore -rfs >"$out/distributed_tests.log" 2>&1
grep -E '^(FAILED|ERROR|SKIPPED)|passed|failed' "$out/distributed_tests.log" | tail -12
echo "($SECONDS s)"

for parallel in "--tp 2" "--tp 2 --sequence-parallel" "--tp 1"; do
    echo "== examples/train_gpt_tp.py $parallel"
    timeout 180 "${torchrun[@]}" examples/train_gpt_tp.py $parallel --steps 30 --log-dir "$out/example" 2>&1 | quiet | tail -2
done
echo "== examples/train_gpt_tp.py, one process"
timeout 180 "$python" examples/train_gpt_tp.py --steps 30 --log-dir "$out/example_one" 2>&1 | quiet | tail -1

for size in "" "$big"; do
    for parallel in "--tp 2" "--tp 1"; do
        name="tp$(echo "$parallel" | tr -dc 0-9)${size:+_big}"
        echo "== tools/bench_parallel.py $parallel $size"
        SECONDS=0
        # (the size flags are word-split on purpose)
        # shellcheck disable=SC2086
        timeout 300 "${torchrun[@]}" tools/bench_parallel.py $parallel $size --rounds 5 --iters 10 --trace \
            --cprofile "$out/cprofile_$name" 2>&1 | quiet | tail -9
        echo "($SECONDS s)"
    done
done
