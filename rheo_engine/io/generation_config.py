"""A model directory's `generation_config.json`: the sampling defaults its authors ship.

Llama-3.1-8B-Instruct ships {"do_sample": true, "temperature": 0.6, "top_p": 0.9,
"eos_token_id": [128001, 128008, 128009]}. Like vLLM, we take temperature, top_p, top_k, min_p
and repetition_penalty from the file as defaults whatever `do_sample` says (transformers would
decode greedily when do_sample is false); `do_sample` is recorded, not obeyed. A field the file
lacks is None here, never transformers' own default (top_k=50, temperature=1.0): the caller
decides what an absent value means and can say where each value came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rheo_engine.config import read_json_object


@dataclass(frozen=True)
class GenerationDefaults:
    """The checked fields of one generation_config.json; None = absent from the file."""

    path: Path  # the file, for provenance
    eos_token_ids: tuple[int, ...] | None  # eos_token_id as a tuple (the file: an int or a list)
    temperature: float | None  # T, finite >= 0
    top_p: float | None  # in (0, 1]
    top_k: int | None  # >= 0 (0 = off)
    min_p: float | None  # in [0, 1)
    repetition_penalty: float | None  # finite > 0
    do_sample: bool | None  # recorded only (see the module docstring)

    @classmethod
    def from_dir(cls, path: str | Path) -> GenerationDefaults | None:
        """`path/generation_config.json` checked, or None when the directory has none."""
        file = Path(path) / "generation_config.json"
        if not file.is_file():
            return None
        data = read_json_object(file)
        return cls(
            path=file,
            eos_token_ids=_eos_ids(file, data.get("eos_token_id")),
            temperature=_number(file, data, "temperature", "finite >= 0", lambda v: v >= 0),
            top_p=_number(file, data, "top_p", "in (0, 1]", lambda v: 0 < v <= 1),
            top_k=_top_k(file, data.get("top_k")),
            min_p=_number(file, data, "min_p", "in [0, 1)", lambda v: 0 <= v < 1),
            repetition_penalty=_number(
                file, data, "repetition_penalty", "finite > 0", lambda v: v > 0
            ),
            do_sample=_do_sample(file, data.get("do_sample")),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


def _eos_ids(file: Path, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(
            f"{file}: eos_token_id must be an int >= 0 or a non-empty list of them, got "
            f"{value!r}; fix the file (Llama-3.1 ships [128001, 128008, 128009])"
        )
    return tuple(ids)


def _number(file: Path, data: dict, field: str, rule: str, ok: Any) -> float | None:
    value = data.get(field)
    if value is None:
        return None
    if (
        not (_is_int(value) or isinstance(value, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(
            f"{file}: {field} must be a number {rule}, got {value!r}; fix or remove the field"
        )
    return float(value)


def _top_k(file: Path, value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise ValueError(
            f"{file}: top_k must be an int >= 0 (0 = off), got {value!r}; fix or remove the field"
        )
    return value


def _do_sample(file: Path, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{file}: do_sample must be true or false, got {value!r}; fix the file")
