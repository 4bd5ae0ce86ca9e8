"""generation_config.json: the fields read, their checks (one line naming file, field, value and
fix), absent fields as None and an absent file as None."""

from __future__ import annotations

import json

import pytest

from rheo_engine.io.generation_config import GenerationDefaults

LLAMA31 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
           "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"}  # fmt: skip


def _load(tmp_path, data) -> GenerationDefaults | None:
    (tmp_path / "generation_config.json").write_text(json.dumps(data))
    return GenerationDefaults.from_dir(tmp_path)


def test_llama31_file(tmp_path):
    got = _load(tmp_path, LLAMA31)
    assert got == GenerationDefaults(path=tmp_path / "generation_config.json",
                                     eos_token_ids=(128001, 128008, 128009), temperature=0.6,
                                     top_p=0.9, top_k=None, min_p=None, repetition_penalty=None,
                                     do_sample=True)  # fmt: skip


def test_absent_file_and_fields(tmp_path):
    assert GenerationDefaults.from_dir(tmp_path) is None
    got = _load(tmp_path, {"eos_token_id": 2})
    assert got.eos_token_ids == (2,)
    assert (got.temperature, got.top_p, got.top_k, got.min_p) == (None, None, None, None)
    assert (got.repetition_penalty, got.do_sample) == (None, None)
    got = _load(tmp_path, {"top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1, "temperature": 0,
                           "do_sample": False})  # fmt: skip
    assert (got.top_k, got.min_p, got.repetition_penalty, got.temperature) == (0, 0.05, 1.1, 0.0)
    assert got.do_sample is False and isinstance(got.temperature, float)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("eos_token_id", True, "eos_token_id must be an int >= 0"),
        ("eos_token_id", [1, -2], "eos_token_id must be an int >= 0"),
        ("eos_token_id", [], "non-empty list"),
        ("eos_token_id", "2", "got '2'"),
        ("temperature", -0.1, "temperature must be a number finite >= 0, got -0.1"),
        ("temperature", "hot", "temperature must be a number"),
        ("temperature", True, "temperature must be a number"),
        ("top_p", 0, "top_p must be a number in \\(0, 1\\], got 0"),
        ("top_p", 1.5, "top_p must be a number in \\(0, 1\\]"),
        ("top_k", 2.0, "top_k must be an int >= 0"),
        ("top_k", -1, "top_k must be an int >= 0"),
        ("top_k", False, "top_k must be an int >= 0"),
        ("min_p", 1.5, "min_p must be a number in \\[0, 1\\)"),
        ("min_p", 1.0, "min_p must be a number in \\[0, 1\\)"),
        ("repetition_penalty", 0, "repetition_penalty must be a number finite > 0"),
        ("do_sample", 1, "do_sample must be true or false"),
    ],
)
def test_bad_values(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        _load(tmp_path, {**LLAMA31, field: value})
    assert "generation_config.json" in str(err.value) and "\n" not in str(err.value)


def test_non_finite_and_bad_json(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": NaN}')
    with pytest.raises(ValueError, match="temperature must be a number finite >= 0, got nan"):
        GenerationDefaults.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6')
    with pytest.raises(ValueError, match="is not valid JSON"):
        GenerationDefaults.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        GenerationDefaults.from_dir(tmp_path)
