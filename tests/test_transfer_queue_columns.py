"""Columnar puts and takes (`transfer_queue.columns`), the coalescing of the Ray client's columnar
puts (`put_buffer`), and STORE-1's per-sample checksum computed with column operations."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from asyncflow.bench.store1 import (
    FIELDS,
    Store1Spec,
    checksum,
    checksums,
    expected_checksums,
    make_batches,
    verify,
)
from asyncflow.transfer_queue import TransferQueue
from asyncflow.transfer_queue.api import SampleView
from asyncflow.transfer_queue.columns import ColumnIndex, blocks_from_slots
from asyncflow.transfer_queue.payload import rows_of
from asyncflow.transfer_queue.put_buffer import PutBuffer
from asyncflow.transfer_queue.ray_data import RowsSlot, Slot, compact_views, expand_views


def _put(q: TransferQueue, start: int, n: int) -> tuple[list[int], dict[str, np.ndarray]]:
    cols = {"x": np.arange(start, start + n, dtype=np.int64), "m": np.arange(3 * start, 3 * (start + n)).reshape(n, 3),
            "tag": [f"t{i}" for i in range(start, start + n)]}
    return q.put_columns_blocking(cols, list(range(start, start + n)), 1), cols


def test_columnar_take_hands_out_views_of_the_put_columns_equal_to_the_data() -> None:
    q = TransferQueue(capacity=64)
    q.register_stage("s", ["x", "m"])
    _, a = _put(q, 0, 4)
    _, b = _put(q, 4, 4)
    got = q.take_columns_blocking("s", 6, min_samples=6, fields_extra=["tag"])
    assert [len(blk["x"]) for blk in got.blocks] == [4, 2]  # one block per put, rows in lease order
    assert np.shares_memory(got.blocks[0]["m"], a["m"]) and np.shares_memory(got.blocks[1]["m"], b["m"])
    assert got.column("x").tolist() == list(range(6)) == [s.fields["x"] for s in got.lease.samples]
    assert got.column("m").tolist() == np.arange(18).reshape(6, 3).tolist()
    assert got.column("tag") == [f"t{i}" for i in range(6)]
    assert q.ack(got.lease, remove=True) and q.size() == 2
    rest = q.take_columns_blocking("s", 2, min_samples=2)
    assert rest.column("x").tolist() == [6, 7] and set(rest.blocks[0]) == {"x", "m"}


def test_iter_columns_takes_batches_of_the_size_asked_the_last_one_what_is_left() -> None:
    q = TransferQueue(capacity=64)
    q.register_stage("s", ["x"])
    _put(q, 0, 10)
    sizes, xs = [], []
    for got in q.iter_columns("s", 4, 10, timeout=5):
        sizes.append(len(got.lease.samples))
        xs += got.column("x").tolist()
        assert q.ack(got.lease, remove=True)
    assert sizes == [4, 4, 2] and xs == list(range(10)) and q.size() == 0
    assert list(q.iter_columns("s", 4, 0)) == []
    with pytest.raises(ValueError, match="batch >= 1"):
        next(q.iter_columns("s", 0, 10))
    with pytest.raises(ValueError, match="readahead >= 0"):
        next(q.iter_columns("s", 4, 10, readahead=-1))


def test_a_columnar_put_counts_the_payload_bytes_its_rows_put_one_by_one_would() -> None:
    cols = {"ids": np.zeros((4, 6), dtype=np.int64), "r": np.ones(4, dtype=np.float32),
            "toks": [[1, 2], [3], [], [4, 5, 6]], "obj": np.array([[1], [2, 3], [], [4]], dtype=object), "name": list("abcd")}
    by_columns, by_rows = TransferQueue(capacity=8), TransferQueue(capacity=8)
    by_columns.put_columns_blocking(cols, [0, 1, 2, 3], 1)
    by_rows.put_blocking(rows_of(cols, [0, 1, 2, 3], 1))
    assert by_columns.metrics()["bytes_put"] == by_rows.metrics()["bytes_put"] == 4 * 48 + 4 * 4 + 8 * 6 + 8 * 4


def test_a_field_written_after_the_put_is_served_as_written() -> None:
    q = TransferQueue(capacity=64)
    q.register_stage("s", ["x", "m"])
    uids, _ = _put(q, 0, 4)
    q.write(uids[1], {"m": np.array([7, 7, 7])})
    got = q.take_columns_blocking("s", 4, min_samples=4)
    assert [len(blk["x"]) for blk in got.blocks] == [1, 1, 2]  # the written row on its own
    assert got.column("m").tolist() == [[0, 1, 2], [7, 7, 7], [6, 7, 8], [9, 10, 11]]


def test_rows_put_one_by_one_come_back_as_one_row_blocks() -> None:
    from asyncflow.transfer_queue import NewSample

    q = TransferQueue(capacity=64)
    q.register_stage("s", ["x"])
    q.put_blocking([NewSample(i, 1, {"x": np.array([i])}) for i in range(3)])
    got = q.take_columns_blocking("s", 3, min_samples=3)
    assert got.column("x").tolist() == [[0], [1], [2]] and len(got.blocks) == 3


def test_the_index_forgets_puts_whose_samples_are_all_gone() -> None:
    index = ColumnIndex()
    live: set[int] = set()
    for start in range(0, 400, 4):
        uids = list(range(start, start + 4))
        live.update(uids)
        index.add(uids, {"x": np.array(uids)}, {"x": [object() for _ in uids]}, live.__contains__)
        live.difference_update(uids)  # (consumed at once)
    assert len(index) <= 32  # pruned when the count doubles, not kept for every put


def test_slot_runs_become_slices_and_anything_else_one_row_blocks() -> None:
    blob = {"a": np.arange(10) * 10, "b": np.arange(20).reshape(10, 2)}
    views = [SampleView(u, 0, None, {"a": RowsSlot(5, 100, 8), "b": RowsSlot(5, 100, 16)}) for u in (102, 103, 104)]
    views.append(SampleView(107, 0, None, {"a": Slot(5, 7, 8), "b": Slot(5, 7, 16)}))  # not the next row
    views.append(SampleView(108, 0, None, {"a": 42, "b": Slot(5, 8, 16)}))  # one field inline
    compact = compact_views(views)
    blocks = blocks_from_slots(compact, {5: blob})
    assert [len(b["a"]) for b in blocks] == [3, 1, 1]
    assert np.shares_memory(blocks[0]["b"], blob["b"])
    assert blocks[0]["a"].tolist() == [20, 30, 40] and blocks[1]["b"].tolist() == [[14, 15]]
    assert blocks[2]["a"] == [42] and blocks[2]["b"].tolist() == [[16, 17]]


def test_compacted_views_keep_every_slot_and_inline_value_across_runs_and_single_views() -> None:
    """Runs of one columnar put's slots are filled as arrays, every other view field by field; both
    give the same (blob, row) per field, and `expand_views` reads back each sample's own values."""
    rs, other = RowsSlot(5, 10, 8), RowsSlot(6, 12, 8)
    views = [SampleView(10, 0, None, {"a": rs, "b": rs}), SampleView(11, 0, 3, {"a": rs, "b": rs}),
             SampleView(12, 1, None, {"a": rs, "b": 7}),  # a written value: field by field
             SampleView(13, 1, None, {"b": rs, "a": rs}),  # other key order: a run of its own
             SampleView(14, 2, None, {"a": Slot(2, 3, 4)}),  # a row slot, "b" absent
             SampleView(15, 2, None, {"a": other, "b": other}), SampleView(16, 2, None, {"a": other, "b": other})]
    uids, gids, versions, names, slots, inline = compact_views(views)
    assert uids == list(range(10, 17)) and gids == [0, 0, 1, 1, 2, 2, 2] and versions[1] == 3 and names == ["a", "b"]
    assert slots.tolist() == [[[5, 0], [5, 0]], [[5, 1], [5, 1]], [[5, 2], [-1, -1]], [[5, 3], [5, 3]],
                              [[2, 3], [-1, -1]], [[6, 3], [6, 3]], [[6, 4], [6, 4]]]
    assert inline == [None, None, {"b": 7}, None, None, None, None]
    blob5 = {"a": np.arange(100, 110), "b": np.arange(200, 210)}
    values = {5: blob5, 6: {"a": np.arange(300, 310), "b": np.arange(400, 410)}, 2: [{}, {}, {}, {"a": "row3"}]}
    back = expand_views(compact_views(views), values)
    assert [v.fields for v in back] == [{"a": 100, "b": 200}, {"a": 101, "b": 201}, {"a": 102, "b": 7},
                                        {"a": 103, "b": 203}, {"a": "row3"}, {"a": 303, "b": 403},
                                        {"a": 304, "b": 404}]
    assert compact_views([])[4].shape == (0, 0, 2)


