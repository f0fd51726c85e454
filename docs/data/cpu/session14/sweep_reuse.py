"""The tiny ASHA sweep of tests/test_hpo.py, run once without the kill, each output line timestamped.

Usage (repository root): PYTHONPATH=. python docs/data/cpu/session14/sweep_reuse.py EMPTY_DIR
"""
import sys, subprocess, time
from pathlib import Path
sys.path.insert(0, ".")
from tests.test_hpo import overrides, TINY, ROOT
from tests.conftest import write_synthetic_pair
root = write_synthetic_pair(Path(sys.argv[1]), 192, 48)
cmd = [sys.executable, "-m", "pipeline", "run", str(TINY)] + [p for i in overrides(root) for p in ("--set", i)]
t0 = time.time()
p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in p.stdout:
    print(f"{time.time()-t0:7.1f} {line.rstrip()[:150]}", flush=True)
print("rc", p.wait(), time.time() - t0)
