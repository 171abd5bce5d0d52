"""Every collective of training.parallel.comm, forward and backward, against numpy, on every kind of group.

Run by msrun (tests/test_parallel_comm.py): ``python tests/parallel_cases.py OUT_DIR pp,dp_replicate,dp_shard,cp,tp``.
Each rank writes OUT_DIR/rank<R>.json: its groups' ranks and, per case, the largest error against numpy (or
the exception). Every rank can compute every other rank's inputs (seeded by case and rank), so each checks its
own outputs and gradients against a numpy model of the whole group. An exception stops the rank at once: a
failed collective can leave the communicator unusable, and the other ranks then fail in their next collective.
"""
import json
import sys
import traceback
import zlib
from dataclasses import replace
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor

from training.parallel import comm
from training.parallel.mesh import DeviceMesh, ParallelDims, init_world

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")


def array(case: str, rank: int, shape) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(f"{case}/{rank}".encode())).normal(size=shape).astype(np.float32)


def chunk(x: np.ndarray, dim: int, index: int, parts: int) -> np.ndarray:
    return np.split(x, parts, axis=dim)[index]


def run(fn, x: np.ndarray, weight: np.ndarray):
    """fn(x) and the gradient of sum(fn(x) * weight) with respect to x."""
    out = fn(Tensor(x)).asnumpy()
    grad = ms.grad(lambda t: (fn(t) * Tensor(weight)).sum())(Tensor(x)).asnumpy()
    return out, grad


def cases(group):
    """name -> (function of x, input shape, output shape, numpy forward, numpy gradient); the numpy models
    take ``xs`` / ``ws``: every member's input / output weight, in group order."""
    n, me = group.size, group.rank
    src = n - 1  # not member 0, so a src confused with a global rank or index 0 shows
    send = [[(j + 2 * k) % 3 for k in range(n)] for j in range(n)]  # send[j][k]: rows member j sends to k (some 0)
    rows_from = [send[j][me] for j in range(n)]
    return {
        "all_reduce": (lambda t: comm.all_reduce(t, group), (2, 3), (2, 3),
                       lambda xs: sum(xs), lambda ws: sum(ws)),
        "copy_to_group": (lambda t: comm.copy_to_group(t, group), (2, 3), (2, 3),
                          lambda xs: xs[me], lambda ws: sum(ws)),
        "reduce_from_group": (lambda t: comm.reduce_from_group(t, group), (2, 3), (2, 3),
                              lambda xs: sum(xs), lambda ws: ws[me]),
        "all_gather": (lambda t: comm.all_gather(t, 1, group), (2, 3), (2, 3 * n),
                       lambda xs: np.concatenate(xs, 1), lambda ws: chunk(sum(ws), 1, me, n)),
        "reduce_scatter": (lambda t: comm.reduce_scatter(t, 1, group), (2, 2 * n), (2, 2),
                           lambda xs: chunk(sum(xs), 1, me, n), lambda ws: np.concatenate(ws, 1)),
        "scatter_to_group": (lambda t: comm.scatter_to_group(t, 0, group), (2 * n, 3), (2, 3),
                             lambda xs: chunk(xs[me], 0, me, n), lambda ws: np.concatenate(ws, 0)),
        "broadcast": (lambda t: comm.broadcast(t, src, group), (2, 3), (2, 3),
                      lambda xs: xs[src], lambda ws: sum(ws) if me == src else np.zeros_like(ws[me])),
        # out_r = concat_j(block r of x_j along dim 0) along dim 1; its adjoint sends the blocks back
        "all_to_all": (lambda t: comm.all_to_all(t, 0, 1, group), (2 * n, 3), (2, 3 * n),
                       lambda xs: np.concatenate([chunk(x, 0, me, n) for x in xs], 1),
                       lambda ws: np.concatenate([chunk(w, 1, me, n) for w in ws], 0)),
        "all_to_all_single": (lambda t: comm.all_to_all_single(t, send[me], rows_from, group),
                              (sum(send[me]), 2), (sum(rows_from), 2),
                              lambda xs: np.concatenate([np.split(x, np.cumsum(send[j])[:-1])[me]
                                                         for j, x in enumerate(xs)]),
                              lambda ws: np.concatenate([np.split(w, np.cumsum([send[j][k] for j in range(n)])[:-1])[me]
                                                         for k, w in enumerate(ws)])),
    }


