"""Materialize the whole chain in order, in process: used by `make demo` and the end-to-end test."""
from __future__ import annotations

from dataclasses import dataclass, field

import dagster as dg

from assets.chunks import register_source_chunks
from pipelines.definitions import ALL_ASSETS


@dataclass
class ChainResult:
    materializations: dict[str, list[dg.AssetMaterialization]] = field(default_factory=dict)

    def metadata(self, key: str, partition: str | None = None) -> dict:
        for event in reversed(self.materializations[key]):
            if partition is None or event.partition == partition:
                return {k: v.value for k, v in event.metadata.items()}
        raise KeyError(f"no materialization of {key}[{partition}]")


def config_for(key: str, run_config: dict) -> dict:
    """The part of a whole-chain run config that a run of the one asset ``key`` accepts."""
    ops = run_config.get("ops", {})
    return {**{k: v for k, v in run_config.items() if k != "ops"}, **({"ops": {key: ops[key]}} if key in ops else {})}


def materialize_chain(instance: dg.DagsterInstance, resources: dict, run_config: dict | None = None,
                      log=print, through: str = "training_run") -> ChainResult:
    """raw_corpus[*] → clean_corpus[*] → tokenizer → token_shards[*] → blend_manifest → training_run
    (+ checkpoints), stopping after the asset ``through``."""
    result = ChainResult()
    chunks = register_source_chunks(instance, resources["storage"])
    plan = [("raw_corpus", chunks), ("clean_corpus", chunks), ("tokenizer", [None]), ("token_shards", chunks),
            ("blend_manifest", [None]), ("training_run", [None])]
    plan = plan[:[key for key, _ in plan].index(through) + 1]
    for key, partitions in plan:
        for partition in partitions:
            log(f"==> materializing {key}" + (f"[{partition}]" if partition else ""))
            outcome = dg.materialize(ALL_ASSETS, selection=[key], partition_key=partition, instance=instance,
                                     resources=resources, run_config=config_for(key, run_config or {}))
            for event in outcome.get_asset_materialization_events():
                mat = event.event_specific_data.materialization
                result.materializations.setdefault(mat.asset_key.to_user_string(), []).append(mat)
    return result
