"""Converts the table a ``bench throughput`` run printed, before the command wrote records, into a record of
``pipeline/bench/measured/`` (``pipeline.bench.records.record_from_output``): the same setting, rows and
machine line, the run's date and commit, and ``"kernels": null`` (the kernels it ran were not recorded, so
readers count it as measured on earlier kernels).

    python benchmarks/record_from_output.py \
        docs/data/gpu/h200_2026-11-27_kmeans-and-training-step/train-reduce-overhead-wkmedoids.md \
        --date 2026-11-27 --commit 8a8038c --out pipeline/bench/measured/h200_2026-11-27_train-step.json
"""

import argparse
import json
from pathlib import Path

from pipeline.bench.records import read_record, record_from_output

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("output", type=Path, help="the stored stdout of a `bench throughput` run")
parser.add_argument("--date", required=True)
parser.add_argument("--commit", required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
record = record_from_output(args.output.read_text(), commit=args.commit, date=args.date, source=str(args.output))
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(record, indent=1) + "\n")
read_record(args.out)  # what the readers accept
print(f"wrote {args.out}: {[(row['label'], row['images_per_s']) for row in record['rows']]}")
