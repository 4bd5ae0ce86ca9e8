"""KVCache: uncommitted writes, advance, commit with compaction (shared and per-entry keep),
truncate, and the too-long error."""

from __future__ import annotations

import pytest
import torch

from rheo_engine.models.kv_cache import KVCache


def rows_of(values: list[float], B: int = 2, Hkv: int = 2, D: int = 3) -> torch.Tensor:
    """[B, n, Hkv, D] where row i of entry b holds values[i] + 100 b everywhere."""
    t = torch.tensor(values).view(1, -1, 1, 1) + 100 * torch.arange(B).view(B, 1, 1, 1)
    return t.expand(B, len(values), Hkv, D).clone()


def make(max_len: int = 8) -> KVCache:
    return KVCache(n_layers=2, batch=2, max_len=max_len, n_kv_heads=2, head_dim=3)


def test_write_rows_advance() -> None:
    c = make()
    assert c.k.shape == (2, 2, 8, 2, 3) and c.length == 0 and c.free == 8
    for layer in range(2):
        c.write(layer, rows_of([1, 2, 3]), -rows_of([1, 2, 3]))
    assert c.length == 0  # a write does not commit
    k, v = c.rows(1, 3)
    assert k.shape == (2, 3, 2, 3)
    assert torch.equal(k, rows_of([1, 2, 3])) and torch.equal(v, -rows_of([1, 2, 3]))
    c.advance(3)
    assert c.length == 3 and c.free == 5
    c.write(0, rows_of([4]), rows_of([4]))
    k, _ = c.rows(0, 1)
    assert torch.equal(k, rows_of([1, 2, 3, 4]))


def test_commit_compacts_kept_rows() -> None:
    c = make()
    for layer in range(2):
        c.write(layer, rows_of([1, 2]), rows_of([1, 2]))
    c.advance(2)
    for layer in range(2):
        c.write(layer, rows_of([10, 11, 12, 13, 14]), -rows_of([10, 11, 12, 13, 14]))
    c.commit(torch.tensor([0, 2, 3]))
    assert c.length == 5
    for layer in range(2):
        assert torch.equal(c.k[layer, :, :5], rows_of([1, 2, 10, 12, 13]))
        assert torch.equal(c.v[layer, :, 2:5], -rows_of([10, 12, 13]))


def test_commit_per_batch_entry() -> None:
    c = make()
    for layer in range(2):
        c.write(layer, rows_of([10, 11, 12, 13]), rows_of([10, 11, 12, 13]))
    c.commit(torch.tensor([[0, 3], [1, 2]]))
    assert c.length == 2
    assert torch.equal(c.k[:, 0, :2, 0, 0], torch.tensor([[10.0, 13.0]] * 2))
    assert torch.equal(c.v[:, 1, :2, 0, 0], torch.tensor([[111.0, 112.0]] * 2))


def test_commit_nothing_and_truncate() -> None:
    c = make()
    c.write(0, rows_of([1, 2]), rows_of([1, 2]))
    c.advance(2)
    c.commit(torch.tensor([], dtype=torch.long))
    assert c.length == 2
    c.truncate(1)
    assert c.length == 1
    with pytest.raises(ValueError, match="truncate"):
        c.truncate(3)


def test_too_long_names_the_fix() -> None:
    c = make(max_len=4)
    c.advance(3)
    with pytest.raises(
        ValueError, match=r"needs 5 rows but the cache holds max_len=4; raise max_len"
    ):
        c.write(0, rows_of([1, 2]), rows_of([1, 2]))
    with pytest.raises(ValueError, match="max_len=4"):
        c.advance(2)
    with pytest.raises(ValueError, match=r"keep must be"):
        c.commit(torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 1"):
        KVCache(1, 1, 0, 1, 1)
