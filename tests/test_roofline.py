"""bench/roofline.py, the analytic H200 roofline of the CUDA kernels.

- it prints one table per kernel (and the two step tables), fast and the same every run;
- every floor is positive and at most the current design's estimate, per kernel and per step;
- tree attention's L2 traffic is N * G re-reads of the compulsory K/V at prefix 8192;
- the step floor's weights are Llama-3.1-8B's streamed parameters;
- BENCHMARKS.md's roofline section holds the script's output verbatim.
No GPU or torch needed.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def roofline() -> ModuleType:
    spec = importlib.util.spec_from_file_location("roofline", ROOT / "bench" / "roofline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["roofline"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_main_prints_one_table_per_kernel(roofline: ModuleType, capsys) -> None:
    start = time.perf_counter()
    roofline.main()
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert elapsed < 1.0, f"roofline.main() took {elapsed:.2f} s; it must print in < 1 s"
    tables = roofline.kernel_tables()
    assert len(tables) == 5, [t.title for t in tables]
    for table in tables:
        assert out.count(f"### {table.title}\n") == 1, table.title
        assert table.rows, table.title
    assert out.count("| size | compulsory bytes |") == len(tables)
    assert out.count("| part | calls |") == 2  # the step at B = 1 and B = 8
    assert out.startswith("Analytic, not measured")
    assert out == roofline.render(), "two runs printed different text"


def test_floors_are_below_the_current_estimates(roofline: ModuleType) -> None:
    for table in roofline.kernel_tables():
        for row in table.rows:
            assert 0 < row.floor_s <= row.current_s, (table.title, row)
            assert row.current_s >= roofline.LAUNCH_S, (table.title, row)
    for B in (1, 8):
        for prefix in (1024, 8192):
            for part in roofline.step_parts(B, prefix):
                assert part.floor_s > 0, part
                assert part.current_s is None or part.floor_s <= part.current_s, part


def test_tree_attention_rereads_kv_n_times_g(roofline: ModuleType) -> None:
    r = roofline
    size = r.TreeAttentionSize(B=1, prefix=8192)
    rereads = r.tree_attention_l2_bytes(size) / r.kv_bytes(size)
    expected = r.N * r.H // r.HKV  # 60 nodes x 4 query heads per KV head = 240
    assert expected == 240
    assert abs(rereads / expected - 1) < 0.05, rereads


def test_step_floor_streams_llama_8b_weights(roofline: ModuleType) -> None:
    r = roofline
    # Llama-3.1-8B: 8.03 G parameters, of which the 128256 x 4096 embedding is only gathered.
    assert abs(r.TARGET_STREAMED - (8.03e9 - 128256 * 4096)) / r.TARGET_STREAMED < 0.01
    target = r.step_parts(1, 1024)[0]
    assert target.name.startswith("target linears")
    assert 3.0e-3 < target.floor_s < 3.4e-3, target  # 15 GB at 4.8 TB/s


def test_benchmarks_holds_the_output(roofline: ModuleType) -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    heading = "## The CUDA kernels against the H200 roofline"
    assert heading in text, f"BENCHMARKS.md lacks the section {heading!r}"
    section = text[text.index(heading) :]
    assert "python bench/roofline.py" in section
    assert roofline.render() in section, (
        "BENCHMARKS.md's roofline section differs from `python bench/roofline.py`; paste the "
        "script's output again"
    )


def test_built_designs_read_less_and_run_faster(roofline: ModuleType) -> None:
    r = roofline
    size = r.TreeAttentionSize(B=1, prefix=8192)
    built = r.tree_attention_built(size)
    assert built.traffic.startswith(r.si(4 * r.kv_bytes(size), "B")), built  # 4 row tiles
    for table in r.kernel_tables():
        if table.built is None:
            continue
        for reviewed, after in zip(table.rows, table.built, strict=True):
            assert after.floor_s == reviewed.floor_s, table.title
            assert after.floor_s <= after.current_s <= reviewed.current_s, (table.title, after)
