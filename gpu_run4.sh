export PYTHONPATH=.:.peers PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 100 python -m pytest -v -p no:cacheprovider -n 12 --tb=no tests/test_torch_bridge.py tests/test_bridge_launch.py tests/test_sglang_plugin.py tests/test_gpu_graphs.py tests/test_graph_tables.py tests/test_torch_bridge_spec.py 2>&1 | grep -E "FAILED|ERROR" | head -20
