"""Honest latency-table keys: a table is measured or checked only where this process is what its key says
(threads against the usable cores, the kernel choice it was measured with), and benchmark records are matched by
the whole card name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipeline.bench.blocks import (
    BlocksSettings,
    measure_table,
    settings_from_key,
    setup,
    table_key,
    usable_cores,
)
from pipeline.bench.latency import run_check
from pipeline.bench.records import find_record
from pipeline.cost import check_key
from pipeline.errors import InputError
from pipeline.runtime import KernelChoice
from tests.test_latency_tables import QUICK
from tests.test_latency_tables import settings as tiny_settings

# Measurements set torch's threads (the table's setting); later tests get theirs back.
pytestmark = [pytest.mark.usefixtures("restore_threads"), pytest.mark.speed]


def settings(method: str = "kmedoids", **more) -> BlocksSettings:
    """The latency tables' tests' tiny setting, K-Medoids unless told."""
    return tiny_settings(method, **more)


def test_a_table_keyed_for_more_threads_than_usable_cores_is_refused_naming_threads(tmp_path):
    from pipeline.dag.latency import measure_on_table

    table, _ = measure_table(settings(), tmp_path / "t.json", log=lambda _: None)
    more = usable_cores() + 1
    planted = replace(table, key={**table.key, "threads": more})
    with pytest.raises(InputError, match=rf"threads: the key says {more} thread\(s\); this process can use "
                                         rf"{usable_cores()} core"):
        run_check(planted, count=2, seed=0, levels=False, other_device=False, log=lambda _: None)
    ratio, status = measure_on_table(planted, [8, 4], log=lambda _: None)
    assert ratio is None and status.startswith("predicted (") and f"the key says {more} thread(s)" in status
    with pytest.raises(InputError, match="threads: the key says"):  # and no table is measured for it either
        setup(settings(threads=more))


def test_a_table_keeps_its_kernel_choice_and_another_choice_is_refused_naming_it(tmp_path):
    torch_native = KernelChoice(native="torch", kmedoids="torch")
    table, out = measure_table(settings(kernels=torch_native), tmp_path / "t.json", log=lambda _: None)
    assert table.key["kernel_choice"] == torch_native.as_dict()
    assert settings_from_key(table.key).kernels == torch_native
    with pytest.raises(InputError, match=r"^the cost table of 'kmedoids' on .*'s key: kernel_choice: missing; "
                                         r"measure it again with `pipeline bench blocks`"):  # every key records it
        settings_from_key({k: v for k, v in table.key.items() if k != "kernel_choice"})
    checked, rows = run_check(table, count=1, seed=0, levels=False, other_device=False,
                              speed=QUICK, log=lambda _: None)  # its own kernels: measured
    assert not checked.predicted and len(rows) == 1 and rows[0].measured > 0
    with pytest.raises(InputError, match=r"kernel_choice: \{.*'native': 'torch'.*\} != \{.*'native': 'auto'"):
        measure_table(settings(), out, log=lambda _: None)  # measuring into it with every kernel at auto
    s = settings()
    device, model = setup(s)
    with pytest.raises(InputError, match="kernel_choice") as refused:  # and it is no other device's prediction
        check_key(table, table_key(s, model, device), other_device=True)
    assert "device:" not in str(refused.value)


def test_a_record_for_h200_does_not_match_gh200(tmp_path):
    def record(name: str, machine: str, date: str) -> None:  # the record format of docs/benchmarks.md
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "kind": "throughput", "setting": {"model": "deit_small_patch16_224", "train": False},
            "rows": [{"label": "unmodified", "images_per_s": 1.0}], "machine": machine, "kernels": None,
            "date": date, "commit": "abc", "command": "bench throughput"}))

    record("gh200", "NVIDIA GH200 480GB; torch 2.11", "2026-12-01")
    assert find_record(tmp_path, kind="throughput", device="H200") is None
    record("h200", "NVIDIA H200; torch 2.11", "2026-11-01")  # older than the GH200 one, and the only H200
    found = find_record(tmp_path, kind="throughput", device="H200")
    assert found is not None and found[0].name == "h200.json"
    assert find_record(tmp_path, kind="throughput", device="h200")[0].name == "h200.json"  # case does not matter
    assert find_record(tmp_path, kind="throughput", device="GH200")[0].name == "gh200.json"
