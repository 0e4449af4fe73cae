set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl 2>&1 | tail -2
export PYTHONPATH="$HOME/site:$PWD"
ln -sfn ../features tedebug/features; ln -sfn ../kernels tedebug/kernels
MODE=${1:-all}
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  python3 -m pytest -o addopts="" -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  python3 -m tedebug.cli bench --e2e --recipes --rounds 5 --steps 10 --no-kernels 2>&1 | tail -25 | tee $OUT/recipes.txt
fi
if [ "$MODE" = all ] || [ "$MODE" = fp8 ] || [ "$MODE" = prof ]; then
  python3 -m tedebug.cli bench --e2e --no-kernels --fp8 --rounds 3 --steps 10 2>&1 | tail -9 | tee $OUT/fp8.txt
  python3 -m tedebug.cli bench --e2e --no-kernels --fp8 --rounds 3 --steps 10 --hidden 256 --heads 2 --batch 1 --seq 128 2>&1 | tail -9 | tee $OUT/fp8_host.txt
fi
if [ "$MODE" = prof ]; then
  for s in fp8 fp8-log; do
    python3 tools/profile_step.py --setting $s --steps 5 --top 60 > $OUT/prof_${s}_big.txt 2>&1
    python3 tools/profile_step.py --setting $s --hidden 256 --heads 2 --batch 1 --seq 128 --steps 10 --top 60 > $OUT/prof_${s}_host.txt 2>&1
  done
fi
if [ "$MODE" = final ]; then
  python3 -m pytest -o addopts="" -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
  python3 -m tedebug.cli bench --e2e --recipes --rounds 5 --steps 10 --no-kernels 2>&1 | tail -10 | tee $OUT/recipes.txt
  python3 -m tedebug.cli bench --e2e --no-kernels --fp8 --rounds 3 --steps 10 2>&1 | tail -9 | tee $OUT/fp8.txt
  python3 -m tedebug.cli bench --e2e --no-kernels --fp8 --rounds 3 --steps 10 --hidden 256 --heads 2 --batch 1 --seq 128 2>&1 | tail -9 | tee $OUT/fp8_host.txt
  python3 -m tedebug.cli bench --e2e --recipes --rounds 3 --steps 10 --no-kernels --only Float8CurrentScaling --hidden 256 --heads 2 --batch 1 --seq 128 2>&1 | tail -6 | tee $OUT/recipes_host.txt
fi
