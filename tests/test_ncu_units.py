"""`bench/ncu_units.py`: its parser of Nsight Compute's ``--csv --metrics`` output and its
variant specs (CPU)."""

import pytest

from bench import ncu_units

_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
           '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
           '"Metric Value"')


def _row(launch: int, metric: str, unit: str, value: str) -> str:
    return (f'"{launch}","834","python3.12","127.0.0.1","kernel_cutlass_kernel_x","1","7",'
            f'"(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","{metric}",'
            f'"{unit}","{value}"')


def test_parses_each_launch_in_order():
    text = "\n".join([
        "==PROF== Connected to process 834", "program output", _HEADER,
        _row(0, "gpu__time_duration.sum", "ns", "1,561,920"),
        _row(0, "sm__cycles_elapsed.avg.per_second", "hz", "1,557,867,822.35"),
        _row(0, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "%", "76.04"),
        _row(0, "smsp__inst_executed.sum", "inst", "440,727,704"),
        _row(0, "some__other_metric", "%", "12"),
        _row(1, "gpu__time_duration.sum", "ns", "822,880"),
        _row(1, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "%", "70.15"),
        "==PROF== Disconnected"])
    l1, l2 = ncu_units.parse_ncu_csv(text)
    assert l1 == pytest.approx({"us": 1561.92, "sm_ghz": 1.55786782235, "tensor_pct": 76.04,
                                "minst": 440.727704})
    assert l2 == pytest.approx({"us": 822.88, "tensor_pct": 70.15})
    assert ncu_units.parse_ncu_csv("==PROF== no kernels were profiled\n") == []


def test_variant_specs():
    assert ncu_units.parse_variant("default") == ("default", [])
    assert ncu_units.parse_variant("u1:k_unroll=1,promotion=chunk") == (
        "u1", ["k_unroll=1", "promotion=chunk"])
    for bad in ("u1:PATH=/tmp", ":k_unroll=1", "u1:k_unroll", "u1:k_unroll=3"):
        with pytest.raises(SystemExit):
            ncu_units.parse_variant(bad)


def test_parses_the_stall_metrics_when_asked():
    wanted = {**ncu_units.METRICS, **ncu_units.STALL_METRICS}
    text = "\n".join([
        _HEADER,
        _row(0, "gpu__time_duration.sum", "ns", "700,000"),
        _row(0, "smsp__issue_active.avg.pct_of_peak_sustained_active", "%", "48.5"),
        _row(0, "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio",
             "ratio", "0.31"),
        _row(0, "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "ratio",
             "1.2")])
    (launch,) = ncu_units.parse_ncu_csv(text, wanted)
    assert launch == pytest.approx({"us": 700.0, "issue_pct": 48.5, "stall_no_instruction": 0.31,
                                    "stall_barrier": 1.2})
    # without the stall metrics asked for, their rows are skipped
    assert ncu_units.parse_ncu_csv(text) == [pytest.approx({"us": 700.0})]
    assert len({m for m, _f in wanted.values()}) == len(wanted)
