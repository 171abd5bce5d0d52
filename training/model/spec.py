"""ModuleSpec: a model's structure as data (Megatron-core's spec mechanism, as MindFormers uses it).

A spec names a module class, the specs of its submodules and extra constructor arguments. Every module
is built as ``module(init, config, **submodule_specs, **params)`` and builds its own submodules from the
specs it receives, in attribute order, so parameter initialisation follows construction order.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModuleSpec:
    module: type
    submodules: dict[str, "ModuleSpec"] = field(default_factory=dict)
    params: dict = field(default_factory=dict)


def build_module(spec: ModuleSpec, init, config, **kwargs):
    """Instantiate ``spec.module`` with its submodule specs and params (``kwargs`` add call-site ones)."""
    return spec.module(init, config, **spec.submodules, **spec.params, **kwargs)


def check_tensor_parallel(spec: ModuleSpec, config, tp) -> None:
    """What tensor parallelism ``tp`` (training.parallel.tensor_parallel.TensorParallelRequirements) needs of the
    module ``spec`` would build, asked of its class with the same arguments, so nothing is built: each class's
    static ``check_tensor_parallel(config, tp, **submodule_specs, **params)`` sits beside the
    ``parallelize_tensor`` that makes the cuts it checks."""
    spec.module.check_tensor_parallel(config, tp, **spec.submodules, **spec.params)
