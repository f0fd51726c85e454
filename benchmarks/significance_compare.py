"""eq. 4 against class-token scores, paired per (width, level, method): the tables of docs/results.md.

    cd docs/data/fmnist_significance && python ../../../benchmarks/significance_compare.py \
        results_eq4.csv results_cls.csv [results_eq4_again.csv] > compare.txt

Prints the top-1 table (first eq. 4 run against the class token), then the paired differences over
the cells; with a second eq. 4 run also its difference from the first (the run-to-run noise) and the
class token against the mean of the two.
"""
import csv
import statistics
import sys

METHODS = ["wkmedoids", "wkmeans", "powerbert", "importance"]


def load(path):
    return {(r["arch"], r["level"], r["method"]): r for r in csv.DictReader(open(path))}


def top1(run):
    return {key: float(row["top1"]) for key, row in run.items()}


def paired(label, diffs):
    d = list(diffs.values())
    print(f"{label}: mean {statistics.mean(d):+.2f} points (sd {statistics.stdev(d):.2f}, "
          f"standard error {statistics.stdev(d) / len(d) ** 0.5:.2f}, n {len(d)}), "
          f"higher in {sum(x > 0 for x in d)}, lower in {sum(x < 0 for x in d)}")
    for m in METHODS:
        dm = [x for key, x in diffs.items() if key[2] == m]
        print(f"  {m}: {statistics.mean(dm):+.2f} (higher in {sum(x > 0 for x in dm)}, "
              f"lower in {sum(x < 0 for x in dm)})")


eq4_rows, cls_rows = load(sys.argv[1]), load(sys.argv[2])
assert eq4_rows.keys() == cls_rows.keys()
assert all(eq4_rows[key]["keep"] == cls_rows[key]["keep"] for key in eq4_rows)
eq4, cls = top1(eq4_rows), top1(cls_rows)
archs = sorted({key[0] for key in eq4}, key=lambda a: int(a[1:]))
levels = sorted({key[1] for key in eq4}, key=lambda level: float(level[3:]))
print("| width, level | " + " | ".join(f"{m} eq4 / cls" for m in METHODS) + " |")
print("|---|" + "---|" * len(METHODS))
for a in archs:
    for level in levels:
        cells = [f"{eq4[(a, level, m)]:.2f} / {cls[(a, level, m)]:.2f}" for m in METHODS]
        print(f"| {a}, {level} | " + " | ".join(cells) + " |")
print()
paired("class token minus eq. 4", {key: cls[key] - eq4[key] for key in eq4})
if len(sys.argv) > 3:
    again = top1(load(sys.argv[3]))
    paired("eq. 4 again minus eq. 4 (noise)", {key: again[key] - eq4[key] for key in eq4})
    paired("class token minus eq. 4 again", {key: cls[key] - again[key] for key in eq4})
    paired("class token minus the mean of the two eq. 4 runs",
           {key: cls[key] - (eq4[key] + again[key]) / 2 for key in eq4})
