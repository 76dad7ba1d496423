"""`bench.common.sustained_power`: the runs in turn, medians over the rounds (CPU: the
sampler is replaced)."""

import json

import bench.common as common


def test_sustained_power_takes_runs_in_turn_and_medians(monkeypatch):
    calls = []
    # per name, the readings of its successive rounds (the median of three is the middle one)
    readings = {"a": [(700.0, 1300.0, 3e-3), (690.0, 1400.0, 1e-3), (695.0, 1350.0, 2e-3)],
                "b": [(600.0, 1500.0, 5e-3), (620.0, 1600.0, 4e-3), (610.0, 1550.0, 6e-3)],
                "c": []}

    def fake_power_during(fn, seconds):
        name = fn()
        calls.append((name, seconds))
        if not readings[name]:
            return {}  # (nvidia-smi could not sample: the name is left out)
        watts, mhz, spc = readings[name].pop(0)
        return {"watts": watts, "sm_mhz": mhz, "seconds_per_call": spc, "samples": 9}

    monkeypatch.setattr(common, "power_during", fake_power_during)
    runs = {name: (lambda name=name: name) for name in ("a", "b", "c")}
    got = common.sustained_power(runs, 2.5, rounds=3)
    assert calls == [(name, 2.5) for _ in range(3) for name in ("a", "b", "c")]
    assert got == {"a": {"watts": 695.0, "sm_mhz": 1350.0, "seconds_per_call": 2e-3},
                   "b": {"watts": 610.0, "sm_mhz": 1550.0, "seconds_per_call": 5e-3}}


def test_results_of_the_same_second_keep_both_files(tmp_path):
    """Two runs stamped alike (two soaks side by side) each get a file of their own."""
    from bench.common import Results

    first, second = Results("soak"), Results("soak")
    second.meta["date"] = first.meta["date"]
    first.add(calls=1)
    second.add(calls=2)
    paths = [first.save(tmp_path), second.save(tmp_path)]
    assert paths[0] != paths[1] and paths[1].name.endswith("-2.json")
    assert [json.loads(p.read_text())["rows"][0]["calls"] for p in paths] == [1, 2]


def test_energy_columns_and_the_power_floor():
    """Energy per call is watts x seconds; the floor is the steps' energy over the limit, and
    without every step (or the limit) there is none."""
    from bench.common import energy_columns

    readings = {"staged": {"watts": 690.0, "sm_mhz": 1400.0, "seconds_per_call": 6e-3},
                "dispatch": {"watts": 400.0, "sm_mhz": 1900.0, "seconds_per_call": 0.2e-3},
                "experts": {"watts": 700.0, "sm_mhz": 1400.0, "seconds_per_call": 5.6e-3},
                "combine": {"watts": 500.0, "sm_mhz": 1800.0, "seconds_per_call": 0.3e-3}}
    cols = energy_columns(readings, 700.0)
    assert cols["staged_mj"] == 690.0 * 6e-3 * 1e3
    assert cols["dispatch_sustained_us"] == 0.2e-3 * 1e6 and cols["experts_sm_mhz"] == 1400.0
    floor_us = (400.0 * 0.2e-3 + 700.0 * 5.6e-3 + 500.0 * 0.3e-3) / 700.0 * 1e6
    assert abs(cols["power_floor_us"] - floor_us) < 1e-9
    assert abs(cols["staged_over_power_floor"] - 6000.0 / floor_us) < 1e-12
    assert "experts_over_power_floor" not in cols
    del readings["combine"]
    assert "power_floor_us" not in energy_columns(readings, 700.0)
    assert "power_floor_us" not in energy_columns({**readings, "combine": readings["dispatch"]},
                                                  None)


def test_bench_layer_power_needs_one_rank():
    """`--power` is refused before any GPU work with more than one rank."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bench.bench_layer", "--ranks", "2", "--power",
                          "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--power: one rank only" in out.stderr
