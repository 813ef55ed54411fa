"""Our strategies and PlanningCallback destroy the process groups before the interpreter shuts down.

A gloo group left to interpreter finalization can abort a worker with SIGABRT ("terminate called without an
active exception") after a fit that succeeded; Lightning destroys the group at exit for NCCL only. The CI run
of 4d53fe7 lost a spawn-launched pipeline worker this way. Each case is a real ``torchrun`` launch whose exit
handler, registered before the fit, records whether a group was still alive once every other handler ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

# which fit -> processes; plain Lightning DDP is the control: it leaves the gloo group alive at exit
CASES = {"ddp": 1, "dp_ga": 1, "auto_plan": 1, "callback": 1, "gpipe": 2}


def test_process_groups_destroyed_at_exit(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = {}
    for which, world in CASES.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(HERE / "_exit_child.py"), which, str(tmp_path / which)]
        procs[which] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for which, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{which}: torchrun exited {proc.returncode}:\n{output[-3000:]}"
    states = {which: [(tmp_path / f"{which}.{rank}").read_text() for rank in range(world)] for which, world in CASES.items()}
    assert states == {"ddp": ["alive"], "dp_ga": ["destroyed"], "auto_plan": ["destroyed"], "callback": ["destroyed"],
                      "gpipe": ["destroyed", "destroyed"]}
