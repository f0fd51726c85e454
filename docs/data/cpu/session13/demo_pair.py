"""Two fresh-clone `make demo` runs (A in /tmp/demoA, B in /tmp/demoB, both at commit 8c46872: seeded augmentation, top-1 not yet seeded):
compares every checkpoint's weights, and evaluates the random and importance checkpoints of both with the seeded top-1
(commit 4a2809e). Run from /tmp: PYTHONPATH=/work/main python docs/data/cpu/session13/demo_pair.py"""
import csv, torch
from pipeline.config import EvalConfig
from pipeline.evaluate import evaluate_checkpoint
from pipeline.train.checkpoint import load_checkpoint
rows = {}
for side in "AB":
    for r in csv.DictReader(open(f"/tmp/demo{side}/runs/experiments/demo/results.csv")):
        rows.setdefault((r["arch"], r["level"], r["method"]), {})[side] = r
cfg = EvalConfig(device="cpu", dtype="fp32", compile="none", batch=8, warmup=0, repeats=1)
weights_same = 0
for key, sides in sorted(rows.items()):
    a, b = (load_checkpoint(sides[s]["checkpoint"])["model"] for s in "AB")
    same = all(torch.equal(a[k], b[k]) for k in a)
    weights_same += same
    if key[2] in ("random", "importance"):
        ta, tb = (evaluate_checkpoint(sides[s]["checkpoint"], cfg).top1 for s in "AB")
        print(key, "weights identical", same, "top1 A", ta, "B", tb, "demo A/B", sides["A"]["top1"], sides["B"]["top1"], flush=True)
print("checkpoints with identical weights:", weights_same, "of", len(rows))
