"""`make bench`: throughput figures printed as ratios against a reference measured on the same machine.

Never part of the test suite: figures depend on the machine and its load.
"""


def blend_settings() -> list[str]:
    """Overrides giving a shipped training YAML, which leaves seq_length, split and seed to the blend manifest,
    the values blend_manifest's defaults (assets/data.py BlendConfig) would wire in."""
    from assets.data import BlendConfig

    blend = BlendConfig()
    data = "train_dataset.dataloader.config"
    return [f"{data}.seq_length={blend.seq_length}", f"model.seq_length={blend.seq_length}",
            f"{data}.split='{blend.split}'", f"{data}.seed={blend.seed}"]
