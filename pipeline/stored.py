"""Reading back what the pipeline stored (a latency table's key, a stage's result, an evaluate run's params, a
report's ``results.csv``): each through a typed schema, read as strictly as a config section (``config.base.Section``).

A field missing, a field this release does not know, or a value of another type is one ``InputError`` naming where
the record came from, each field and what to do. Nothing fills in a field an older writer did not write: a record of
another release is measured or run again, as the identity version says for stores.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.config.base import error_message
from pipeline.errors import InputError


class Record(BaseModel):
    """A stored thing's schema: every field typed and required unless it says otherwise, no other field."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


R = TypeVar("R", bound=Record)


def problems(err: ValidationError) -> list[str]:
    """One ``FIELD: what is wrong`` a field, as the user reads it."""
    lines = []
    for item in err.errors():
        name = ".".join(str(part) for part in item["loc"]) or "(the record)"
        if item["type"] == "missing":
            lines.append(f"{name}: missing")
        elif item["type"] == "extra_forbidden":
            lines.append(f"{name}: not a field of this release's record")
        else:
            lines.append(f"{name}: {error_message(item)} (got {item['input']!r})")
    return lines


def read_record(schema: type[R], data: Any, where: str, advice: str) -> R:
    """``data`` (a stored record's JSON) as ``schema``; an InputError naming ``where`` (the file, run or table), each
    field that is missing, unknown or of another type, and ``advice`` (what to do)."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: not a record (a mapping of fields), got {type(data).__name__}; {advice}")
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise InputError(f"{where}: {'; '.join(problems(err))}; {advice}") from None
