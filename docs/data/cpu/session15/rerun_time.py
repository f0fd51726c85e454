"""Times a rerun of a finished tiny DAG: PYTHONPATH=. python docs/data/cpu/session15/rerun_time.py ROOT, where ROOT is
the root of a finished `test_dag_survives_a_killed_driver_then_reruns_without_training` (pytest keeps it under
/tmp/pytest-of-USER/pytest-N/dag0). Run it at two commits, alternating, to compare."""
import sys, time
from pathlib import Path
sys.path.insert(0, ".")
from tests.test_dag import TINY, tiny_overrides
from pipeline.config import load_config
from pipeline.dag.runner import run_experiment
root = Path(sys.argv[1])
t = time.perf_counter()
lines = []
run_experiment(load_config(TINY, tiny_overrides(root)), log=lines.append)
print(f"rerun {time.perf_counter() - t:.1f} s", [l for l in lines if l.startswith("[")][:8])