def test_coalesced_puts_go_out_together_or_after_the_window() -> None:
    sent: list[tuple[int, float | None]] = []
    done = threading.Event()

    def send(parts, columns, timeout):  # type: ignore[no-untyped-def]
        assert len(parts) == len(columns)
        sent.append((len(parts), timeout))
        done.set()

    buf = PutBuffer(send, coalesce_s=60.0, max_bytes=100)
    for i in range(5):
        buf.add(([i], 1, [i], ["x"], [40]), {"x": np.zeros(5)}, 40, 1.0 + i)
    assert sent == [(3, 3.0)]  # the third reached max_bytes: those three in one send
    buf.send()
    assert sent == [(3, 3.0), (2, 5.0)]
    buf.add(([9], 1, [9], ["x"], [1]), {"x": np.zeros(1)}, 1, None)
    buf.send()
    assert sent[-1] == (1, None)
    quick = PutBuffer(send, coalesce_s=0.01)
    done.clear()
    quick.add(([0], 1, [0], ["x"], [1]), {"x": np.zeros(1)}, 1, 2.0)
    assert done.wait(10.0) and sent[-1] == (1, 2.0)  # alone, it went after the window


def test_a_failed_send_by_the_timer_is_raised_by_the_next_put() -> None:
    tried = threading.Event()

    def send(parts, columns, timeout):  # type: ignore[no-untyped-def]
        tried.set()  # (the timer holds the buffer's lock until it has kept the error)
        raise RuntimeError("object store full")

    buf = PutBuffer(send, coalesce_s=0.001)
    buf.add(([0], 1, [0], ["x"], [1]), {"x": np.zeros(1)}, 1, None)
    assert tried.wait(10.0)
    with pytest.raises(RuntimeError, match="object store full"):
        buf.add(([1], 1, [1], ["x"], [1]), {"x": np.zeros(1)}, 1, None)


