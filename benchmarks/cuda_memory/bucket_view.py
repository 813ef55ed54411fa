"""The same dp_ga plan fitted twice, each in a fresh process group, with and without DDP's
``gradient_as_bucket_view`` (a diagnostic, as run).

One BERT-Large module object is reused across fits, and that keeps the previous fit's DDP wrapper
and buckets alive (the Trainer stays referenced from the module): the rows where ``base`` is not
0 are not valid measurements. Run on an NVIDIA H100 on 2026-11-23 from the repository root:
``PYTHONPATH=$PWD python3 benchmarks/cuda_memory/bucket_view.py``; its output is in
``benchmarks/results/cuda_memory_bucket_view_h100.json``.
"""
import gc, os, sys, time
import torch
if not torch.cuda.is_available():
    sys.exit("bucket_view.py needs a CUDA GPU, and torch sees none here. HINT: run it on a machine with an NVIDIA GPU (benchmarks/cuda_memory/README.md); replay_input_bytes.py is the one that needs none.")
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import gpu_validation as gv
import lightning.pytorch as pl
from lightning_distplan.plan import Plan
from lightning_distplan.strategies import DPGAStrategy
from lightning_distplan.profiling._overhead import QUIET_FIT
gv._quiet_lightning(); torch.set_float32_matmul_precision("high")
spec = gv._bert(False); ml = gv._loader_factory(spec, "cuda", 6)
module_cpu = gv._seeded(spec.make_module)()
state = {k: v.clone() for k, v in module_cpu.state_dict().items()}
GiB = 2**30
t0 = time.time()
for m, s in [(24, 1), (24, 4), (12, 4)]:
    for gabv in (False, True):
        for rep in range(2):
            if time.time() - t0 > 150: sys.exit(0)
            module_cpu.load_state_dict(state)
            gc.collect(); torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
            plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)
            tr = pl.Trainer(accelerator="cuda", devices=1, strategy=DPGAStrategy(plan=plan, gradient_as_bucket_view=gabv), max_steps=4, max_epochs=-1, **QUIET_FIT)
            tr.fit(module_cpu, train_dataloaders=ml(m * s))
            peak = (torch.cuda.max_memory_allocated() - base) / GiB
            tr = None; gv._release_process_group(); module_cpu.cpu()
            print(f"m={m} s={s} gradient_as_bucket_view={gabv} rep={rep}: peak {peak:.2f} GiB (base {base/GiB:.3f})", flush=True)
