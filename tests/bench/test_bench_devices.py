"""run_bench inside the user's own job refuses ranks that share a CUDA device (a forgotten ``torch.cuda.set_device``).

No GPU here: the device identities each rank reports are given as data (what ``cuda_devices_used`` reads from CUDA on a
GPU machine); the exchange and the refusal run over real gloo processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ports import free_port

from lightning_distplan.bench._bench import BenchError, check_own_devices, cuda_devices_used, ranks_sharing_a_device

SHARED = [("node1", "GPU-aaaa", "cuda:0")]  # every rank on cuda:0 of one host: the user forgot set_device




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


OWN = [("node1", "GPU-0", "cuda:0")], [("node1", "GPU-1", "cuda:0")]  # each sees its own GPU as cuda:0: distinct UUIDs


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of a user's own 2-process gloo job: check_own_devices directly, then run_bench itself, with this rank's
    CUDA devices given as data (shared by every rank, or its own), under the job's gloo group and under an NCCL-only one."""
    from lightning_distplan.bench import _bench
    from lightning_distplan.bench.models import RandomVectorData, WideMLP
    from lightning_distplan.profiling import _device, _links, _precision

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen: dict[str, object] = {}
    try:
        seen["cpu"] = cuda_devices_used(torch.device("cpu"))  # a CPU bench under gloo uses no CUDA device
        check_own_devices([("node1", f"GPU-{rank}", f"cuda:{rank}")], world)  # set_device(LOCAL_RANK): accepted
        seen["own"] = None
        try:
            check_own_devices(SHARED, world)
            seen["shared"] = None
        except BenchError as err:
            seen["shared"] = str(err)
        dist.barrier()  # the group still works after the check

        made: list[str] = []
        new_group, device_for = dist.new_group, _links._device_for
        dist.new_group = lambda *a, **k: made.append(k.get("backend")) or new_group(*a, **k)

        def past(*a, **k):
            raise _PastTheCheck

        _precision.trainer_precision = past
        _device.resolve_device = lambda device: torch.device("cuda", 0)  # a GPU job: run_bench checks only there
        dm = RandomVectorData(in_features=16, batch_size=4)
        dm.setup("fit")
        for nccl_only in (False, True):
            # the collectives' device an NCCL-only group gives (the exchange itself must then avoid it)
            _links._device_for = (lambda group: torch.device("cuda", 0)) if nccl_only else device_for
            for name, used in (("shared", SHARED), ("own", OWN[rank])):
                _bench.cuda_devices_used = lambda dev, used=used: [tuple(d) for d in used]
                made.clear()
                try:
                    _bench.run_bench(lambda: WideMLP(in_features=16, hidden=32, depth=2), dm.train_dataloader(),
                                     world_size=world, global_batch_size=4, device="cpu")
                except BenchError as err:
                    outcome = str(err)
                except _PastTheCheck:
                    outcome = "accepted"
                seen[f"bench {name} {'nccl-only' if nccl_only else 'gloo'}"] = [outcome, list(made)]
        dist.new_group, _links._device_for = new_group, device_for
        dist.barrier()  # the job's group still works after the checks
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
        dist.destroy_process_group()


def test_ranks_on_one_cuda_device_are_refused_alike_on_every_rank(tmp_path):
    """The refusal is the same sentence on every rank (none is left waiting in a collective), and run_bench itself makes
    the decision, before profiling: ranks on one device refused, ranks on their own devices go on. The devices cross over
    the job's own gloo group (no group made for it: a CPU run pays nothing more); only an NCCL-only group gets a gloo one."""
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["cpu"] for s in seen] == [[], []]
    assert [s["own"] for s in seen] == [None, None]
    assert seen[0]["shared"] == seen[1]["shared"]
    assert seen[0]["shared"] == (
        "Ranks 0 and 1 of this job both run on cuda:0 of host 'node1', so their profiles would time one shared GPU and NCCL "
        "would refuse or hang in their collectives; nothing was run. HINT: Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) "
        "in every process before init_process_group and run_bench (`distplan bench` does this itself), or give each process "
        "its own GPU with CUDA_VISIBLE_DEVICES."
    )
    for group in ("gloo", "nccl-only"):
        made = ["gloo"] if group == "nccl-only" else []
        assert [s[f"bench shared {group}"] for s in seen] == [[seen[0]["shared"], made]] * 2
        assert [s[f"bench own {group}"] for s in seen] == [["accepted", made]] * 2
