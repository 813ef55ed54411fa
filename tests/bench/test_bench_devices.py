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