def check_group(group, results: dict) -> None:
    for name, (fn, _, _, forward, backward) in cases(group).items():
        case = f"{group.name}:{name}"
        # every member's (input, output) shapes, from the table as that member builds it (all_to_all_single's differ)
        shapes = [cases(replace(group, rank=j))[name][1:3] for j in range(group.size)]
        xs = [array(case + "/x", group.ranks[j], shapes[j][0]) for j in range(group.size)]
        ws = [array(case + "/w", group.ranks[j], shapes[j][1]) for j in range(group.size)]
        out, grad = run(fn, xs[group.rank], ws[group.rank])
        expected_out, expected_grad = forward(xs), backward(ws)
        results[case] = {"shape_ok": out.shape == expected_out.shape and grad.shape == expected_grad.shape,
                         "forward_error": float(np.abs(out - expected_out).max(initial=0)),
                         "backward_error": float(np.abs(grad - expected_grad).max(initial=0))}


def check_point_to_point(mesh, results: dict) -> None:
    """send_recv on a pair that is no mesh group (rank r with rank world-1-r), sender the higher rank."""
    peer = mesh.dims.world - 1 - mesh.rank
    pair = mesh.pair(peer)
    sender = 1
    x = array("pair/x", mesh.rank, (3,))
    w = array("pair/w", mesh.rank, (3,))
    out, grad = run(lambda t: comm.send_recv(t, pair, sender), x, w)
    sender_rank = pair.ranks[sender]
    expected_grad = w + array("pair/w", peer, (3,)) if mesh.rank == sender_rank else np.zeros(3, np.float32)
    results["pair:send_recv"] = {"shape_ok": True,
                                 "forward_error": float(np.abs(out - array("pair/x", sender_rank, (3,))).max()),
                                 "backward_error": float(np.abs(grad - expected_grad).max())}


def check_host_helpers(group, results: dict) -> None:
    total = comm.all_reduce_array(np.array([group.global_rank, 1.0]), group)
    comm.barrier(group)
    # bit-exact arrays of awkward dtypes and sizes, each owned by one member
    specs = {"f16_odd": ((3,), np.float16), "i64": ((2, 2), np.int64), "nan": ((2,), np.float32)}
    values = {"f16_odd": np.array([1.5, -0.0, 65504], np.float16),
              "i64": np.arange(4, dtype=np.int64).reshape(2, 2) - 2**40,
              "nan": np.array([np.nan, -1.0], np.float32)}
    owners = {"f16_odd": 0, "i64": group.size - 1, "nan": group.size - 1}
    own = {name: values[name] for name, owner in owners.items() if owner == group.rank}
    shared = comm.share_arrays(own, owners, specs, group)
    results[f"{group.name}:host"] = {
        "all_reduce_array": total.tolist() == [float(sum(group.ranks)), float(group.size)],
        "share_arrays": sorted(shared) == sorted(values) and all(
            shared[n].dtype == values[n].dtype and shared[n].tobytes() == values[n].tobytes() for n in values)}


def main():
    out_dir, degrees = Path(sys.argv[1]), [int(d) for d in sys.argv[2].split(",")]
    world = init_world()
    dims = ParallelDims(world.size, *degrees)
    results, groups = {}, {}
    try:
        mesh = DeviceMesh(dims, world.rank)
        for name in ("world", "tp", "dp_shard", "dp", "cp"):
            group = mesh.group(name)
            groups[name] = list(group.ranks)
            check_group(group, results)
            check_host_helpers(group, results)
        check_point_to_point(mesh, results)
    except Exception:  # stop here; the JSON says where
        results["exception"] = traceback.format_exc()
    (out_dir / f"rank{world.rank}.json").write_text(json.dumps({"groups": groups, "results": results}, indent=1))
    sys.exit(1 if "exception" in results else 0)


if __name__ == "__main__":
    main()
