"""Stall and disagreement reports (`reports`): the host's messages for each kind of record,
and the names every kernel wait and check uses."""

import pytest

from cute_megamoe.reports import REPORT_NAMES, REPORT_WORDS, ReportKind, format_report


def _record(kind, name, cta=3, thread=70, value=5, target=9, source=1, expert=12):
    words = [kind, REPORT_NAMES.index(name), cta, thread, value, target, source, expert]
    return words + [0] * (REPORT_WORDS - len(words))


def test_an_empty_record_is_no_report():
    assert format_report([0] * REPORT_WORDS, 0) is None


@pytest.mark.parametrize("kind,name,message", [
    (ReportKind.STALL, "grid barrier",
     "cute_megamoe: wait on grid barrier stalled (rank 1, cta 3, thread 70): value 5, target 9"),
    (ReportKind.STALL, "rows of a pool block (pool_block_arrivals)",
     "cute_megamoe: wait on rows of a pool block (pool_block_arrivals) stalled (rank 1, cta 3, "
     "thread 70): value 5, target 9"),
    (ReportKind.DISAGREE, "the dispatch transfer (1: push, 0: pull)",
     "cute_megamoe: ranks disagree on the dispatch transfer (1: push, 0: pull) (rank 1, cta 3, "
     "thread 70): a peer's 5, this rank's 9"),
    (ReportKind.OUT_OF_STEP, "expert_recv_count",
     "cute_megamoe: ranks are out of step (rank 1, cta 3, thread 70): rank 1 published "
     "expert_recv_count of expert 12 for call 5, this rank is at call 9; a rank skipped a call "
     "the others made"),
    (ReportKind.SPLIT_STALL, "split barrier signal",
     "cute_megamoe: wait on split barrier signal 12 stalled (rank 1, cta 3, thread 70): value "
     "5, target 9; 1 of this rank's CTAs have arrived"),
    (ReportKind.NOT_PUBLISHED, "expert_recv_count",
     "cute_megamoe: wait on expert_recv_count stalled (rank 1, cta 3, thread 70): rank 1 has "
     "not published expert 12 for call 9 (its word holds call 5)"),
    (ReportKind.TOKEN_STALL, "the L2 rows of a token (token_arrivals)",
     "cute_megamoe: wait on the L2 rows of a token (token_arrivals) stalled (rank 1, cta 3, "
     "thread 70): token 12 has 5 of its 9 rows (a rank that owns one of its experts did not "
     "send it, or does not signal tokens: every rank of a call must use the same combine)"),
])
def test_messages(kind, name, message):
    assert format_report(_record(kind, name), 1) == message


def test_a_split_barrier_stall_names_whether_this_rank_is_complete():
    text = format_report(_record(ReportKind.SPLIT_STALL, "split barrier signal", source=0,
                                 expert=3), 0)
    assert text.endswith("value 5, target 9; every CTA of this rank has arrived")


def test_a_split_barrier_stall_names_the_ctas_that_did_not_arrive():
    """The fused kernel's report lists the CTAs whose warpgroups were not all at the combine,
    with each warpgroup's step, and says which words are from an earlier call."""
    from cute_megamoe.reports import (
        PROGRESS_ENTRIES,
        PROGRESS_ENTRY_WORDS,
        PROGRESS_OFFSET,
        Progress,
    )

    words = _record(ReportKind.SPLIT_STALL, "split barrier signal", source=128, expert=0)
    tag = 0x9B
    words[PROGRESS_OFFSET:PROGRESS_OFFSET + 3] = [PROGRESS_ENTRIES + 2, tag, 3]
    for i in range(PROGRESS_ENTRIES):
        first = PROGRESS_OFFSET + 3 + i * PROGRESS_ENTRY_WORDS
        words[first:first + 4] = [100 + i, Progress.word(tag, Progress.COMBINE_REGS),
                                  Progress.word(tag, Progress.GEMM_REGS),
                                  Progress.word(tag - 1, Progress.COMBINE)]
    text = format_report(words, 0)
    assert text.startswith("cute_megamoe: wait on split barrier signal 0 stalled (rank 0, cta 3, "
                           "thread 70): value 5, target 9; 128 of this rank's CTAs have "
                           "arrived. CTAs that did not arrive (10): cta 100 (warpgroup 0: "
                           "registers for the combine (setmaxnreg), warpgroup 1: registers "
                           "for the GEMM roles (setmaxnreg), warpgroup 2: not started in this "
                           "call (last: the combine)); cta 101 ("), text
    assert text.count("cta 1") == PROGRESS_ENTRIES and text.endswith("; and 2 more"), text


def test_progress_words_read_back_as_written():
    from cute_megamoe.reports import Progress

    for tag in (0, 1, 0x7F, 0x80, 0xFF, 0x1234):
        for step, name in enumerate(Progress.STEPS):
            word = Progress.word(tag, step)
            assert -(1 << 31) <= word < 1 << 31
            assert Progress.describe(word, tag) == name
    assert Progress.STEPS[Progress.COMBINE] == "the combine"
    assert Progress.COMBINE == len(Progress.STEPS) - 1  # (the last step a report waits for)


