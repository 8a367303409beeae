export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python -m pytest -m gpu -x -q tests/test_mosaic_kernel.py -k "page1 or page2 or page4" 2>&1 | tail -30
eval "$(bash .peers/peer_site.sh .peers)"; export PYTHONPATH=.:.peers:$PYTHONPATH
timeout 300 python benchmarks/bench_attention.py --page-size 1 --rounds 1 --reps 10 2>&1 | grep -v "^  sglang\|jax_pallas" | tail -60
