"""run_bench inside the user's own job refuses ranks that share a CUDA device (a forgotten ``torch.cuda.set_device``).

No GPU here: the device identities each rank reports are given as data (what ``cuda_devices_used`` reads from CUDA on a
GPU machine); the exchange and the refusal run over real gloo processes.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_distplan.bench._bench import BenchError, check_own_devices, cuda_devices_used, ranks_sharing_a_device

SHARED = [("node1", "GPU-aaaa", "cuda:0")]  # every rank on cuda:0 of one host: the user forgot set_device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen: dict[str, str | list | None] = {}
    try:
        seen["cpu"] = cuda_devices_used(torch.device("cpu"))  # a CPU bench under gloo uses no CUDA device
        check_own_devices([("node1", f"GPU-{rank}", f"cuda:{rank}")], world)  # set_device(LOCAL_RANK): accepted
        seen["own"] = None
        try:
            check_own_devices(SHARED, world)
            seen["shared"] = None
        except BenchError as err:
            seen["shared"] = str(err)
        dist.barrier()  # the group still works after the check's own group is gone
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
        dist.destroy_process_group()


def test_ranks_on_one_cuda_device_are_refused_alike_on_every_rank(tmp_path):
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["cpu"] for s in seen] == [[], []]
    assert [s["own"] for s in seen] == [None, None]
    assert seen[0]["shared"] == seen[1]["shared"]  # one sentence from every rank, so none is left waiting in a collective
    assert seen[0]["shared"] == (
        "Ranks 0 and 1 of this job all run on cuda:0 of host 'node1', so their profiles would time one shared GPU and NCCL would "
        "refuse or hang in their collectives; nothing was run. HINT: Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) in "
        "every process before init_process_group and run_bench (`distplan bench` does this itself), or give each process its own "
        "GPU with CUDA_VISIBLE_DEVICES."
    )


@pytest.mark.parametrize(
    ("used", "expected"),
    [
        ([SHARED, SHARED, SHARED], ([0, 1, 2], "cuda:0", "node1")),
        # rank 1 profiles on its own cuda:1 but its NCCL collectives run on the current device, cuda:0, rank 0's
        ([[("n", "GPU-0", "cuda:0")], [("n", "GPU-1", "cuda:1"), ("n", "GPU-0", "cuda:0")]], ([0, 1], "cuda:0", "n")),
        # each process sees its own GPU as cuda:0 (CUDA_VISIBLE_DEVICES per rank): distinct UUIDs, accepted
        ([[("n", "GPU-0", "cuda:0")], [("n", "GPU-1", "cuda:0")]], None),
        # cuda:0 of two machines is two GPUs
        ([[("a", "GPU-0", "cuda:0")], [("b", "GPU-0", "cuda:0")]], None),
        ([[], []], None),  # CPU
    ],
)
def test_which_ranks_share_a_device(used, expected):
    assert ranks_sharing_a_device(used) == expected


class _PastTheCheck(Exception):
    """Raised where run_bench goes on after the device check (its next step), so a test stops there, before profiling."""


def _bench_rank(rank: int, world: int, port: int, out_dir: str, used: list, nccl_only: bool) -> None:
    """One rank of a user's own 2-process gloo job calling run_bench, whose CUDA devices are ``used[rank]`` (as data)."""
    from lightning_distplan.bench import _bench
    from lightning_distplan.bench.models import RandomVectorData, WideMLP
    from lightning_distplan.profiling import _links, _precision

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    made: list[str] = []
    new_group = dist.new_group
    dist.new_group = lambda *a, **k: made.append(k.get("backend")) or new_group(*a, **k)
    _bench.cuda_devices_used = lambda dev: [tuple(d) for d in used[rank]]
    if nccl_only:  # the collectives' device an NCCL-only group gives (the exchange itself must then avoid it)
        _links._device_for = lambda group: torch.device("cuda", 0)

    def past(*a, **k):
        raise _PastTheCheck

    _precision.trainer_precision = past
    seen: dict[str, object] = {}
    try:
        dm = RandomVectorData(in_features=16, batch_size=4)
        dm.setup("fit")
        _bench.run_bench(lambda: WideMLP(in_features=16, hidden=32, depth=2), dm.train_dataloader(), world_size=world,
                         global_batch_size=4, device="cpu")
    except BenchError as err:
        seen["outcome"] = str(err)
    except _PastTheCheck:
        seen["outcome"] = "accepted"
    seen["groups_made"] = made
    dist.new_group = new_group
    dist.barrier()  # the job's group still works after the check
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def _run_bench_in_job(tmp_path, used: list, nccl_only: bool = False) -> list[dict]:
    tmp_path.mkdir(parents=True)
    mp.spawn(_bench_rank, args=(2, _free_port(), str(tmp_path), used, nccl_only), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("nccl_only", [False, True], ids=["gloo", "nccl-only"])
def test_run_bench_refuses_ranks_sharing_a_device_and_runs_ranks_on_their_own(tmp_path, nccl_only):
    """run_bench itself makes the decision, before profiling: ranks on one device are refused alike on every rank, ranks
    on their own devices (one each as cuda:0 under per-process CUDA_VISIBLE_DEVICES: distinct UUIDs) go on. The devices
    cross over the job's own gloo group (no group made for it: a CPU run pays nothing more); only where the job's group is
    NCCL-only over a gloo group made for it."""
    shared = _run_bench_in_job(tmp_path / "shared", [SHARED, SHARED], nccl_only)
    own = _run_bench_in_job(tmp_path / "own", [[("node1", "GPU-0", "cuda:0")], [("node1", "GPU-1", "cuda:0")]], nccl_only)
    assert shared[0]["outcome"] == shared[1]["outcome"]
    assert shared[0]["outcome"].startswith("Ranks 0 and 1 of this job all run on cuda:0 of host 'node1'")
    assert [s["outcome"] for s in own] == ["accepted", "accepted"]
    assert [s["groups_made"] for s in shared + own] == [["gloo"] if nccl_only else []] * 4
