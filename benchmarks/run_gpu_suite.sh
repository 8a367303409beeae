#!/usr/bin/env bash
# Everything that needs the GPU, in one go: gpu-marked tests, the SGLang engine-contract suite on cuda,
# the 1B-class example decode, the host-overhead figure and the kernel benchmark. Logs go to $OUT
# (default ./out).
# Usage (repo root, peers fetched into .peers by benchmarks/fetch_peers.sh and unpacked with
# `eval "$(bash .peers/peer_site.sh .peers)"`):
#   bash benchmarks/run_gpu_suite.sh [tests|contract|compiled|example|host|timeline|bench|all]...
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
# Several processes share the GPU (pytest -n 8, torch beside JAX): JAX must not preallocate.
export PYTHONPATH=".:.peers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
what="${*:-all}"
status=()
run() {  # name, command...
  local name="$1"; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"
  status+=("| $name | rc=$rc | $((SECONDS - t0)) s |")
}
has() { [[ " $what " == *" $1 "* || " $what " == *" all "* ]]; }
# -n 8 when pytest-xdist is there: the Mosaic cases are bound by compile time (16 CPU cores; the
# contract suite ran in about 5 minutes on an H100 host with -n 8).
xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n 8)
# (tests/sglang_contract/test_gpu.py would run the whole contract suite again: that is the contract step)
has tests && run tests python3 -m pytest -q -m gpu tests -x -p no:cacheprovider "${xdist[@]}" \
  --ignore=tests/sglang_contract/test_gpu.py
# The SGLang engine-contract suite with every tensor on cuda (tests/sglang_contract/device.py), the bridge's
# compiled kernels, real torch.cuda.graph capture where the bridge supports it.
has contract && run contract env JAX_ATTN_CONTRACT_DEVICE=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
  python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/sglang_contract "${xdist[@]}"
# The backend / speculative suites again, kernels compiled for the GPU instead of interpreted.
has compiled && run compiled python3 -m pytest -q -x -p no:cacheprovider tests/test_backend.py tests/test_spec.py \
  -k "triton or tree or multistep"
has example && run example python3 examples/decode_llama.py --config 1b --batch 8 --max-prompt 256 --min-prompt 64 --new-tokens 32 --page-size 16
has example && run example_overlap python3 examples/decode_llama.py --config 1b --batch 8 --max-prompt 256 --min-prompt 64 --new-tokens 32 --page-size 16 --overlap
has host && run host python3 benchmarks/bench_jax_step.py --config 1b --batch 64 --ctx 4096 --page-size 16 --steps 20 \
  --variant fused,fused-static,fused-nocb,fused-static-nocb
has timeline && run timeline python3 benchmarks/bench_jax_step.py --mode timeline --config 1b --batch 64 --ctx 4096 --variant fused,fused-nocb
has bench && run bench python3 benchmarks/bench_attention.py --rounds 3
nvidia-smi --query-gpu=name --format=csv,noheader
printf '%s\n' "| step | result | time |" "|---|---|---|" "${status[@]}"
