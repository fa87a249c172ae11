"""``--kv-transfer-config`` in vLLM's JSON shape, and the offload flags that are shorthand for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.errors import ParamError
from pagedllm.json_args import json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: The built-in host/disk prefix-cache tier (``--kv-offload-gib`` / ``--kv-offload-dir`` select it).
OFFLOADING_CONNECTOR = "OffloadingConnector"
DEFAULT_DISK_GIB = 16.0


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any, field_name: str = "kv_transfer_config") -> Optional["KVTransferConfig"]:
        """A dict, JSON text or KVTransferConfig (None stays None); a bad key names itself."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, field_name, ("kv_connector", "kv_role", "kv_connector_extra_config"))
        name = value.get("kv_connector")
        if not isinstance(name, str) or not name:
            raise ParamError(f"{field_name}.kv_connector", "must name a connector (entry point group "
                                                           "pagedllm.kv_connectors)")
        role = value.get("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise ParamError(f"{field_name}.kv_role", f"must be one of {', '.join(KV_ROLES)}, got {role!r}")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ParamError(f"{field_name}.kv_connector_extra_config", "must be a JSON object")
        return cls(name, role, dict(extra))


def offload_config(cpu_gib: float, disk_dir: Optional[str], disk_gib: float) -> KVTransferConfig:
    """The OffloadingConnector config that ``kv_offload_gib`` / ``kv_offload_dir`` / ``kv_offload_disk_gib`` mean."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(cpu_gib * (1 << 30))}
    if disk_dir:
        extra["disk_path"] = str(disk_dir)
        extra["disk_bytes_to_use"] = int(disk_gib * (1 << 30))
    return KVTransferConfig(OFFLOADING_CONNECTOR, "kv_both", extra)
