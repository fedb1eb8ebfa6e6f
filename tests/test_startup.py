"""gpupool.startup: imports without the collector, and the collector's threshold for the
processes that stream ops (the client runtime, the worker)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from gpupool.startup import GC_YOUNG_THRESHOLD, imports_without_gc, restore_gc, tune_gc


@pytest.fixture(autouse=True)
def keep_collector() -> Iterator[None]:
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()
    gc.unfreeze()


def test_the_threshold_is_raised_and_restored_with_the_others_kept() -> None:
    gc.set_threshold(700, 11, 12)
    replaced = tune_gc()
    assert replaced == (700, 11, 12)
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 11, 12)
    restore_gc(replaced)
    assert gc.get_threshold() == (700, 11, 12)


def test_a_higher_threshold_or_a_disabled_collector_is_left_alone() -> None:
    gc.set_threshold(50_000, 10, 10)
    assert tune_gc() is None and gc.get_threshold()[0] == 50_000
    gc.set_threshold(0, 10, 10)  # threshold 0: the program turned collection off
    assert tune_gc() is None and gc.get_threshold()[0] == 0


def test_the_environment_chooses_the_threshold_or_keeps_pythons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.set_threshold(700, 10, 10)
    monkeypatch.setenv("GPUPOOL_GC_THRESHOLD", "0")
    assert tune_gc() is None and gc.get_threshold()[0] == 700
    monkeypatch.setenv("GPUPOOL_GC_THRESHOLD", "2500")
    assert tune_gc() == (700, 10, 10) and gc.get_threshold()[0] == 2500
    monkeypatch.setenv("GPUPOOL_GC_THRESHOLD", "many")  # not a number: gpupool's default
    gc.set_threshold(700, 10, 10)
    assert tune_gc() is not None and gc.get_threshold()[0] == GC_YOUNG_THRESHOLD


def test_a_threshold_the_program_changed_since_is_not_restored() -> None:
    gc.set_threshold(700, 10, 10)
    replaced = tune_gc()
    gc.set_threshold(123, 10, 10)
    restore_gc(replaced)
    assert gc.get_threshold()[0] == 123


def test_imports_run_without_the_collector_and_it_comes_back() -> None:
    gc.enable()
    with imports_without_gc(freeze=False):
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with imports_without_gc(freeze=True):
        pass
    assert not gc.isenabled() and gc.get_freeze_count() > 0
