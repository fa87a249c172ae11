"""A third-party KV connector written against docs/kv-offload.md and kv_transfer/base.py alone (the conformance
test registers it through a ``pagedllm.kv_connectors`` entry point): it keeps the full blocks of every finished
request in host memory, holding the request's device blocks until they are copied (``request_finished`` -> True,
released through ``get_finished``), and serves later prefix matches from there."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from pagedllm.kv_transfer import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole


@dataclass
class ExampleMeta(KVConnectorMetadata):
    saves: dict = field(default_factory=dict)  # request id -> [(device block, hash)]
    loads: list = field(default_factory=list)  # [(hash, device block)]


class ExampleStoreConnector(KVConnectorBase_V1):
    def __init__(self, config, role, context):
        super().__init__(config, role, context)
        self.stored: set[bytes] = set()  # scheduler side: hashes the worker side confirmed
        self.meta = ExampleMeta()
        self.store: dict[bytes, list] = {}  # worker side: hash -> a one-block host cache
        self.saved: list[bytes] = []
        self.done: set[str] = set()
        self.pending_match: dict[str, int] = {}

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        bs = self.context.block_size
        hashes = self.context.block_hashes(request, (request.num_tokens - 1) // bs * bs)
        n = 0
        for h in hashes[num_computed_tokens // bs:]:
            if h not in self.stored:
                break
            n += 1
        self.pending_match[request.request_id] = num_computed_tokens // bs
        return n * bs, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        start = self.pending_match.pop(request.request_id, 0)
        bs = self.context.block_size
        hashes = self.context.block_hashes(request, (start * bs) + num_external_tokens)
        for i in range(start, start + num_external_tokens // bs):
            self.meta.loads.append((hashes[i], block_ids[i]))

    def build_connector_meta(self, scheduler_output):
        meta, self.meta = self.meta, ExampleMeta()
        return meta

    def request_finished(self, request, block_ids):
        bs = self.context.block_size
        full = min(request.num_computed_tokens, len(block_ids) * bs) // bs
        hashes = self.context.block_hashes(request, full * bs)
        todo = [(block_ids[i], h) for i, h in enumerate(hashes) if h not in self.stored]
        if not todo:
            return False, None
        self.meta.saves[request.request_id] = todo
        return True, {"saved_blocks": len(todo)}

    def update_connector_output(self, connector_output):
        self.stored.update((connector_output or {}).get("saved", ()))

    # worker side
    def register_kv_caches(self, kv_caches):
        self.caches = list(kv_caches.values())

    def _one_block(self):
        host = replace(self.context.kv_spec, num_blocks=1, device=torch.device("cpu"))
        return self.context.allocate_host_kv_cache(host, False)

    def start_load_kv(self, **kwargs):
        for h, block in self.get_connector_metadata().loads:
            self.context.swap_kv_blocks(self.store[h], self.caches, torch.tensor([0]), torch.tensor([block]))

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        for rid, blocks in self.get_connector_metadata().saves.items():
            for block, h in blocks:
                if h not in self.store:
                    self.store[h] = self._one_block()
                    self.context.swap_kv_blocks(self.caches, self.store[h], torch.tensor([block]),
                                                torch.tensor([0]))
                self.saved.append(h)
            self.done.add(rid)

    def get_finished(self, finished_req_ids):
        done, self.done = self.done, set()
        return done, None

    def build_connector_worker_meta(self) -> Optional[dict]:
        out, self.saved = {"saved": list(self.saved)}, []
        return out

    def get_stats(self) -> dict[str, Any]:
        return {"stored_blocks": len(self.stored)}
