"""bench.clocks: the nvidia-smi samples' summary and the throttle reasons' names (no GPU needed)."""

from __future__ import annotations

import pytest

from bench import clocks


def test_reasons_name_the_nvml_bits():
    assert clocks.reasons(0x4) == ["sw_power_cap"]
    assert clocks.reasons(0x0) == []
    assert clocks.reasons(0x1 | 0x40) == ["idle", "hw_thermal"]
    assert clocks.reasons(0x4 | 0x1000) == ["sw_power_cap", "0x1000"]


def test_summary_takes_medians_and_every_reason_seen():
    lines = ["1515, 697.10, 0x0000000000000004, 61", "1500, 699.00, 0x0000000000000004, 62",
             "1980, 120.50, 0x0000000000000000, 60", "1425, [N/A], 0x4, 61", "1425, 69"]
    s = clocks.summarize(lines)
    assert s["samples"] == 3 and s["mhz"] == 1515 and s["watts"] == pytest.approx(697.1) and s["celsius"] == 61
    assert s["reasons"] == ["sw_power_cap"]


def test_summary_needs_a_sample():
    with pytest.raises(ValueError, match="no nvidia-smi sample"):
        clocks.summarize(["", "clocks.sm [MHz], power.draw [W]"])


def test_query_takes_the_reason_field_the_driver_knows(monkeypatch):
    """Newer drivers name the throttle reasons clocks_event_reasons; the older name fails there."""
    import subprocess

    class Done:
        def __init__(self, rc):
            self.returncode, self.stdout, self.stderr = rc, "", "Field is not a valid field to query."

    def run(cmd, **kw):
        return Done(0 if any("clocks_event_reasons" in c for c in cmd) else 2)

    monkeypatch.setattr(subprocess, "run", run)
    assert clocks.query() == "clocks.sm,power.draw,clocks_event_reasons.active,temperature.gpu"
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: Done(2))
    with pytest.raises(SystemExit, match="takes none of"):
        clocks.query()
