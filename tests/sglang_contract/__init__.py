"""SGLang 0.5.11 engine-contract conformance suite for torch_bridge.

``engine`` mocks SGLang's own objects (written from its source, not from ``torch_bridge.types``),
``graph_runner`` imitates its CUDA-graph runners' call order and padding, ``reference64`` is a
float64 oracle computed from the torch pools and ``req_to_token``, ``world`` builds batches the way
SGLang's scheduler and workers do and checks every step (per row output, KV pools bit-identical
outside the slots the step writes).

``device`` is the one device switch: ``JAX_ATTN_CONTRACT_DEVICE=cuda`` runs every case with its
tensors on the GPU (``test_gpu`` launches that run; see docs/contributing.md).
"""

from tests.sglang_contract import device as device  # noqa: F401  (the switch is read before any test runs)
