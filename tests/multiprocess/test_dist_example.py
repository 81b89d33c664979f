"""The distributed example runs end to end with torchrun: 2 workers train and checkpoint, 3 resume."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_distributed_example_2_then_3_workers(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "distributed_example.sh"), str(tmp_path / "run"), "10"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    saved = int(re.search(r"done at step 10 on 2 workers: (\d+) user rows", p.stdout).group(1))
    resumed = re.findall(r"\[rank (\d)/3\] resumed step_10: (\d+) user rows, all owned: True", p.stdout)
    assert sorted(r for r, _ in resumed) == ["0", "1", "2"]
    assert sum(int(n) for _, n in resumed) == saved, "every saved row arrives on exactly one of the 3 workers"
    assert "done at step 20 on 3 workers" in p.stdout
