"""Ray executor (``--distributed-executor-backend ray``): ranks 1..N-1 are Ray actors running the same
:class:`~pagedllm.executor.rank_worker.RankWorker` as the multiprocessing executor's processes; rank 0 stays in the
engine process (it prepares each step and samples).

One placement group reserves a bundle of ``{"CPU": 1}`` (or ``{"GPU": 1}`` on a device backend) per rank, PACK
strategy as vLLM's; the bundle on the driver's own node is rank 0's, the others' actors go to the remaining bundles,
on whichever nodes Ray placed them. The engine joins the cluster ``RAY_ADDRESS`` names (``ray start --head`` ...), or
starts a local one. A step is ``ray.put`` once and every actor gets the same object (one broadcast); the driver then
waits for every actor's step to finish when it collects that step's logits, so an actor's error or death surfaces in
the step it happened in (under pipeline parallelism up to ``pp`` steps are in flight, each with its own refs).
``shutdown`` kills the actors and removes the placement group; if the engine itself initialized Ray (it was not yet),
it also calls ``ray.shutdown()``: a local Ray it started stops (no Ray process outlives the engine), a
``RAY_ADDRESS`` cluster is only disconnected from. Ray initialized by the caller stays as it was.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from pagedllm.errors import ParamError
from pagedllm.executor.base import DistributedExecutor, WorkerDiedError, free_port
from pagedllm.executor.rank_worker import RankWorker

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray  # optional: ray
    except ImportError:
        raise ParamError("distributed_executor_backend", "'ray' needs Ray: pip install 'pagedllm[ray]'") from None
    return ray


class RayExecutor(DistributedExecutor):
    name = "ray"

    def _start_ranks(self) -> tuple[str, Optional[frozenset[int]]]:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, placement_group_table  # optional: ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # optional: ray

        self._owns_ray = False
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, num_cpus=None if address else self.world_size, include_dashboard=False,
                     log_to_driver=True)
            self._owns_ray = True  # this engine connected (or started a local Ray): it disconnects at shutdown
        self._ray = ray
        res = "CPU" if self.config.device in ("auto", "cpu") else "GPU"
        self.pg = placement_group([{res: 1}] * self.world_size, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.config.distributed_timeout_s)
        if not ready:
            raise WorkerDiedError(f"Ray could not place {self.world_size} bundles of 1 {res} "
                                  f"(cluster resources: {ray.cluster_resources()})")
        self.driver_node = ray.get_runtime_context().get_node_id()
        bundle_nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        mine = [b for b, n in bundle_nodes.items() if n == self.driver_node]
        if not mine:
            raise WorkerDiedError("the Ray placement group has no bundle on the driver's node; rank 0 runs there")
        others = [b for b in sorted(bundle_nodes) if b != mine[0]]
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port(host)}"
        actor_cls = ray.remote(num_cpus=1 if res == "CPU" else 0, num_gpus=1 if res == "GPU" else 0)(RankWorker)
        self.actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=b), max_concurrency=1).remote(
                rank, self.config, self.model_path, init_method, None, 0)  # Ray makes its one device index 0
            for rank, b in enumerate(others, start=1)]
        return init_method, None

    def _wait_ready(self) -> None:
        try:
            self.actor_nodes = self._ray.get([a.node_id.remote() for a in self.actors],
                                             timeout=self.config.distributed_timeout_s)
        except Exception as e:
            raise WorkerDiedError(f"a Ray rank failed to start: {e}") from e
        logger.info("ray executor: rank 0 on node %s, ranks 1..%d on nodes %s", self.driver_node[:8],
                    self.world_size - 1, [n[:8] for n in self.actor_nodes])

    def _broadcast(self, payload: bytes) -> list[Any]:
        ref = self._ray.put(payload)
        return [a.execute.remote(ref) for a in self.actors]  # an actor runs its calls in order (max_concurrency=1)

    def _after_step(self, refs: list[Any]) -> None:
        self._ray.get(refs, timeout=self.config.distributed_timeout_s)

    def _stop_ranks(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        try:
            for a in getattr(self, "actors", []):
                ray.kill(a)
            if getattr(self, "pg", None) is not None:
                from ray.util.placement_group import remove_placement_group  # optional: ray

                remove_placement_group(self.pg)
        finally:
            self.actors, self.pg = [], None
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()
