"""Does a leftover of a fit's DDP buckets go away by waiting, a barrier, an all-reduce or ending the group? (a diagnostic, as run)

Two BERT-Large ``dp_ga`` fits (m = 12, s = 1) through ``measure_plan`` in one process group,
printing what is allocated after each fit, after a barrier, an all-reduce, 1 s, and (second fit)
``destroy_process_group``. Run on an NVIDIA H100 on 2026-11-23 from the repository root:
``PYTHONPATH=$PWD python3 benchmarks/cuda_memory/release.py``; its output is in
``benchmarks/results/cuda_memory_release_h100.json``.
"""
import gc, os, sys, time
import torch
if not torch.cuda.is_available():
    sys.exit("release.py needs a CUDA GPU, and torch sees none here. HINT: run it on a machine with an NVIDIA GPU (benchmarks/cuda_memory/README.md); replay_input_bytes.py is the one that needs none.")
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_validation as gv
import torch.distributed as dist
from lightning_distplan.bench._runner import measure_plan
from lightning_distplan.plan import Plan
gv._quiet_lightning(); torch.set_float32_matmul_precision("high")
spec = gv._bert(False); mk = gv._seeded(spec.make_module); ml = gv._loader_factory(spec, "cuda", 4)
GB = 1e9
def a():
    gc.collect(); torch.cuda.synchronize(); return round(torch.cuda.memory_allocated() / GB, 4)
for trial in range(2):
    plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=12, accumulate_grad_batches=1, global_batch_size=12)
    raw = measure_plan(plan, make_module=mk, make_loader=ml, steps=2, warmup=1, accelerator="cuda", devices=1, num_nodes=1)
    print("run", trial, "peak", raw["peak_memory_bytes"] / GB, "baseline (after settle incl. barrier)", raw["baseline_memory_bytes"] / GB, "err", raw["error"], flush=True)
    print(" after fit", a(), flush=True)
    dist.barrier(); print(" after barrier", a(), flush=True)
    t = torch.ones(1, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize(); print(" after all_reduce", a(), flush=True)
    time.sleep(1); print(" after 1s", a(), flush=True)
    if trial == 1:
        dist.destroy_process_group(); print(" after destroy", a(), flush=True)
