"""The concurrency pools. `npu`: as many training steps at once as the devices hold msrun jobs; `clean`: one
clean_corpus step at a time (assets/cleaning.py).

Dagster keeps pool limits in the instance, not in code, so `make ui` / `make demo` (and the UI tests)
set it from the msrun resource before starting: devices // workers per node, at least 1. On CPU there
is no device list; each run's workers fill the cores, so one training run at a time. Which devices a
step gets is decided by its lease (resources/devices.py), so steps holding slots never share one.
A cluster (``nodes``) runs one training step per node and job, all at once: the pool holds every
node's slots, and each machine's leases keep two jobs' steps apart there.
"""
import sys

import dagster as dg

from assets.cleaning import CLEANING_POOL
from assets.training import TRAINING_POOL
from resources.msrun import MsrunResource


def _slots(visible_devices: str | None, workers: int) -> int:
    devices = len(visible_devices.split(",")) if visible_devices else workers
    return max(1, devices // workers)


def training_slots(msrun: MsrunResource) -> int:
    if msrun.nodes:
        return sum(_slots(node.visible_devices, node.devices) for node in msrun.nodes)
    return _slots(msrun.visible_devices, msrun.local_worker_num)


def configure_pools(instance: dg.DagsterInstance, msrun: MsrunResource) -> int:
    """Sets both pools' slots; returns the training slots."""
    slots = training_slots(msrun)
    instance.event_log_storage.set_concurrency_slots(TRAINING_POOL, slots)
    instance.event_log_storage.set_concurrency_slots(CLEANING_POOL, 1)
    return slots


def main() -> int:
    from assets.chunks import register_source_chunks
    from pipelines.definitions import resources

    with dg.DagsterInstance.get() as instance:
        slots = configure_pools(instance, resources()["msrun"])
        # the sources' chunks are instance state too: the UI lists them as partitions before a sensor tick
        chunks = register_source_chunks(instance, resources()["storage"])
    print(f"concurrency pool {TRAINING_POOL!r}: {slots} training run(s) at a time; {CLEANING_POOL!r}: 1 "
          f"clean_corpus step")
    print(f"source chunks (partitions of raw_corpus and token_shards): {len(chunks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
