"""The unified path's declared tiles: one table per target family, read by the launcher, whose
run-time fallback is armed only where no table is declared."""

from __future__ import annotations

import re

import pytest

from atom_backend.unified import api, configs
from atom_backend.unified.configs import TileConfig


def test_default_config_reads_the_family_table(monkeypatch):
    key = configs.tile_key(64, 8, 700, 0)
    assert key == ("prefill", 64, False)
    lighter = TileConfig(128, 64, 4, 2)
    monkeypatch.setitem(configs.TABLES["sm_90"], key, lighter)
    assert configs.default_config(64, 8, 700, False, False, 0, "sm_90") == lighter
    # a target without a table keeps the sweep's tiles; the interpreter its own
    assert configs.default_config(64, 8, 700, False, False, 0, None) == configs.SWEEP[key] != lighter
    assert configs.default_config(64, 8, 700, True, False, 0, "sm_90").num_stages == 1
    assert configs.family_of("cuda", 90) == "sm_90" and configs.family_of("hip", "gfx950") == "gfx950"
    assert configs.family_of("cuda", 100) is None and configs.family_of("hip", "gfx1250") is None


def _launch_state(declared: bool):
    cfg = TileConfig(128, 64, 4, 3)
    return api._Launch(kern=None, args={"BLOCK_M": 128, "BLOCK_N": 64}, cfg=cfg, hg=8, block_q=16, grid_tiles=1,
                       grid_heads=1, interpret=False, declared=declared)


class PTXASError(RuntimeError):
    pass


class _Kernel:
    """A stand-in JIT kernel whose ``kernel[grid](**args)`` fails to build with ``fail`` stages."""

    def __init__(self, fail_stages: int):
        self.__name__ = f"fake_{fail_stages}"
        self.fail, self.calls = fail_stages, []

    def __getitem__(self, grid):
        def run(**kw):
            self.calls.append(kw["num_stages"])
            if kw["num_stages"] == self.fail:
                raise PTXASError("`ptxas` failed with error code -11")
        return run


def test_declared_config_is_launched_as_is_without_fallback(monkeypatch):
    monkeypatch.setattr(api, "_fallback_cfg", {})
    k = _Kernel(fail_stages=3)
    with pytest.raises(PTXASError):
        api._launch(k, (1, 1), _launch_state(declared=True))
    assert k.calls == [3]
    ok = _Kernel(fail_stages=0)
    api._launch(ok, (1, 1), _launch_state(declared=True))
    assert ok.calls == [3]


def test_undeclared_target_falls_back_to_fewer_stages(monkeypatch):
    monkeypatch.setattr(api, "_fallback_cfg", {})
    k = _Kernel(fail_stages=3)
    with pytest.warns(RuntimeWarning, match=re.escape(f"using {TileConfig(128, 64, 4, 2)}")):
        api._launch(k, (1, 1), _launch_state(declared=False))
    assert k.calls == [3, 2]
