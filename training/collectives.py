"""Moved to ``training.parallel``: ``World``, ``init_world`` and ``launched_by_msrun`` to ``mesh``, ``Collectives``
to ``comm``. These names stay importable from here only until the files written alongside that move (FSDP and
resharding tests) import them from there."""
from training.parallel.comm import Collectives  # noqa: F401
from training.parallel.mesh import World, init_world, launched_by_msrun  # noqa: F401
