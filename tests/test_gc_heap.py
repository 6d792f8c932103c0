"""Start-up's objects leave the collector's reach: a full collection in a serving process then walks only what serving
allocated (tokenmill/gc_heap.py)."""

from __future__ import annotations

import gc

from tokenmill.gc_heap import freeze_startup_heap


def test_what_start_up_built_is_frozen_and_full_collections_skip_it():
    built_at_start_up = [[i] for i in range(100_000)]  # containers the collector tracks, as a model's modules are
    gc.collect()
    tracked_before = len(gc.get_objects(generation=2))
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(built_at_start_up)
        assert len(gc.get_objects(generation=2)) < tracked_before - len(built_at_start_up)
        made_later = [[i] for i in range(10)]
        gc.collect()  # survivors made after the freeze stay collectable
        assert any(obj is made_later[0] for obj in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
