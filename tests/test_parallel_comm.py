"""training.parallel.comm under msrun on CPU: every collective, forward and backward, against numpy on every
kind of group (tests/parallel_cases.py does the work, one msrun launch per world shape)."""
import json

import numpy as np
import pytest

from training.parallel import comm
from training.parallel.mesh import DeviceMesh, ParallelDims, World

from conftest import run_under_msrun

COLLECTIVES = ("all_reduce", "copy_to_group", "reduce_from_group", "all_gather", "reduce_scatter",
               "scatter_to_group", "broadcast", "all_to_all", "all_to_all_single")


def test_a_world_of_one_communicates_nothing():
    """Without msrun every collective is the identity, and MindSpore's communication is never initialised."""
    from mindspore import Tensor

    mesh = DeviceMesh(ParallelDims(1), 0)
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    for name in ("world", "tp", "dp", "loss"):
        group = mesh.group(name)
        assert group.size == 1 and group.backend_name is None
        for out in (comm.all_reduce(x, group), comm.copy_to_group(x, group), comm.reduce_from_group(x, group),
                    comm.all_gather(x, 1, group), comm.reduce_scatter(x, 1, group),
                    comm.scatter_to_group(x, 0, group), comm.broadcast(x, 0, group),
                    comm.all_to_all(x, 0, 1, group), comm.all_to_all_single(x, [2], [2], group)):
            assert out is x
    assert comm.all_reduce_array(np.array([1.5]), mesh.group("world")).tolist() == [1.5]
    shared = comm.Collectives(World(0, 1)).share_arrays({"a": np.ones(2)}, {"a": 0}, {"a": ((2,), np.float64)})
    assert shared["a"].tolist() == [1.0, 1.0]


@pytest.mark.msrun
@pytest.mark.parametrize("workers, degrees", [(4, "1,1,2,1,2"), (2, "1,1,1,1,2")], ids=["dp_shard2xtp2", "tp2"])
def test_every_collective_matches_numpy_forward_and_backward(tmp_path, workers, degrees):
    run_under_msrun(["tests/parallel_cases.py", tmp_path, degrees], tmp_path / "msrun_log", workers, timeout=600)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(workers)]
    expected_groups = {4: {"world": [[0, 1, 2, 3]] * 4, "tp": [[0, 1], [0, 1], [2, 3], [2, 3]],
                           "dp_shard": [[0, 2], [1, 3], [0, 2], [1, 3]], "dp": [[0, 2], [1, 3], [0, 2], [1, 3]],
                           "cp": [[0], [1], [2], [3]]},
                       2: {"world": [[0, 1]] * 2, "tp": [[0, 1]] * 2, "dp_shard": [[0], [1]], "dp": [[0], [1]],
                           "cp": [[0], [1]]}}[workers]
    for name, ranks in expected_groups.items():
        assert [r["groups"][name] for r in reports] == ranks, name
    for rank, report in enumerate(reports):
        results = report["results"]
        expected = {f"{g}:{c}" for g in expected_groups for c in COLLECTIVES} | {f"{g}:host" for g in expected_groups}
        assert expected | {"pair:send_recv"} == set(results), rank
        for case, result in results.items():
            if case.endswith(":host"):
                assert result == {"all_reduce_array": True, "share_arrays": True}, (rank, case)
            else:
                assert result["shape_ok"] and result["forward_error"] < 1e-5 and result["backward_error"] < 1e-5, \
                    (rank, case, result)
