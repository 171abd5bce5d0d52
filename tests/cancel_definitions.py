"""A job whose one step trains through ``MsrunResource`` (2 workers) for long enough to be cancelled.

Run by tests/test_cancel.py with ``dagster job execute``; the shard and run directory come from run config.
"""
import dagster as dg

from conftest import MICRO_CONFIG
from resources.msrun import MsrunResource


class LongTraining(dg.Config):
    shard: str
    run_dir: str
    steps: int = 400


@dg.asset
def long_training(context: dg.AssetExecutionContext, config: LongTraining, msrun: MsrunResource) -> None:
    from pathlib import Path

    run_dir = Path(config.run_dir)
    overrides = [f"train_dataset.dataloader.config.data_path=[1.0, '{config.shard}']",
                 "train_dataset.dataloader.config.eod=2", "train_dataset.dataloader.config.pad=3",
                 f"training.steps={config.steps}", "checkpoint.save_interleaved_steps=2",
                 f"checkpoint.save_path={run_dir / 'checkpoints'}"]
    msrun.run(context, ["-m", "training.run", "--config", MICRO_CONFIG, "--output-dir", str(run_dir),
                        *[arg for o in overrides for arg in ("--set", o)]],
              run_dir / "msrun_log", on_custom_message=lambda message: None)


defs = dg.Definitions(assets=[long_training], jobs=[dg.define_asset_job("train_job", [long_training])],
                      resources={"msrun": MsrunResource(worker_num=2, local_worker_num=2)})