def test_the_recipe_field_names_every_recipe_code():
    from cute_megamoe.reports import RECIPE_FIELD
    from cute_megamoe.tables import RECIPES

    text = format_report(_record(ReportKind.DISAGREE, RECIPE_FIELD, value=0, target=1), 0)
    assert text.startswith("cute_megamoe: ranks disagree on the recipe (0: ")
    assert all(f"{i}: {r}" in text for i, r in enumerate(RECIPES))


def test_every_wait_of_the_kernels_has_a_name():
    """Every literal a kernel passes as a wait's or check's name is a report name (a missing
    one fails at trace time, in the compile tests; this reads the sources)."""
    import pathlib
    import re

    kernels = pathlib.Path(__file__).parents[1] / "cute_megamoe" / "kernels"
    used = set()
    for path in kernels.rglob("*.py"):
        text = path.read_text()
        for call in re.finditer(r"(?<!def )\b(wait_reached|wait_eq|report_disagreement|"
                                r"wait_call_tag)\(", text):
            depth, end = 1, call.end()
            while depth:  # the call's arguments, to its closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            used.update(m for m in re.findall(r'"([^"]+)"', text[call.end():end])
                        if m not in ("gpu", "sys"))
    assert used and used <= set(REPORT_NAMES), used - set(REPORT_NAMES)


def test_a_buffer_with_a_report_refuses_to_launch():
    """After a trap the entry points raise the record's message before touching CUDA (a CPU
    buffer stands in for a CUDA one: its record is set by hand)."""
    import torch

    from cute_megamoe.buffer import SymmBuffer
    from cute_megamoe.launch import buffer_state

    buf = SymmBuffer(None, 8, 64, 2, 256, 128, mma_type="fp8xfp8", device="cpu")
    assert buf.report() is None
    buf.raise_if_reported()  # (no record: nothing to raise)
    buf.report_record = torch.zeros(REPORT_WORDS, dtype=torch.int32)
    buf._report_words = buf.report_record.numpy()
    buf.raise_if_reported()  # (an empty record)
    buf.report_record.copy_(torch.tensor(_record(ReportKind.STALL, "grid barrier")))
    message = "cute_megamoe: wait on grid barrier stalled (rank 0, cta 3, thread 70)"
    assert buf.report().startswith(message)
    for call in (buf.raise_if_reported, lambda: buffer_state(buf)):
        with pytest.raises(RuntimeError, match=r"stalled \(rank 0, cta 3.*a kernel trapped"):
            call()


@pytest.mark.parametrize("fields,message", [
    ([1, 4 * 7 + 2, 19, 0], "token 7 slot 2 holds expert index 19, out of range (valid: -1 "
     "for a masked slot, or 0..15) (rank 1, found by the dispatch on the GPU in an earlier "
     "call, which treated the bad slots as masked)"),
    ([3, 1, -5, -1], "token 0 slot 1 holds expert index -5, out of range (valid: -1 for a "
     "masked slot, or 0..15) (rank 1, found by the dispatch on the GPU in an earlier call, "
     "which treated the bad slots as masked; 3 bad slots in all)"),
    ([1, 9, 3, 0], "token 2 slot 1 names expert 3 again (a token names an expert once; mask "
     "repeats with -1) (rank 1, found by the dispatch on the GPU in an earlier call, which "
     "treated the bad slots as masked)"),
])
def test_routing_errors_name_the_token_the_slot_and_the_value(fields, message):
    from cute_megamoe.reports import format_routing_error

    assert format_routing_error([0, 0, 0, 0], 4, 16, 1) is None
    assert format_routing_error(fields, 4, 16, 1) == f"topk_idx: {message}"
    # (a value past int32: both words)
    assert "expert index 1099511627779," in format_routing_error([1, 0, 3, 256], 4, 16, 0)


def test_a_routing_error_is_raised_once_and_taken():
    """The record the dispatch leaves (`kernels/common/routing.py`) raises `ValueError` once
    (a CPU buffer stands in: its record is set by hand); the stall report is untouched."""
    import torch

    from cute_megamoe.buffer import SymmBuffer
    from cute_megamoe.reports import ROUTING_OFFSET

    buf = SymmBuffer(None, 8, 64, 2, 256, 128, mma_type="fp8xfp8", device="cpu")
    buf.raise_routing_error()  # (no record)
    buf.check_routing_errors()
    buf.report_record = torch.zeros(REPORT_WORDS, dtype=torch.int32)
    buf._report_words = buf.report_record.numpy()
    buf.raise_routing_error()  # (an empty record)
    buf.report_record[ROUTING_OFFSET:] = torch.tensor([2, 5, 8, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"token 2 slot 1 holds expert index 8, .*2 bad slots"):
        buf.raise_routing_error()
    buf.raise_routing_error()  # (taken)
    assert buf.report() is None and not bool(buf.report_record.any())
