"""eq. 4 against class-token scores, paired per (width, level, method): docs/results.md."""
import csv, statistics, sys
def load(path):
    return {(r["arch"], r["level"], r["method"]): r for r in csv.DictReader(open(path))}
eq4, cls = load(sys.argv[1]), load(sys.argv[2])
assert eq4.keys() == cls.keys()
methods = ["wkmedoids", "wkmeans", "powerbert", "importance"]
archs = sorted({k[0] for k in eq4}, key=lambda a: int(a[1:]))
levels = sorted({k[1] for k in eq4}, key=lambda l: float(l[3:]))
print("| width, level | " + " | ".join(f"{m} eq4 / cls" for m in methods) + " |")
print("|---|" + "---|" * len(methods))
for a in archs:
    for l in levels:
        cells = []
        for m in methods:
            e, c = eq4[(a, l, m)], cls[(a, l, m)]
            assert e["keep"] == c["keep"], (a, l, m)
            cells.append(f"{float(e['top1']):.2f} / {float(c['top1']):.2f}")
        print(f"| {a}, {l} | " + " | ".join(cells) + " |")
print()
for m in methods + ["all"]:
    d = [float(cls[k]["top1"]) - float(eq4[k]["top1"]) for k in eq4 if m in ("all", k[2])]
    wins = sum(x > 0 for x in d)
    print(f"{m}: mean cls - eq4 {statistics.mean(d):+.2f} points (median {statistics.median(d):+.2f}, "
          f"sd {statistics.stdev(d):.2f}, n {len(d)}), cls higher in {wins}, lower in {sum(x < 0 for x in d)}; "
          f"|diff| > 1.7 in {sum(abs(x) > 1.7 for x in d)}")