def test_store1_checksums_match_the_per_sample_checksum_and_catch_a_corrupted_sample() -> None:
    batches = make_batches(Store1Spec(samples=96))
    expected = expected_checksums(batches)
    b = batches[1]
    per_sample = [checksum(*(b[f][j] for f in FIELDS)) for j in range(len(b["idx"]))]
    assert checksums(*(b[f] for f in FIELDS)).tolist() == per_sample == expected[b["idx"]].tolist()
    seen = np.zeros(len(expected), dtype=bool)
    assert verify(dict(b), expected, seen) == 32 and seen[64:].all() and not seen[:64].any()
    with pytest.raises(RuntimeError, match="delivered twice"):
        verify(dict(b), expected, seen)
    for field in FIELDS:  # one changed value in one sample's row fails, naming that sample
        bad = {k: np.array(v, copy=True) for k, v in batches[0].items()}
        if bad[field].ndim == 2:
            bad[field][5, 17] += 1
        else:
            bad[field][5] = np.nextafter(bad[field][5], np.float32(2.0))
        with pytest.raises(RuntimeError, match="checksum mismatch on sample 5"):
            verify(bad, expected, np.zeros(len(expected), dtype=bool))


def test_a_coalesced_put_leases_the_same_samples_and_rows_as_one_put_per_batch() -> None:
    """The controller's `put_parts` (several columnar puts in one call, one shared slot per field)
    against `put` of each batch with a slot per field and row: the same leases, the same values."""
    import asyncio

    from asyncflow.transfer_queue.ray_controller import StoreController
    from asyncflow.transfer_queue.ray_data import expand_views

    batches = [{"x": np.arange(8 * b, 8 * b + 8), "m": np.arange(24 * b, 24 * b + 24).reshape(8, 3)} for b in range(3)]
    names, per_row = ["x", "m"], [8, 24]

    async def run(coalesced: bool) -> list[tuple[int, int, list[int]]]:
        c = StoreController(64, 600.0)
        c.register_stage("s", ["x", "m"], False)
        first = c.reserve_uids(24)
        parts = [(list(range(8 * b, 8 * b + 8)), 1, list(range(first + 8 * b, first + 8 * b + 8)), names, per_row)
                 for b in range(3)]
        if coalesced:
            await c.put_parts(parts, ["REF"], None)
        else:
            nbytes = np.tile(np.array(per_row, dtype=np.int64), (8, 1))
            for gids, size, uids, _, _ in parts:
                await c.put((gids, [size] * 8, [None] * 8, uids), None, names, nbytes, ["REF"], None)
        values = {bid: batches[i] for i, bid in enumerate(sorted(c.blobs))}  # (blob i: batch i, both ways)
        out = []
        for _ in range(2):
            compact, _ = await c.take("s", 12, 12, None, None, None, [], None)
            for v in expand_views(compact[3], values):
                out.append((v.uid - first, int(v.fields["x"]), v.fields["m"].tolist()))
            c.apply([("ack", (compact[0], "s", True, None))])
        assert c.q.size() == 0 and not c.blobs  # every blob let go with its last row
        return out

    one_by_one, together = asyncio.run(run(False)), asyncio.run(run(True))
    assert together == one_by_one and [x for _, x, _ in together] == list(range(24))
