"""The `npu` concurrency pool: as many training steps at once as the devices hold msrun jobs.

Dagster keeps pool limits in the instance, not in code, so `make ui` / `make demo` (and the UI tests)
set it from the msrun resource before starting: devices // workers per node, at least 1. On CPU there
is no device list; each run's workers fill the cores, so one training run at a time.
"""
import sys

import dagster as dg

from assets.training import TRAINING_POOL
from resources.msrun import MsrunResource


def training_slots(msrun: MsrunResource) -> int:
    devices = len(msrun.visible_devices.split(",")) if msrun.visible_devices else msrun.local_worker_num
    return max(1, devices // msrun.local_worker_num)


def configure_pools(instance: dg.DagsterInstance, msrun: MsrunResource) -> int:
    slots = training_slots(msrun)
    instance.event_log_storage.set_concurrency_slots(TRAINING_POOL, slots)
    return slots


def main() -> int:
    from pipelines.definitions import resources

    with dg.DagsterInstance.get() as instance:
        slots = configure_pools(instance, resources()["msrun"])
    print(f"concurrency pool {TRAINING_POOL!r}: {slots} training run(s) at a time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
