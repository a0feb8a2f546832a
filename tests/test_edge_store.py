"""Per-client disk store, the node's asset cache and the shared round payloads."""

import threading

import numpy as np
import pytest

from fcl_emu.edge_node.store import ArrayStore, AssetCache, RoundPayloads, same_values


def test_array_store_round_trip_and_names(tmp_path):
    store = ArrayStore(tmp_path / "client-0001")
    assert store.load("fisher") is None and not store.has("fisher")
    arrays = {"backbone/conv.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(3)}
    store.save("fisher", arrays)
    loaded = store.load("fisher")
    assert loaded.keys() == arrays.keys()
    for k in arrays:
        np.testing.assert_array_equal(loaded[k], arrays[k])
    store.delete("fisher")
    assert not store.has("fisher")
    with pytest.raises(ValueError):
        store.save("../escape", arrays)


def test_asset_cache_shares_equal_content_only():
    cache = AssetCache()
    a = cache.intern("w", np.ones(4, np.float32))
    b = cache.intern("w", np.ones(4, np.float32))
    c = cache.intern("w", np.zeros(4, np.float32))
    assert a is b and c is not a
    cache.retain([{"w": c}])
    assert cache.intern("w", np.ones(4, np.float32)) is not a


def test_round_payloads_keep_one_copy_per_round():
    payloads = RoundPayloads()
    first = {"w": np.ones(1000, np.float32)}
    same = {"w": np.ones(1000, np.float32)}
    other = {"w": np.zeros(1000, np.float32)}
    assert payloads.acquire(1, first) is first
    assert payloads.acquire(1, same) is first  # the duplicate can be freed
    assert payloads.acquire(1, other) is other  # personalised payloads stay apart
    payloads.release(1, first)
    payloads.release(1, first)
    assert payloads.acquire(1, same) is same  # round released: a fresh entry


def test_views_of_one_buffer_are_the_same_values_without_a_look_at_them():
    """Tensors a shared connection holds reach every client as views of one buffer: equal at once, NaN included
    (the bits are the same); views that differ in shape or place, or copies, are compared value by value."""
    buffer = np.array([1.0, np.nan, 3.0, 4.0], np.float32).tobytes()
    a, b = np.frombuffer(buffer, np.float32), np.frombuffer(buffer, np.float32)
    assert a is not b and same_values(a, b)
    assert not same_values(a, a.copy())  # NaN is not equal to NaN when compared
    assert not same_values(a[:2], a[2:]) and not same_values(a, a.reshape(2, 2))
    assert same_values(a[2:], np.array([3.0, 4.0], np.float32))


def test_round_payloads_under_concurrent_release():
    payloads = RoundPayloads()
    model = {"w": np.ones(10, np.float32)}
    shared = [payloads.acquire(7, {"w": np.ones(10, np.float32)}) for _ in range(200)]
    threads = [threading.Thread(target=payloads.release, args=(7, t)) for t in shared]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert payloads.acquire(7, model) is model
