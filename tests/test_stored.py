"""pipeline.stored and the records read through it: a stored thing with one field missing, one this release does not
know, or one of another type is one InputError naming where it came from, the field and what to do; nothing an older
writer left out is filled in with today's default."""

from __future__ import annotations

import json

import pytest

from pipeline.dag.types import EvalResult, TrainedResult, from_record
from pipeline.errors import InputError
from pipeline.stored import Record, read_record

EVAL = EvalResult(run_id="r1", checkpoint="/c/ft.pt", top1=0.71, gflops=1.2, images_per_s=812.5,
                  images_per_s_spread=0.02, num_images=64, device="cpu", dtype="fp32", compile="none",
                  kernels={"kmedoids": "native-c"}, speed_ratio=0.8, speed_ratio_low=0.78, speed_ratio_high=0.82,
                  speed_blocks=12, speed_stop="converged", speed_seconds=3.5, load_before=0.4, load_after=0.5,
                  device_name="AMD EPYC", clock="cpu")
TRAINED = TrainedResult(run_id="r2", checkpoint="/c/ks.pt", keep=[49, 30, 12, 4], val_top1=0.5, seconds=12.0,
                        settings={"recipe.lr": 0.001})


class Point(Record):
    x: float
    label: str | None


def test_read_record_names_each_field_that_is_missing_unknown_or_of_another_type():
    assert read_record(Point, {"x": 1, "label": None}, "p.json", "do X") == Point(x=1.0, label=None)
    with pytest.raises(InputError, match=r"^p.json: label: missing; do X$"):
        read_record(Point, {"x": 1.0}, "p.json", "do X")
    with pytest.raises(InputError, match=r"^p.json: y: not a field of this release's record; do X$"):
        read_record(Point, {"x": 1.0, "label": "a", "y": 2}, "p.json", "do X")
    with pytest.raises(InputError, match=r"^p.json: x: Input should be a valid number \(got '1.0'\); do X$"):
        read_record(Point, {"x": "1.0", "label": "a"}, "p.json", "do X")
    with pytest.raises(InputError, match=r"^p.json: x: Input should be a valid number \(got True\); do X$"):
        read_record(Point, {"x": True, "label": "a"}, "p.json", "do X")  # strict: a bool is no number
    with pytest.raises(InputError, match=r"^p.json: not a record \(a mapping of fields\), got list; do X$"):
        read_record(Point, [1.0, "a"], "p.json", "do X")


@pytest.mark.parametrize("result", [EVAL, TRAINED], ids=["evaluate", "training"])
def test_a_stored_result_comes_back_as_it_was_written(result):
    record = json.loads(json.dumps(result.as_record()))  # as MLflow keeps it: the JSON of a tag
    assert from_record(type(result), record, result.run_id) == result


@pytest.mark.parametrize("result, field, rerun", [
    (EVAL, "clock", "--force evaluate"),  # written before the clock was recorded: not "not recorded" now
    (EVAL, "device_name", "--force evaluate"),  # tie_margin read it as an attribute: AttributeError
    (TRAINED, "keep", "--force KIND"),
], ids=["eval-clock", "eval-device-name", "trained-keep"])
def test_a_stored_result_missing_a_field_is_refused_not_completed_with_todays_default(result, field, rerun):
    record = {k: v for k, v in result.as_record().items() if k != field}
    with pytest.raises(InputError, match=rf"^the stored result of MLflow run {result.run_id} \({type(result).__name__}"
                                         rf"\): {field}: missing; it was written by another release: run .*{rerun}"):
        from_record(type(result), record, result.run_id)


@pytest.mark.parametrize("result", [EVAL, TRAINED], ids=["evaluate", "training"])
def test_a_stored_result_with_an_extra_field_or_one_of_another_type_is_one_error_naming_it(result):
    with pytest.raises(InputError, match=r"\): speed_clock: not a field of this release's record; it was written by "
                                         "another release"):
        from_record(type(result), {**result.as_record(), "speed_clock": "cpu"}, result.run_id)
    with pytest.raises(InputError, match=r"\): checkpoint: Input should be a valid string \(got 3\); it was written"):
        from_record(type(result), {**result.as_record(), "checkpoint": 3}, result.run_id)
    with pytest.raises(InputError, match=r"\): not a record \(a mapping of fields\), got str"):
        from_record(type(result), "{}", result.run_id)
