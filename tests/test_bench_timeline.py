"""`bench.timeline`: a fused call's per-CTA phase stamps as segments and a PNG (the recording
itself runs on a GPU: `python -m bench.timeline`)."""

import json

import pytest

from bench import timeline
from cute_megamoe.kernels.sm90_mega_moe import PHASE_STAMPS


def _stamps(rows: list[dict]) -> list[list[int]]:
    return [[row.get(name, 0) for name in PHASE_STAMPS] for row in rows]


def test_the_phases_are_the_kernels_stamps():
    assert all(first in PHASE_STAMPS and last in PHASE_STAMPS
               for _, first, last in timeline.PHASES)


def test_segments_in_us_from_the_first_start_without_unreached_phases():
    stamps = _stamps([
        dict(start=5_000, rows_sent=9_000, l1_done=50_000, l2_done=80_000, end=90_500),
        dict(start=1_000, rows_sent=8_000, l1_done=60_000),  # stopped before its L2 end
    ])
    assert timeline.segments(stamps, PHASE_STAMPS) == [
        (0, "dispatch", 4.0, 8.0), (0, "L1", 8.0, 49.0), (0, "L2", 49.0, 79.0),
        (0, "combine", 79.0, 89.5),
        (1, "dispatch", 0.0, 7.0), (1, "L1", 7.0, 59.0)]


@pytest.mark.parametrize("rows,message", [
    ([dict(rows_sent=3)], "no CTA stamped its start"),
    ([dict(start=10, rows_sent=4)], "CTA 0's rows_sent"),
])
def test_bad_stamps_raise(rows, message):
    with pytest.raises(ValueError, match=message):
        timeline.segments(_stamps(rows), PHASE_STAMPS)


def test_replotting_needs_a_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["timeline", "--from", str(tmp_path / "t.json")])
    with pytest.raises(SystemExit):
        timeline.main()
    assert "--from needs --out" in capsys.readouterr().err


def test_plot_writes_a_png_from_a_runs_json(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) draws the PNG")
    stamps = _stamps([dict(start=1_000 * c, rows_sent=9_000, l1_done=50_000 + c, l2_done=80_000,
                           end=90_000) for c in range(4)])
    source = tmp_path / "timeline.json"
    source.write_text(json.dumps({"meta": {
        "stamps": stamps, "stamp_names": list(PHASE_STAMPS), "tokens": 8192, "experts": 128,
        "recipe": "fp8xfp8", "block_m": 128, "gpu": "test"}, "rows": []}))
    out = tmp_path / "t.png"
    monkeypatch.setattr("sys.argv", ["timeline", "--from", str(source), "--out", str(out)])
    timeline.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 2000


def test_tile_spans_of_the_ticket_walks_clock_across_a_timer_wrap():
    """`tile_spans`: one bar per recorded tile ((1 + is_l2) << 24 | n-block, pool block,
    start, end: the timer's low 32 bits), times from the earliest start, across the low
    word's wrap; an empty entry (code 0) ends a CTA's list; bad entries raise."""
    top = 2**32
    tiles = [[(1 << 24 | 3, 0, top - 2_000, top - 1_000), (2 << 24, 0, top - 500, 1_500)],
             [(1 << 24, 1, top - 3_000, top - 2_500), (0, 0, 0, 0)]]
    assert timeline.tile_spans(tiles) == [(0, "L1", 1.0, 2.0), (0, "L2", 2.5, 4.5),
                                          (1, "L1", 0.0, 0.5)]
    with pytest.raises(ValueError, match="no CTA recorded"):
        timeline.tile_spans([[(0, 0, 0, 0)]])
    with pytest.raises(ValueError, match="code 0x3000000"):
        timeline.tile_spans([[(3 << 24, 0, 10, 20)]])
    with pytest.raises(ValueError, match="ends"):
        timeline.tile_spans([[(1 << 24, 0, 30, 20)]])


def test_plot_writes_a_png_of_the_ticket_walks_tiles(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) draws the PNG")
    tiles = [[(1 << 24 | n, c, 1_000 * n, 1_000 * n + 900) for n in range(4)]
             + [(2 << 24, c, 5_000, 5_500)] for c in range(4)]
    source = tmp_path / "timeline.json"
    source.write_text(json.dumps({"meta": {
        "stamps": tiles, "stamp_names": [], "walk": "tickets", "tokens": 8192, "experts": 128,
        "recipe": "fp8xfp8", "block_m": 128, "gpu": "test"}, "rows": []}))
    out = tmp_path / "t.png"
    monkeypatch.setattr("sys.argv", ["timeline", "--from", str(source), "--out", str(out)])
    timeline.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 2000
