"""Two demo runs: the speed fronts up to ties, and each model's ratio r2/r1 against the machine's spread."""
import csv, json, sys, statistics
from pathlib import Path

def rows(folder, name):
    with open(Path(folder) / name) as f:
        return {f"{r['arch']}/{r['level']}/{r['method']}": r for r in csv.DictReader(f)}

a, b = sys.argv[1], sys.argv[2]
spread = json.loads(Path(sys.argv[3]).read_text())["between"]
ra, rb = rows(a, "results.csv"), rows(b, "results.csv")
assert ra.keys() == rb.keys()
print(f"models: {len(ra)}; machine spread (between processes, sd/mean): {spread:.2%}")
top1_same = sum(ra[k]["top1"] == rb[k]["top1"] for k in ra)
print(f"top-1 equal in both runs: {top1_same} of {len(ra)}")
devs = []
for k in sorted(ra):
    if ra[k]["speed_ratio"] in ("", "None"):
        continue
    r1, r2 = float(ra[k]["speed_ratio"]), float(rb[k]["speed_ratio"])
    d = r2 / r1 - 1
    devs.append((abs(d), k, r1, r2, ra[k]["speed_half_width"], rb[k]["speed_half_width"]))
within = [d for d in devs if d[0] <= spread]
print(f"|r2/r1 - 1| <= {spread:.2%}: {len(within)} of {len(devs)} ({len(within)/len(devs):.0%}); median |r2/r1-1| "
      f"{statistics.median(d[0] for d in devs):.2%}, widest {max(d[0] for d in devs):.2%}")
# against each run's own interval
cover = sum(1 for d in devs if abs(d[0]) <= float(d[4]) + float(d[5]))
print(f"within the two half-widths summed: {cover} of {len(devs)}")
for d in sorted(devs, reverse=True)[:8]:
    print(f"  {d[1]:32s} r1 {d[2]:.3f} r2 {d[3]:.3f} |d| {d[0]:.2%} hw {float(d[4]):.1%}/{float(d[5]):.1%}")
fa, fb = rows(a, "pareto_speed.csv"), rows(b, "pareto_speed.csv")
ties = lambda front: {t.strip() for r in front.values() for t in (r.get("speed_ties") or "").split(",") if t.strip()}
only_a, only_b = set(fa) - set(fb), set(fb) - set(fa)
print(f"speed front: {len(fa)} and {len(fb)} models; in one only: {sorted(only_a)} / {sorted(only_b)}")
print(f"  of those, marked ties in either run: {sorted((only_a | only_b) & (ties(fa) | ties(fb)))}")
ga, gb = rows(a, "pareto.csv"), rows(b, "pareto.csv")
print(f"GFLOPs front equal: {set(ga) == set(gb)}")
