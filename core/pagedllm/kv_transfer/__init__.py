"""KV beyond one device pool: the connector contract (``base.py``, vLLM V1's shape), its configuration, the
built-in host/disk prefix-cache tier (``offloading.py``) and the conformance check a third-party connector runs
(``conformance.py``). docs/kv-offload.md is the guide."""

from pagedllm.kv_transfer.base import (ENTRY_POINT_GROUP, KVConnectorBase_V1, KVConnectorContext,
                                       KVConnectorMetadata, KVConnectorRole)
from pagedllm.kv_transfer.config import KVTransferConfig

__all__ = ["ENTRY_POINT_GROUP", "KVConnectorBase_V1", "KVConnectorContext", "KVConnectorMetadata", "KVConnectorRole",
           "KVTransferConfig"]
