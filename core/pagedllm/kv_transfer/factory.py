"""Finding a connector class by name: the built-ins, then the ``pagedllm.kv_connectors`` entry points."""

from __future__ import annotations

import importlib
import importlib.metadata as md

from pagedllm.errors import ParamError
from pagedllm.kv_transfer.base import ENTRY_POINT_GROUP, KVConnectorBase_V1

BUILTIN_CONNECTORS = {"OffloadingConnector": "pagedllm.kv_transfer.offloading:OffloadingConnector",
                      "LoopbackConnector": "pagedllm.kv_transfer.loopback:LoopbackConnector"}


def available_connectors() -> list[str]:
    return sorted(set(BUILTIN_CONNECTORS) | {ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)})


def connector_class(name: str, field_name: str = "kv_transfer_config.kv_connector") -> type[KVConnectorBase_V1]:
    target = BUILTIN_CONNECTORS.get(name)
    if target is not None:
        module, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    else:
        eps = [ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not eps:
            raise ParamError(field_name, f"unknown connector {name!r}; installed: {', '.join(available_connectors())} "
                                         f"(a package registers one under the {ENTRY_POINT_GROUP!r} entry points)")
        try:
            cls = eps[0].load()
        except Exception as e:  # noqa: BLE001 - a broken third-party package: name it
            raise ParamError(field_name, f"connector {name!r} ({eps[0].value}) failed to import: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ParamError(field_name, f"connector {name!r} is not a pagedllm.kv_transfer.KVConnectorBase_V1 subclass")
    return cls
