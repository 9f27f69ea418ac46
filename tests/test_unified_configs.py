"""The unified path's declared tiles: one table per target family, every sm_90a entry compiled
ahead of time with the installed Triton (its bundled ptxas), and the launcher's run-time
fallback armed only where no table is declared."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from atom_backend.planning import ModelFacts
from atom_backend.unified import aot, api, configs
from atom_backend.unified.configs import TileConfig


def _first_variant_per_key(arch: str) -> dict:
    """One launch of each table key, from the models a build without a model compiles."""
    out = {}
    for facts in aot.declared_facts(arch):
        for v in aot.launch_variants(arch, facts):
            out.setdefault(v.key, v)
    return out


def test_every_key_has_a_declared_entry_and_the_no_model_build_covers_them():
    for family in configs.TABLES:
        assert set(configs.TABLES[family]) == set(configs.KEYS), family
    for family, archs in configs.FAMILY_ARCHS.items():
        for arch in archs:
            assert set(_first_variant_per_key(arch)) == set(configs.KEYS), arch


@pytest.mark.slow
@pytest.mark.parametrize("key", configs.KEYS, ids=lambda k: "-".join(map(str, k)))
def test_declared_sm90_entry_compiles(key):
    v = _first_variant_per_key("sm_90a")[key]
    assert v.cfg == configs.TABLES["sm_90"][key]
    c = aot.compile_variant("sm_90a", v)
    assert 0 < c.shared <= aot.SHARED_LIMIT["sm_90a"]


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(configs._GFX942), ids=lambda k: "-".join(map(str, k)))
def test_gfx942_entries_fit_its_lds(key):
    v = _first_variant_per_key("gfx942")[key]
    assert v.cfg == configs.TABLES["gfx942"][key] != configs.SWEEP[key]
    assert aot.compile_variant("gfx942", v).shared <= aot.SHARED_LIMIT["gfx942"]


@pytest.mark.slow
def test_shared_memory_over_the_arch_limit_fails_the_compile():
    # the sweep's 64 x 128 decode tile at head_pad 128 needs 80 KiB of LDS (triton 3.6 and 3.9)
    key = ("decode", 128, 64)
    v = _first_variant_per_key("gfx942")[key]
    sweep = dict(v.constexprs, BLOCK_N=configs.SWEEP[key].block_n)
    v = replace(v, cfg=configs.SWEEP[key], constexprs=tuple(sorted(sweep.items())))
    with pytest.raises(ValueError, match="shared memory, gfx942 has 65536"):
        aot.compile_variant("gfx942", v)


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


def test_launch_variants_follow_the_launch_wrappers():
    facts = ModelFacts(64, 8, 64, has_sinks=True, layer_windows=(0, 128))
    vs = aot.launch_variants("sm_90a", facts, max_query_tokens=2)
    decode = {(v.key, dict(v.constexprs)["USE_WINDOW"]) for v in vs if v.entry == "paged_decode"}
    # decode rows: 8 query heads x 1 or 2 tokens -> 16 rows; full and windowed layers
    assert decode == {(("decode", 64, 16), False), (("decode", 64, 16), True)}
    attn = {v.key for v in vs if v.entry == "paged_attention"}
    assert attn == {("decode", 64, 32), ("decode", 64, 64), ("prefill", 64, False), ("prefill", 64, True)}
    assert all(dict(v.constexprs)["SPLIT"] == (v.entry == "paged_decode") for v in vs)
    assert all(dict(v.constexprs)["HAS_SINKS"] and not dict(v.constexprs)["RETURN_LSE"] for v in vs)
    assert aot.launch_variants("gfx1250", facts) == []


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


def test_per_batch_scalars_are_never_specialized():
    """Batch-dependent ints (sequence count, token count, the split rule, the combine's split
    count) would each make Triton compile another form of the kernel for values equal to 1 or
    multiples of 16: a compile or a disk load inside a serving step (seen on the H200 as 60-80 ms a step on batches of short
    prefills). They are unspecialized in the JIT and plain i32 in the ahead-of-time build, so the
    one form the build compiles is the one every batch launches."""
    from atom_backend.unified import _kernels

    jit = {p.name for p in _kernels.unified_attn_kernel.params if p.do_not_specialize}
    assert jit == set(_kernels.PER_BATCH_ARGS)
    assert {p.name for p in _kernels.combine_kernel.params if p.do_not_specialize} == {"total_q", "num_splits"}
    facts = ModelFacts(64, 8, 64, has_sinks=True, layer_windows=(0, 128))
    for v in aot.launch_variants("sm_90a", facts, max_query_tokens=2):
        src = aot._source(v)
        names = _kernels.unified_attn_kernel.arg_names
        for name in _kernels.PER_BATCH_ARGS:
            i = names.index(name)
            assert src.signature[name] == "i32" and (i,) not in src.attrs, (v.name, name)
