"""Do this package's own collectives hand NCCL CUDA tensors on the current device? (a device check, one process)

Written 2026-11-29, **not run yet** (the audit that wrote it had no GPU). Every collective of the package had run over
gloo on CPUs only; NCCL refuses a CPU tensor even in a world of one process ("No backend type associated with device
type cpu"), so one process on one GPU, in a 1-rank NCCL group, checks where each agreement function puts its tensors
(what it cannot check: that the ranks agree, nor the functions that skip their collective at world size 1:
``raise_on_every_rank``, ``measure_links``, the profiler's ``_reduce``, the pipeline's p2p). Each check calls the
package's own function (a strategy's method on a stand-in for the strategy), as the strategies call it after Lightning's
``setup_environment`` (``torch.cuda.set_device`` first); predict's ``broadcast_object_list`` leaves the device to torch,
so that check is torch's. A hang prints its stack and exits 1 after 120 s. Under 60 s on one GPU (NCCL's start is most of it). Run from the repository root:
``PYTHONPATH=$PWD python3 benchmarks/cuda_memory/collectives_smoke.py``; it prints one line per check and exits 1
if any failed.
"""
import faulthandler
import os
import socket
import sys
import traceback

import torch

if not torch.cuda.is_available():
    sys.exit("collectives_smoke.py needs a CUDA GPU, and torch sees none here. HINT: run it on a machine with an NVIDIA GPU.")
# a collective that hangs ends the check: the stack it hangs in is printed and the process exits 1 (a watchdog thread of
# its own: it fires while the main thread waits inside NCCL, where a Python signal handler would not run)
faulthandler.dump_traceback_later(120, exit=True)
sys.path.insert(0, os.getcwd())
import torch.distributed as dist  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from torch import nn  # noqa: E402

from lightning_distplan.bench._runner import settle_cuda_memory  # noqa: E402
from lightning_distplan.profiling._links import _device_for  # noqa: E402
from lightning_distplan.profiling._profiler import _reduce_all  # noqa: E402
from lightning_distplan.strategies._pipeline_checkpoint import _gather_to_zero, _to_cpu  # noqa: E402
from lightning_distplan.strategies.dp_ga import _agreed_batch_sizes  # noqa: E402
from lightning_distplan.strategies._pipeline_split import PipelineLayout  # noqa: E402
from lightning_distplan.strategies.pipeline import PipelineStrategy, _all_reduce_mean, _batch_checksum  # noqa: E402

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
torch.cuda.set_device(0)  # as Lightning's CUDAAccelerator.setup_device does before the group starts
dist.init_process_group("nccl", rank=0, world_size=1)
cuda = torch.device("cuda", torch.cuda.current_device())
pipe_group = dist.new_group([0])  # as PipelineStrategy makes its pipeline / data-parallel groups: the world's backend
object_group = dist.new_group(backend="gloo")  # as PipelineStrategy's _object_group
failed = []


def check(name, fn):
    try:
        got = fn()
        torch.cuda.synchronize()
        print(f"ok    {name}: {got}", flush=True)
    except Exception:  # noqa: BLE001 - every check runs; each failure is printed
        failed.append(name)
        print(f"FAIL  {name}:\n{traceback.format_exc()}", flush=True)


def expect(value, wanted):
    assert value == wanted, f"{value!r} != {wanted!r}"
    return value


check("profiling._links._device_for(world)", lambda: expect(_device_for(None), cuda))
check("profiling._links._device_for(gloo group)", lambda: expect(_device_for(object_group), torch.device("cpu")))
check("profiling._profiler._reduce_all (all_reduce MAX, float64)", lambda: expect(_reduce_all([1.5, -2.0], "max"), [1.5, -2.0]))
check("dp_ga._agreed_batch_sizes on root_device (all_reduce MAX, int64)", lambda: expect(_agreed_batch_sizes(cuda, 7), (7, 7)))


def same_batch():  # PipelineStrategy._check_same_batch: a step's batch on the GPU, all-gathered over the pipeline group
    mine = _batch_checksum([torch.arange(6, device=cuda).reshape(2, 3), torch.tensor([1, 0])], cuda)
    every = [torch.zeros_like(mine)]
    dist.all_gather(every, mine, group=pipe_group)
    return expect(every[0].tolist(), [16.0, 2.0])


check("pipeline._batch_checksum + all_gather over new_group([0])", same_batch)


def reduce_mean():  # the hybrid dp x pp gradient all-reduce
    used, unused = nn.Parameter(torch.zeros(3, device=cuda)), nn.Parameter(torch.zeros(2, device=cuda))
    grads = {used: torch.full((3,), 2.0, device=cuda)}
    _all_reduce_mean([used, unused], grads, pipe_group, divide_by=1)
    return expect((grads[used].tolist(), unused in grads), ([2.0] * 3, False))


check("pipeline._all_reduce_mean over new_group([0])", reduce_mean)


# The strategy's own methods, on a stand-in for the strategy holding what they read (a whole PipelineStrategy needs a
# Trainer and a fit): pp = 2 so that the gradient norm's all-reduce runs, over the 1-rank group.
strategy = SimpleNamespace(root_device=cuda, layout=PipelineLayout(dp=1, pp=2, rank=0), _pipe_group=pipe_group, _norm_skip=set())


def norm():  # PipelineStrategy._global_grad_norm: gradient_norm's partial norms all-reduced over the pipeline group
    weight = nn.Parameter(torch.zeros(4, device=cuda))
    weight.grad = torch.full((4,), 3.0, device=cuda)
    got = PipelineStrategy._global_grad_norm(strategy, [weight], 2.0)
    return expect(round(got.item(), 4), 6.0)


check("pipeline.PipelineStrategy._global_grad_norm over new_group([0])", norm)


def evaluation_batches():  # PipelineStrategy._agree_on_evaluation_batches: the world all-gathers each rank's count
    here = SimpleNamespace(root_device=cuda, layout=PipelineLayout(dp=1, pp=1, rank=0), _uncounted_eval=set(),
                           lightning_module=SimpleNamespace(allow_zero_length_dataloader_with_multiple_devices=False))
    trainer = SimpleNamespace(limit_val_batches=1.0, datamodule=None)
    PipelineStrategy._agree_on_evaluation_batches(here, trainer, [0] * 5, "val")
    return expect(here._uncounted_eval, set())


check("pipeline.PipelineStrategy._agree_on_evaluation_batches (world all_gather, int64)", evaluation_batches)
check("broadcast_object_list over new_group([0]) as pipeline.predict_step calls it (torch's own device choice)",
      lambda: (lambda box: (dist.broadcast_object_list(box, src=0, group=pipe_group), expect(box[0], {"out": [1.0]}))[1])([{"out": [1.0]}]))
check("_pipeline_checkpoint._gather_to_zero of a CUDA state over the gloo object group",
      lambda: expect([t.device.type for t in (lambda got: [got["w"], *got["history"]])(
          _gather_to_zero(_to_cpu({"w": torch.ones(2, device=cuda), "history": [torch.ones(2, device=cuda)]}), object_group)[0])],
          ["cpu", "cpu"]))
check("bench._runner.settle_cuda_memory (world barrier)", lambda: expect(settle_cuda_memory(cuda) >= 0, True))

dist.destroy_process_group()
print(f"{len(failed)} of the checks failed: {failed}" if failed else "every check passed", flush=True)
sys.exit(1 if failed else 0)
