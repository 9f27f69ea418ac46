"""bench.placement: the page tables the decode benchmarks read through are valid and as described."""

import pytest

from bench.placement import PLACEMENTS, page_tables, runs


@pytest.mark.parametrize("kind", PLACEMENTS)
@pytest.mark.parametrize("batch,npages", [(1, 300), (8, 64), (64, 16)])
def test_tables_are_distinct_pages_of_the_pool(kind, batch, npages):
    tables, nb = page_tables(kind, batch, npages, 16, seed=3)
    assert len(tables) == batch and all(len(r) == npages for r in tables)
    flat = [p for r in tables for p in r]
    assert len(set(flat)) == len(flat)
    assert all(0 <= p < nb for p in flat)
    assert page_tables(kind, batch, npages, 16, seed=3) == (tables, nb)


def test_placements_differ_as_documented():
    shuffled, _ = page_tables("shuffled", 16, 128, 16, seed=1)
    in_order, _ = page_tables("in_order", 16, 128, 16, seed=1)
    served, _ = page_tables("served", 16, 128, 16, seed=1)
    assert runs(in_order)["ascending"] == 1.0
    assert runs(shuffled)["ascending"] + runs(shuffled)["descending"] < 0.01
    # vLLM's free queue hands out runs, some reversed by the frees, and decode blocks interleave.
    r = runs(served)
    assert 0.05 < r["ascending"] < 1.0 and r["descending"] > 0.05


def test_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="placement"):
        page_tables("sorted", 1, 4, 16)
