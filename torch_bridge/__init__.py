"""torch_bridge: SGLang's attention-backend interface for torch engines, running jax_attn via DLPack."""

from torch_bridge.backend import FlashAttentionBackend, to_mode
from torch_bridge.multistep import FlashAttentionMultiStepBackend
from torch_bridge.dlpack import Importer, check_not_capturing, export
from torch_bridge.types import (
    ForwardBatch,
    ForwardMode,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ModelConfig,
    ModelRunner,
    RadixAttention,
    ReqToTokenPool,
    ServerArgs,
    SpecInfo,
)

__all__ = [
    "FlashAttentionBackend", "FlashAttentionMultiStepBackend", "to_mode", "Importer", "check_not_capturing", "export",
    "ForwardBatch", "ForwardMode", "MHATokenToKVPool", "MLATokenToKVPool", "ModelConfig", "ModelRunner",
    "RadixAttention", "ReqToTokenPool", "ServerArgs", "SpecInfo",
]
