"""FP8 compute prefill: gather_kv_fp8's layout and the FP8 bodies (Q quantized inside) against the
reference on the dequantised cache (docs/fp8.md: tolerances.fp8_compute_bound).

Two bodies (the `body` fixture): "hopper", the sm_90a wgmma kernel, and "portable", the portable
body's FP8 compute (src/varlen_prefill.hip, KV_FP8), which the planner routes on gfx942 / gfx950
(e4m3 MFMAs) and which tests force on any NVIDIA sm_89+ GPU (mma.sync m16n8k32 e4m3): the H100
checks its lane layouts, key order, scales and softmax against the reference.

GPU tests (-m gpu): page sizes 1 / 16 / 1024, per-tensor and per-page scales with a jump of 2^3
between adjacent pages, vLLM and SGLang page tables, permuted pages including the pool's last, a
pool over 4 GiB, rising logits (the lazy reference max), the must-have attention cases of docs/design.md,
head dim 64 (portable). CPU tests: the layout constants the kernels and the gather share, routing,
plan-time errors, the FP8 MFMA in the gfx942 / gfx950 code objects.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from atom_backend import reference as ref
from atom_backend.tolerances import assert_close, assert_lse_close, errors, fp8_compute_bound, fp8_compute_lse_bound
from hip_kernels import gather, prefill, runtime

DEV = "cuda"


def _portable_fp8_runs_on(arch: str | None) -> bool:
    """The portable FP8 body has e4m3 MMAs on arch: MFMA (PORTABLE_FP8_ARCHS) or mma.sync (sm_89+)."""
    m = re.fullmatch(r"sm_(\d+)a?", arch or "")
    return arch in prefill.PORTABLE_FP8_ARCHS or (m is not None and int(m.group(1)) >= 89)


@pytest.fixture(params=["hopper", "portable"])
def body(request, monkeypatch):
    """The FP8 body under test; "portable" replaces the device's FP8 tile table by the portable
    body's (on sm_90a: the Hopper kernel's), so config_for, work_items and varlen_attention take it."""
    arch = prefill._default_arch()
    if request.param == "hopper":
        if arch not in prefill.WGMMA_ARCHS:
            pytest.skip(f"the Hopper FP8 kernel is sm_90a only (device: {arch})")
    else:
        if not _portable_fp8_runs_on(arch):
            pytest.skip(f"no e4m3 MMA on {arch} for the portable FP8 body")
        monkeypatch.setattr(prefill, "_fp8_table", lambda arch, scale: prefill.PORTABLE_TILES.of_kind("fp8"))
    return request.param


def fp8_cache(seqs_k, hk, d, page_size, *, per_page, seed=0, extra_pages=3, num_blocks=None, v_offset=0.0):
    """A random e4m3 cache holding the keys of requests of lengths seqs_k, pages permuted (the
    pool's last page used), scales per page alternating by 2^3 (or per tensor); V's stored values
    ~ N(v_offset, 2)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in seqs_k]
    nb = num_blocks or sum(need) + extra_pages
    # sum(need) distinct pages in random order, the pool's last page among them
    others = torch.randperm(nb - 1, generator=g)[: sum(need) - 1]
    perm = torch.cat([others, torch.tensor([nb - 1])])[torch.randperm(sum(need), generator=g)]
    width = max(need + [1])
    table = torch.zeros(len(seqs_k), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at: at + n].to(torch.int32)
        at += n
    fp8 = runtime.native_fp8_dtype(prefill._default_arch())  # e4m3 FNUZ on gfx942
    shape = (nb, page_size, hk, d)
    k_cache = torch.empty(shape, dtype=fp8, device=DEV)
    v_cache = torch.empty(shape, dtype=fp8, device=DEV)
    used = perm.to(DEV).long()
    k_cache[used] = (torch.randn((len(used), page_size, hk, d), generator=g) * 2).to(fp8).to(DEV)
    v_cache[used] = (torch.randn((len(used), page_size, hk, d), generator=g) * 2 + v_offset).to(fp8).to(DEV)
    if per_page:
        # Adjacent pages of a request differ by 2^3 (the CK V3 page-transition case), plus noise.
        base = torch.tensor([0.05, 0.4])[torch.arange(nb) % 2][:, None] * (1 + 0.1 * torch.rand(nb, hk, generator=g))
        kd = base.clone()
        vd = base.flip(0).clone() * 0.5
        kd_full, vd_full = torch.empty(nb, hk), torch.empty(nb, hk)
        kd_full[perm] = kd[: len(perm)]  # logical order of the pages decides the alternation
        vd_full[perm] = vd[: len(perm)]
        kd_full[~torch.isin(torch.arange(nb), perm)] = 1.0
        vd_full[~torch.isin(torch.arange(nb), perm)] = 1.0
        scales = {"k_descale": kd_full.to(DEV).contiguous(), "v_descale": vd_full.to(DEV).contiguous()}
    else:
        scales = {"k_scale": 0.07, "v_scale": 0.11}
    return k_cache, v_cache, table.to(DEV), scales


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def pack(k_cache, v_cache, table, seqs_k, scales, layout="vllm", inline_ref=True):
    """gather_kv_fp8 of the requests seqs_k; inline_ref: per page, the V reference taken inside the gather
    (max_seqlen_k given) rather than by the pre-pass."""
    cu_kp_h = gather.fp8_padded_starts(seqs_k)
    kw = {"block_table": table, "max_seqlen_k": max(seqs_k, default=0) if inline_ref else None}
    if layout == "sglang":
        ps = k_cache.shape[1]
        idx = [table[b, : -(-n // ps)] for b, n in enumerate(seqs_k)]
        kw = {"kv_indptr": _cu([len(x) for x in idx]), "kv_page_indices": torch.cat(idx).contiguous(),
              "max_seqlen_k": kw["max_seqlen_k"]}
    return gather.gather_kv_fp8(k_cache, v_cache, _cu(seqs_k), torch.tensor(cu_kp_h, dtype=torch.int32, device=DEV),
                                cu_kp_h[-1], **kw, **scales)


def unpack(p: gather.PackedFp8, seqs_k):
    """Dequantised packed K, V [sum(seqs_k), H, D] (float32, CPU) from the FP8 layout."""
    k8, vt = p.k.cpu().float(), p.vt.cpu().float()
    H, D, total = vt.shape
    order = torch.tensor(gather.FP8_KEY_ORDERS[p.order])
    # position q of each 32 holds key order[q]: undo it
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(32))
    v = vt.reshape(H, D, total // 32, 32)[..., inv].reshape(H, D, total).permute(2, 0, 1)
    if p.scale == "per_tensor":
        ks, vs = p.kv_scale.cpu()
        kf, vf = k8 * ks, v * vs
    else:
        lane = gather.fp8_lane_order()
        sc = p.key_scales.cpu()  # [H, blocks, 2, 128] in lane order
        nat = torch.empty_like(sc)
        nat[..., lane] = sc
        if p.scale == "per_page16":  # a group's K scale at its first key (positions 32..63: the group block)
            nat[:, :, 0] = nat[:, :, 0, ::16].repeat_interleave(16, dim=-1)
        kd = nat[:, :, 0, :].reshape(H, -1).t()  # [total, H]
        vd = (nat[:, :, 1, :] * p.v_max.cpu()[:, :, None]).reshape(H, -1).t()
        kf, vf = k8 * kd[:, :, None], v * vd[:, :, None]
    cu = p.cu_kp.cpu().tolist()
    ks_, vs_, pads = [], [], []
    for b, n in enumerate(seqs_k):
        ks_.append(kf[cu[b]: cu[b] + n])
        vs_.append(vf[cu[b]: cu[b] + n])
        pads.append((k8[cu[b] + n: cu[b + 1]], v[cu[b] + n: cu[b + 1]]))
    return torch.cat(ks_), torch.cat(vs_), pads


# --- CPU ----------------------------------------------------------------------------------------


def _p_operand_keys(order: str) -> dict:
    """{K-byte: key} of P's e4m3 operand as atom_mma.h builds it (to_operand_fp8 from two acc_t
    tiles: keys 0-15 and 16-31), over every lane: the accumulator layouts written out."""
    out = {}
    if order == "nvidia":  # 32 lanes; acc x[e]: key 8 (e >> 2) + 2 (lane % 4) + (e & 1); word w of the
        for lane in range(32):  # operand: K-bytes 16 (w >> 1) + 4 (lane % 4) + i from x[0,1,4,5] / x[2,3,6,7]
            t = lane % 4
            for w in range(4):
                for i, e in enumerate((0, 1, 4, 5) if w % 2 == 0 else (2, 3, 6, 7)):
                    key = 16 * (w >> 1) + 8 * (e >> 2) + 2 * t + (e & 1)
                    out.setdefault(16 * (w >> 1) + 4 * t + i, set()).add(key)
    else:  # MFMA, 64 lanes: acc x[e]: key 4 (lane / 16) + e; x[0] / x[1] of the operand: K-bytes
        for lane in range(64):  # 8 (lane / 16) + i / + 4 + i from the first / second tile's x[i]
            q = lane // 16
            for half in range(2):
                for i in range(4):
                    out.setdefault(8 * q + 4 * half + i, set()).add(16 * half + 4 * q + i)
    return out


@pytest.mark.parametrize("order", list(gather.FP8_KEY_ORDERS))
def test_key_order_is_the_p_operand(order):
    """V^T's position p holds the key whose P the P operand has at K-byte p, on every lane."""
    keys = gather.FP8_KEY_ORDERS[order]
    assert sorted(keys) == list(range(32))
    held = _p_operand_keys(order)
    assert sorted(held) == list(range(32))
    for p, ks in held.items():
        assert ks == {keys[p]}, (p, ks, keys[p])


def test_key_order_per_arch():
    """gather_kv_fp8 writes the order of the device's FP8 MMA: MFMA on gfx942 / gfx950 (the
    kernels' ATOM_MFMA), the shared wgmma / mma.sync fragment's on NVIDIA."""
    assert [gather.fp8_key_order(a) for a in ("sm_90a", "sm_89", "gfx942", "gfx950", "gfx1250")] == \
        ["nvidia", "nvidia", "mfma", "mfma", "nvidia"]
    # the Hopper kernel's order per 16 keys: sigma(4q + i) = 2q + (i & 1) + 8 (i >> 1)
    assert gather.FP8_KEY_ORDERS["nvidia"][:16] == (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
    assert gather.FP8_KEY_ORDERS["mfma"][:8] == (0, 1, 2, 3, 16, 17, 18, 19)


def test_lane_order_matches_softmax_reads():
    """Lane quad q reads float4 at 32 q + 4 nt: keys 16 nt + {2q, 2q+1, 8+2q, 9+2q}."""
    lane = gather.fp8_lane_order()
    assert sorted(lane.tolist()) == list(range(128))
    for q in range(4):
        for nt in range(8):
            at = 32 * q + 4 * nt
            assert lane[at: at + 4].tolist() == [16 * nt + 2 * q, 16 * nt + 2 * q + 1, 16 * nt + 8 + 2 * q, 16 * nt + 9 + 2 * q]


def test_padded_starts():
    assert gather.fp8_padded_starts([0, 1, 128, 129, 5]) == [0, 0, 128, 256, 512, 640]


def test_fp8_config_and_errors():
    assert prefill.fp8_compute_available(128, "sm_90a")
    assert not prefill.fp8_compute_available(64, "sm_90a") and not prefill.fp8_compute_available(128, "sm_80")
    # a scale per key: the 16-bit tile's rows (two consumer warpgroups); per tensor and per 16 keys: three
    # on f16 scores (BLOCK_M 192); O moved out of the accumulator every 1024 keys in every mode
    assert prefill.config_for(128, 128, "sm_90a", fp8="per_page").block_m == prefill.config_for(128, 0, "sm_90a").block_m
    for scale in ("per_tensor", "per_page16"):
        cfg = prefill.config_for(128, 0, "sm_90a", fp8=scale)
        assert cfg.block_m == 192 and cfg.f16_scores
    items = prefill.work_items([300], [300], head_dim=128, arch="sm_90a", fp8="per_tensor")
    assert items.shape[0] == 2
    assert prefill.work_items([300], [300], head_dim=128, arch="sm_90a", fp8="per_page").shape[0] == 3
    for scale in prefill.KV_FP8_MODES:
        cfg = prefill.config_for(128, 0, "sm_90a", fp8=scale)
        assert cfg.o_promote * cfg.block_n == prefill.FP8_ACCUMULATED_KEYS and cfg.q_stages == 1
        # O's partials: one more Q stage's bytes (the kernel's PRO), or none (f16 partials in sO)
        assert cfg.smem_bytes(128, 1) == dataclasses.replace(cfg, o_promote=0).smem_bytes(128, 1) + (
            0 if cfg.f16_scores else 2 * 128 * cfg.block_m)
    for arch in ("sm_90a", *prefill.PORTABLE_FP8_ARCHS):  # every FP8 tile moves O out every 1024 keys
        assert prefill.fp8_accurate_keys(arch) == 0
        for cfg in (c for scale in prefill.KV_FP8_MODES for c in prefill._fp8_table(arch, scale).values()):
            assert cfg.o_promote * cfg.block_n == prefill.FP8_ACCUMULATED_KEYS
    assert prefill.fp8_accurate_keys("sm_80") == prefill.FP8_ACCUMULATED_KEYS  # no FP8 tile: nothing known
    # fp8_compute_available reads one
    assert len({tuple(prefill.HOPPER_TILES.of_kind(m)) for m in prefill.KV_FP8_MODES}) == 1
    for flag in (True, False):  # the tile depends on the mode: a bool is not enough (16-bit is None)
        with pytest.raises(ValueError, match="scale mode"):
            prefill.config_for(128, 0, "sm_90a", fp8=flag)
    with pytest.raises(ValueError, match="FP8-compute"):
        prefill.config_for(64, 0, "sm_90a", fp8="per_page")
    with pytest.raises(ValueError, match="FP8-compute"):
        prefill.config_for(256, 0, "gfx950", fp8="per_page")
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    p = gather.PackedFp8(torch.zeros(128, 1, 128, dtype=torch.float8_e4m3fn), torch.zeros(1, 128, 64, dtype=torch.float8_e4m3fn),
                         torch.tensor([0, 128], dtype=torch.int32), "per_tensor", torch.ones(2), None, None)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree"):
        prefill.varlen_attention(q, p, None, cu, cu, max_seqlen_q=4, max_seqlen_k=4)
    with pytest.raises(ValueError, match="v must be None"):
        prefill.varlen_attention(q, p, p.k, cu, cu, max_seqlen_q=4, max_seqlen_k=4)


def test_portable_fp8_routing():
    """gfx942 / gfx950 compute FP8 prefill on the portable body (d 64 and 128), sm_90a stays on the
    Hopper kernel; the portable tile fits gfx942's 64 KB of LDS."""
    for arch in prefill.PORTABLE_FP8_ARCHS:
        for d in (64, 128):
            cfg = prefill.config_for(d, 0, arch, fp8="per_page16")
            assert prefill.fp8_compute_available(d, arch) and not cfg.wgmma
            assert cfg.smem_bytes(d, kv_fp8=1) <= 64 * 1024
            assert prefill._variant(d, 0, False, cfg, 3).source == prefill.SOURCE
            items = prefill.work_items([300], [300], head_dim=d, arch=arch, fp8="per_page16")
            assert items.shape[0] == -(-300 // cfg.block_m)
    assert all(prefill.config_for(128, 0, "sm_90a", fp8=m).wgmma for m in prefill.KV_FP8_MODES)


def test_fp8_pack_tensors_are_checked():
    """The kernel reads a pack's tensors through raw pointers: wrong dtype, device or layout is an
    error at plan time, not a read of the wrong bytes."""
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    e4 = torch.float8_e4m3fn
    p = gather.PackedFp8(torch.zeros(128, 1, 128, dtype=e4), torch.zeros(1, 128, 128, dtype=e4),
                         torch.tensor([0, 128], dtype=torch.int32), "per_tensor", torch.ones(2), None, None, "nvidia")
    prefill._check_fp8_pack(p, q, cu, "sm_90a")
    pp = p._replace(scale="per_page16", kv_scale=None, key_scales=torch.ones(1, 1, 2, 128), v_max=torch.ones(1, 1))
    prefill._check_fp8_pack(pp, q, cu, "sm_90a")
    bad = {
        "e5m2 bytes": p._replace(k=p.k.to(torch.float8_e5m2), vt=p.vt.to(torch.float8_e5m2)),
        "FNUZ bytes on sm_90a": p._replace(k=p.k.view(torch.float8_e4m3fnuz), vt=p.vt.view(torch.float8_e4m3fnuz)),
        "kv_scale elsewhere": p._replace(kv_scale=torch.ones(2, device="meta")),
        "kv_scale strided": p._replace(kv_scale=torch.ones(4)[::2]),
        "kv_scale fp16": p._replace(kv_scale=torch.ones(2, dtype=torch.float16)),
        "cu_kp elsewhere": p._replace(cu_kp=torch.tensor([0, 128], dtype=torch.int32, device="meta")),
        "key_scales fp16": pp._replace(key_scales=torch.ones(1, 1, 2, 128, dtype=torch.float16)),
        "key_scales strided": pp._replace(key_scales=torch.ones(1, 1, 2, 256)[..., ::2]),
        "v_max elsewhere": pp._replace(v_max=torch.ones(1, 1, device="meta")),
    }
    for what, pack in bad.items():
        with pytest.raises(ValueError, match="PackedFp8"):
            prefill._check_fp8_pack(pack, q, cu, "sm_90a")
            pytest.fail(what)


def test_pack_order_must_match_the_body():
    """A pack written for another family's FP8 MMA (its V^T key order) is refused at plan time."""
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    p = gather.PackedFp8(torch.zeros(128, 1, 128, dtype=torch.float8_e4m3fn), torch.zeros(1, 128, 128, dtype=torch.float8_e4m3fn),
                         torch.tensor([0, 128], dtype=torch.int32), "per_tensor", torch.ones(2), None, None, "mfma")
    prefill._check_fp8_pack(p, q, cu, "gfx950")
    with pytest.raises(ValueError, match="key order"):
        prefill._check_fp8_pack(p, q, cu, "sm_90a")
    with pytest.raises(ValueError, match="key order"):
        prefill._check_fp8_pack(p._replace(order="hopper"), q, cu, None)


@pytest.mark.parametrize("arch", list(prefill.PORTABLE_FP8_ARCHS))
def test_portable_fp8_body_uses_the_fp8_mfma(arch, tmp_path, monkeypatch):
    """The compiled FP8 body multiplies with v_mfma_f32_16x16x32_fp8_fp8 and has no trap (the
    fallback of a target without e4m3 MMAs), and spills nothing."""
    exe = shutil.which("llvm-objdump-22") or shutil.which("llvm-objdump")
    try:
        runtime.toolchain_for(arch)
    except runtime.ToolchainMissingError as e:
        pytest.skip(str(e))
    assert exe, "llvm-objdump-22 (llvm-22) is needed to read the code object"
    monkeypatch.setenv("ATOM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATOM_NO_COMPILE", raising=False)
    for name, mode in prefill.KV_FP8_MODES.items():
        c = runtime.compile_variant(prefill._variant(128, 0, False, prefill.config_for(128, 0, arch, fp8=name), mode), arch)
        use = runtime.resource_usage(c)
        assert use.get("vgpr_spills", 0) == 0 and use.get("sgpr_spills", 0) == 0 and use.get("scratch", 0) == 0, use
        co = tmp_path / f"{arch}_{mode}.co"
        co.write_bytes(c.binary)
        text = subprocess.run([exe, "-d", str(co)], capture_output=True, text=True, check=True).stdout
        assert "v_mfma_f32_16x16x32_fp8_fp8" in text and "s_trap" not in text


# --- GPU ----------------------------------------------------------------------------------------


def _f16_halves(words: torch.Tensor):
    """fp32 tensor holding f16 pairs -> (low halves, high halves) as float32 (little-endian words)."""
    h = words.contiguous().view(torch.float16).float()
    return h[..., 0::2], h[..., 1::2]


def check_v_values(p: gather.PackedFp8, got_v, want_v, seqs_k):
    """The pack's V against the cache's: equal (up to the scales' fp32 rounding), but that per 16 keys a
    page's bytes carry its scale's power of two under the request's largest (src/fp8_pack.h), which
    rounds the bytes it moves under e4m3's normals: by at most 2^-10 of that largest scale."""
    err, tol = (got_v - want_v).abs(), 1e-6 * want_v.abs()
    if p.scale == "per_page16":
        cu, vmax = p.cu_kp.cpu().tolist(), p.v_max.cpu()  # [H, blocks]: every block of a request holds its scale
        at = 0
        for b, n in enumerate(seqs_k):
            if n:
                tol[at: at + n] += 2.0 ** -10 * vmax[:, cu[b] // gather.FP8_ALIGN][None, :, None]
            at += n
    assert (err <= tol).all(), (err - tol).max()


def check_group_block(p: gather.PackedFp8):
    """per_page16: K's positions 32..63 of each block hold the Hopper kernel's group block
    (src/fp8_pack.h): each 16-key group's K scale (floored at 1e-30) over the block's largest and its V
    factor f (over v_max, in (1/2, 1]), f16 in both halves of a word, then the largest K scale; the
    row sums' weights 2^(-c / 32) (f16, groups 2q and 2q + 1 in word 18 + q) and the V exponents
    c = 32 log2 f (f16, both halves, words 24..31)."""
    sc = p.key_scales.cpu()
    k_heads = sc[:, :, 0, 0:32:4].clamp_min(1e-30)  # key 16 n's scale sits at position 4 n
    v_heads = sc[:, :, 1, 0:32:4]
    assert ((v_heads > 0.5) & (v_heads <= 1)).all()  # the bytes carry the powers of two (padding's too)
    kmax = k_heads.amax(-1)
    block = sc[:, :, 0, 32:64]
    assert torch.equal(block[..., 16], kmax)
    for words, want in ((block[..., :8], k_heads / kmax[..., None]), (block[..., 8:16], v_heads)):
        lo, hi = _f16_halves(words)
        assert torch.equal(lo, hi)
        assert torch.allclose(lo, want.half().float(), rtol=2 ** -10, atol=0)
    c_got, c_hi = _f16_halves(block[..., 24:32])
    assert torch.equal(c_got, c_hi)
    assert torch.allclose(torch.exp2(c_got / 32), v_heads, rtol=2 ** -10, atol=0)  # f16's rounding of c
    lo, hi = _f16_halves(block[..., 18:22])
    weight = torch.exp2(-c_got / 32)  # of the exponents as stored, so that l undoes what P carries
    assert torch.allclose(lo, weight[..., 0::2], rtol=2 ** -10, atol=0)
    assert torch.allclose(hi, weight[..., 1::2], rtol=2 ** -10, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 1024])
@pytest.mark.parametrize("per_page,inline_ref", [(True, True), (True, False), (False, True)],
                         ids=["per_page", "per_page_prepass", "per_tensor"])
@pytest.mark.parametrize("layout", ["vllm", "sglang"])
def test_gather_fp8_layout(page_size, per_page, inline_ref, layout):
    """The pack's bytes and scales; per page with the V reference taken inside the gather or by the
    pre-pass (requests of more than gather.FP8_INLINE_REF_PAGES pages)."""
    seqs_k = [300, 1, 0, 129, 1024 + 7]
    hk, d = 2, 128
    kc, vc, table, scales = fp8_cache(seqs_k, hk, d, page_size, per_page=per_page)
    p = pack(kc, vc, table, seqs_k, scales, layout, inline_ref=inline_ref)
    got_k, got_v, pads = unpack(p, seqs_k)
    want_k, want_v, _ = ref.gather_vllm(kc.cpu(), vc.cpu(), table.cpu(), torch.tensor(seqs_k),
                                        **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in scales.items()})
    assert torch.equal(got_k, want_k)
    check_v_values(p, got_v, want_v, seqs_k)
    for pk, pv in pads:  # rows between requests are zero: a NaN byte there would leak through P = 0
        assert not pk.any() and not pv.any()
    if per_page:
        assert (p.key_scales.cpu()[:, :, 1] <= 1).all()
        if p.scale == "per_page16":
            check_group_block(p)
        # O's unit: every block of a request holds the request's largest V scale per head
        vd, tab, cu_kp = scales["v_descale"].cpu(), table.cpu().long(), p.cu_kp.cpu().tolist()
        for b, n in enumerate(seqs_k):
            if n:
                want = vd[tab[b, : -(-n // page_size)]].amax(0)  # [H]
                got = p.v_max.cpu()[:, cu_kp[b] // gather.FP8_ALIGN: cu_kp[b + 1] // gather.FP8_ALIGN]
                assert torch.equal(got, want[:, None].expand_as(got)), b


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 1024])
def test_gather_fp8_v_scales_far_under_the_largest(page_size):
    """per_page16: pages whose V scale is 2^-8 (times 1.3) of the request's largest, or 0, keep a factor
    in (1/2, 1] (the power of two moved into their bytes) and their values within 2^-10 of that scale."""
    seqs_k = [3 * page_size + 5, 2 * page_size]
    hk, d = 2, 128
    kc, vc, table, scales = fp8_cache(seqs_k, hk, d, page_size, per_page=True)
    vd = scales["v_descale"]
    vd[table[0, 1].long()] = vd[table[0, :4].long()].amax(0) * 1.3 * 2.0 ** -8
    vd[table[0, 2].long(), 0] = 0.0
    p = pack(kc, vc, table, seqs_k, scales)
    assert p.scale == "per_page16"
    check_group_block(p)
    got_k, got_v, _ = unpack(p, seqs_k)
    want_k, want_v, _ = ref.gather_vllm(kc.cpu(), vc.cpu(), table.cpu(), torch.tensor(seqs_k),
                                        **{k: v.cpu() for k, v in scales.items()})
    assert torch.equal(got_k, want_k)
    check_v_values(p, got_v, want_v, seqs_k)
    assert not torch.equal(got_v, want_v)  # the small page's bytes were moved, and some rounded


@pytest.mark.gpu
def test_gather_fp8_check_pages_rejects_out_of_range_ids():
    seqs_k = [40, 20]
    kc, vc, table, scales = fp8_cache(seqs_k, 2, 128, 16, per_page=True)
    pack(kc, vc, table, seqs_k, scales)  # valid ids pass
    bad = table.clone()
    bad[1, 0] = kc.shape[0]
    cu_kp_h = gather.fp8_padded_starts(seqs_k)
    with pytest.raises(ValueError, match="page ids outside"):
        gather.gather_kv_fp8(kc, vc, _cu(seqs_k), torch.tensor(cu_kp_h, dtype=torch.int32, device=DEV), cu_kp_h[-1],
                             block_table=bad, check_pages=True, **scales)


def _fp8_attention_case(seqs, hq, hk, kw, page_size=16, per_page=True, dtype=torch.bfloat16, seed=0, layout="vllm",
                        num_blocks=None, q_edit=None, cache_edit=None, d=128, v_offset=0.0):
    """FP8 compute of a random batch (q_edit(q), cache_edit(k_cache, table, seqs_k, scales) change
    the inputs first) against the reference on the dequantized cache, output and lse poisoned."""
    seqs_k = [b for _, b in seqs]
    kc, vc, table, scales = fp8_cache(seqs_k, hk, d, page_size, per_page=per_page, seed=seed, num_blocks=num_blocks,
                                      v_offset=v_offset)
    if cache_edit is not None:
        cache_edit(kc, table, seqs_k, scales)
    p = pack(kc, vc, table, seqs_k, scales, layout)
    # pages of a multiple of 16 keys: one scale per 16 keys (KV_FP8 = 3), else one per key
    assert p.scale == ("per_tensor" if not per_page else "per_page16" if page_size % 16 == 0 else "per_page")
    assert p.order == gather.fp8_key_order(prefill._default_arch())
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(a for a, _ in seqs), hq, d, generator=g).to(dtype)
    if q_edit is not None:
        q_edit(q)
    kw = dict(kw)
    sinks = torch.randn(hq, generator=g) if kw.pop("sinks", False) else None
    k_ref, v_ref, _ = ref.gather_vllm(kc.cpu(), vc.cpu(), table.cpu(), torch.tensor(seqs_k),
                                      **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in scales.items()})
    cu_q, cu_k = _cu([a for a, _ in seqs]), _cu(seqs_k)
    o_ref, lse_ref = ref.varlen_attention(q.float(), k_ref, v_ref, cu_q.cpu(), cu_k.cpu(), sinks=sinks, **kw)
    qd = q.to(DEV)
    out = torch.full_like(qd, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=DEV)
    work = prefill.work_items([a for a, _ in seqs], seqs_k, head_dim=d, causal=kw.get("causal", True),
                              window=kw.get("window", 0), sink_tokens=kw.get("sink_tokens", 0), fp8=p.scale).to(DEV)
    prefill.varlen_attention(qd, p, None, cu_q, cu_k, max_seqlen_q=max(a for a, _ in seqs), max_seqlen_k=max(seqs_k),
                             sinks=None if sinks is None else sinks.to(DEV), out=out, lse_out=lse, work=work, **kw)
    torch.cuda.synchronize()
    bound = fp8_compute_bound(v_ref.abs().max().item() if v_ref.numel() else 0.0)
    assert_close(out.float().cpu(), o_ref, bound, "out")
    # |x| <= scale |q| |k| (Cauchy-Schwarz): the largest logit magnitude this batch can have
    x_max = q.float().norm(dim=-1).max().item() * (k_ref.norm(dim=-1).max().item() if k_ref.numel() else 0.0) / d ** 0.5
    assert_lse_close(lse.cpu(), lse_ref, fp8_compute_lse_bound(x_max), "lse")
    return errors(out.float().cpu(), o_ref)


FP8_CASES = {
    "sq_eq_sk_gqa4": ([(300, 300), (128, 128), (1, 1), (77, 77)], 8, 2, {}),
    "prefix_hit_gqa4": ([(100, 400), (64, 1000), (129, 129), (1, 513)], 8, 2, {}),
    "sq1_rows_gqa8": ([(1, 1), (1, 50), (200, 200), (1, 1000), (17, 300)], 8, 1, {}),
    "mha_tile_edges": ([(128, 128), (129, 129), (127, 255), (1, 128), (1, 129)], 4, 4, {}),
    "empty_seqs": ([(0, 0), (50, 50), (0, 10), (30, 100), (0, 0)], 4, 4, {}),
    "window_lt_sk": ([(300, 300), (50, 400), (1, 700)], 8, 2, {"window": 64}),
    "window_eq_sk": ([(256, 256), (100, 256)], 4, 1, {"window": 256}),
    "window_gt_sk": ([(200, 200), (30, 300)], 4, 2, {"window": 1000}),
    "sink_tokens_1": ([(300, 300), (40, 500)], 4, 2, {"window": 64, "sink_tokens": 1}),
    "sink_tokens_8": ([(300, 300), (40, 500), (1, 129)], 4, 2, {"window": 100, "sink_tokens": 8}),
    "sinks": ([(250, 250), (10, 333)], 8, 1, {"sinks": True}),
    "softcap_window_sinks": ([(200, 200), (3, 250)], 8, 2, {"softcap": 20.0, "window": 48, "sinks": True}),
    # Tiles with no masked key (rows far below the diagonal): per tensor caps those after the row max.
    "softcap_prefix": ([(100, 700), (300, 300)], 8, 2, {"softcap": 30.0}),
    "non_causal": ([(100, 100), (40, 300), (1, 70)], 4, 2, {"causal": False}),
    # Last tiles of requests that the Hopper tile (192 rows; here 48 tokens of 4 packed query heads, 16
    # per warpgroup) does not divide: warpgroups whose rows all lie past the request (448 and 320 leave
    # two and one) and whose last key ends a tile early (the unit at token 96 of 448).
    "idle_warpgroups": ([(448, 448), (320, 1500), (64, 2000), (1, 900)], 8, 2, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("per_page,page_size", [(True, 16), (True, 1), (False, 16)],
                         ids=["per_page16", "per_key", "per_tensor"])
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_prefill_vs_reference(name, per_page, page_size, body):
    seqs, hq, hk, kw = FP8_CASES[name]
    _fp8_attention_case(seqs, hq, hk, kw, per_page=per_page, page_size=page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(12, 64, 4, 1, False), (8, 64, 4, 2, False), (12, 96, 3, 1, False),
                                 (8, 192, 2, 2, False), (8, 128, 3, 1, True)],
                         ids=["3wg_n64", "2wg_n64", "3wg_n96", "2wg_n192", "2wg_n128_f16"])
@pytest.mark.parametrize("per_page,page_size", [(True, 16), (True, 1), (False, 16)],
                         ids=["per_page16", "per_key", "per_tensor"])
@pytest.mark.parametrize("name", ["prefix_hit_gqa4", "mha_tile_edges", "sink_tokens_8", "softcap_window_sinks",
                                  "softcap_prefix"])
def test_fp8_hopper_key_tiles(name, per_page, page_size, cfg, monkeypatch):
    """The Hopper kernel's other FP8 tiles, in every scale mode (bench.ab --fp8-config): 64 keys (V^T
    rows of one 64-byte swizzle panel, a stage's scales the half of a 128-key block), 96 (panels of
    32 keys) and 192 (of 64), whose tiles start inside a 128-key block and end in the next (a stage
    holds both blocks' scales), with two or three consumer warpgroups; and f16 scores on two
    (two P operand buffers: the declared tile has three warpgroups and one)."""
    if prefill._default_arch() not in prefill.WGMMA_ARCHS:
        pytest.skip("the Hopper FP8 kernel is sm_90a only")
    w, n, st, qs, f16 = cfg
    c = prefill.Config(w, n, st, wgmma=True, q_stages=qs, f16_scores=f16)
    hopper = prefill.HOPPER_TILES.replace({(m, 128): c for m in prefill.KV_FP8_MODES})
    monkeypatch.setitem(prefill._tuned, prefill._default_arch(), (prefill.PORTABLE_TILES, hopper))
    seqs, hq, hk, kw = FP8_CASES[name]
    _fp8_attention_case(seqs, hq, hk, kw, per_page=per_page, page_size=page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 1024])
@pytest.mark.parametrize("layout", ["vllm", "sglang"])
def test_fp8_prefill_page_sizes_and_transitions(page_size, layout, body):
    """Scales jump by 2^3 at every page boundary: inside one 128-key tile for pages 1 and 16."""
    _fp8_attention_case([(200, 700), (64, 64), (1, 1100)], 8, 2, {}, page_size=page_size, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("per_page", [True, False], ids=["per_page", "per_tensor"])
def test_fp8_prefill_q_rows_of_any_magnitude(per_page, body):
    """The kernel quantizes Q with one scale per (token, head): an all-zero row (scale 1: S = 0,
    a uniform softmax, no NaN) and rows 10^-3 or 2 times the others keep the bound. (The bound
    assumes logits of about unit variance: Q's rounding alone moves a row 30 times larger past it.)"""
    def edit(q):
        q[3, 1] = 0
        q[290, :] = 0  # every head of a token
        q[10:40, 2] *= 1e-3
        q[100:160, 5] *= 2

    _fp8_attention_case([(300, 300), (20, 400)], 8, 2, {}, per_page=per_page, q_edit=edit)


@pytest.mark.gpu
@pytest.mark.parametrize("per_page", [True, False], ids=["per_page", "per_tensor"])
def test_fp8_prefill_large_k_scales(per_page, body):
    """K bytes 16 times smaller under scales 16 times larger (vLLM's uncalibrated k_scale = 1 is
    of this kind): the same logits, but S's multiplier to log2 units (scale * max|q| * K's scale)
    is past 1, which the f16-score tiles must carry as it is (a clamp to 1 there shrank every
    logit), with K's bytes partly e4m3 subnormals."""
    def edit(kc, table, seqs_k, scales):
        used = torch.unique(table.flatten()).long()
        kc[used] = (kc[used].float() / 16).to(kc.dtype)
        if per_page:
            scales["k_descale"].mul_(16)
        else:
            scales["k_scale"] *= 16

    # per tensor: Q 4 times larger, so that the multiplier (~2) passes 1 with logits of std ~0.6; per
    # page it is ~3 as it stands (the 0.4 pages' scales)
    _fp8_attention_case([(300, 300), (20, 400), (1, 129)], 8, 2, {}, per_page=per_page, cache_edit=edit,
                        q_edit=None if per_page else (lambda q: q.mul_(4)))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 1])
def test_fp8_prefill_v_scales_far_apart(page_size, body):
    """Per page: V scales 2^-10 of the others' on four pages in five (P times a V factor far under 1:
    e4m3 subnormals, O's terms tiny) and 0 on one, in one request. Those keys carry most of the
    softmax's mass, so l must count their P (a sum that left them out would be off several times)."""
    def edit(kc, table, seqs_k, scales):
        pages = table[0, : -(-seqs_k[0] // page_size)].long()
        keep = torch.zeros(len(pages), dtype=torch.bool)
        keep[::5] = True
        scales["v_descale"][pages[~keep.to(pages.device)]] *= 2.0 ** -10
        scales["v_descale"][pages[6]] = 0.0

    _fp8_attention_case([(300, 1500), (64, 700)], 8, 2, {}, page_size=page_size, cache_edit=edit)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 1])
def test_fp8_prefill_k_scales_far_apart_and_negative_rows(page_size, body):
    """Per page: K scales 2^-10 of the others' on some pages and 0 on one, inside 128-key tiles (per 16 keys:
    group factors far under 1 and one that f16 rounds to zero, whose masked keys must stay -inf, not NaN);
    and a request whose every logit is about -20 (keys along u, queries along -u), where the per-16-key
    tile's bound of the row max (0 for a negative max) sends every tile to the exact max. That reference
    (about -29 log2 units) lies past the band where the Hopper kernel folds V's group factors into the
    exp2's addend (kFoldV: [-22, 106] log2 units with kDirectP's bias), so those rows' warps multiply P by the factors."""
    d = 128
    u = (torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(4)) * 2 - 1) / d ** 0.5
    seqs = [(300, 1500), (64, 700)]

    def edit(kc, table, seqs_k, scales):
        pages = table[0, : -(-seqs_k[0] // page_size)].long()
        scales["k_descale"][pages[3::7]] *= 2.0 ** -10
        scales["k_descale"][pages[4]] = 0.0
        g = torch.Generator().manual_seed(9)
        n = seqs_k[1]
        j = torch.arange(n)
        pg, slots = table[1, j // page_size].cpu().long(), j % page_size
        k = 5.0 * u + 0.05 * torch.randn(n, kc.shape[2], d, generator=g)
        kc[pg.to(DEV), slots.to(DEV)] = (k / scales["k_descale"].cpu()[pg][:, :, None]).to(kc.dtype).to(DEV)

    def q_edit(q):  # request 1's rows along -u: logits -4 * 5 = -20
        q[seqs[0][0]:] = (-4.0 * d ** 0.5 * u + 0.05 * torch.randn(q[seqs[0][0]:].shape,
                                                                     generator=torch.Generator().manual_seed(5))).to(q.dtype)

    _fp8_attention_case(seqs, 8, 2, {}, page_size=page_size, cache_edit=edit, q_edit=q_edit)


@pytest.mark.gpu
@pytest.mark.parametrize("per_page", [True, False], ids=["per_page", "per_tensor"])
@pytest.mark.parametrize("logit", [-20.0, 80.0], ids=["minus20", "plus80"])
def test_fp8_prefill_rows_past_the_direct_band(per_page, logit, body):
    """A request whose every logit is about `logit` nats (keys along u, queries along +-u), beside one of
    ordinary rows: references of about -29 and +115 log2 units lie outside [-22, 106], where the Hopper
    f16-score tiles take P's e4m3 bytes straight from the exp2's argument (kDirectP) and fold V's group
    factors into it (kFoldV), so those rows' warps take the f16 P times the bytes' scale instead; the
    other request's warps keep the bytes. (A row that stays on one path has that scale cancel in O / l;
    tests/test_fp8_exp_shift.py ties the scale to the bytes'.)"""
    d = 128
    u = (torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(4)) * 2 - 1) / d ** 0.5
    seqs = [(200, 600), (64, 700)]

    def edit(kc, table, seqs_k, scales):
        ps = kc.shape[1]
        n = seqs_k[1]
        j = torch.arange(n)
        pg, slots = table[1, j // ps].cpu().long(), j % ps
        k = 5.0 * u + 0.05 * torch.randn(n, kc.shape[2], d, generator=torch.Generator().manual_seed(9))
        s = scales["k_descale"].cpu()[pg][:, :, None] if "k_descale" in scales else scales["k_scale"]
        kc[pg.to(DEV), slots.to(DEV)] = (k / s).to(kc.dtype).to(DEV)

    def q_edit(q):  # request 1's rows along +-u: logits (logit / 5) * 5
        q[seqs[0][0]:] = (logit / 5.0 * d ** 0.5 * u + 0.05 * torch.randn(
            q[seqs[0][0]:].shape, generator=torch.Generator().manual_seed(5))).to(q.dtype)

    _fp8_attention_case(seqs, 8, 2, {}, per_page=per_page, cache_edit=edit, q_edit=q_edit)


@pytest.mark.gpu
@pytest.mark.parametrize("per_page", [True, False], ids=["per_page", "per_tensor"])
def test_fp8_prefill_long_requests_with_v_offset(per_page, body):
    """V with a mean makes O's sums grow like l, and the FP8 accumulator keeps ~14 bits: summed in
    the tensor cores over 4096 keys O lost rel 0.069 for V ~ N(2 sigma, sigma) (docs/fp8.md, long
    requests). Both bodies move O out of the FP8 accumulator every 1024 keys (O_PROMOTE: to shared
    memory on Hopper, fp32 or, on the f16-score tiles, f16 in units of the row sum; to a second fp32
    register copy in the portable body), so the bound holds at any length; the requests here promote
    3 times and 1 time (with rows past the request's end)."""
    _fp8_attention_case([(256, 4096), (1100, 2100)], 8, 2, {}, per_page=per_page, v_offset=4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("per_page,page_size", [(True, 16), (True, 1), (False, 16)],
                         ids=["per_page16", "per_key", "per_tensor"])
@pytest.mark.parametrize("kw", [{"softcap": 30.0, "sinks": True}, {"window": 2000, "sink_tokens": 4}, {"causal": False}],
                         ids=["softcap_sinks", "window_sink_tokens", "non_causal"])
def test_fp8_prefill_promoted_with_features(kw, per_page, page_size, body):
    """Work units of more than 1024 keys (both bodies move O out of the accumulator every 1024: O_PROMOTE)
    with the soft-cap and sinks, a window of 2000 keys with sink tokens, and without causality (every
    unit sees every key); V offset by 2 sigma, so that an O left in the FP8 accumulator would fail."""
    _fp8_attention_case([(300, 2600), (40, 3000)], 8, 2, kw, per_page=per_page, page_size=page_size, v_offset=4.0)


@pytest.mark.gpu
def test_fp8_prefill_fp16_queries(body):
    _fp8_attention_case([(300, 300), (10, 500)], 8, 2, {}, dtype=torch.float16)


@pytest.mark.gpu
def test_fp8_pool_over_4gib_pages_at_the_end(body):
    """A 4.3 GB pool per cache (1 head x 128 B per slot, 16-slot pages): the used pages,
    permuted, include the pool's last ones (byte offsets past 2^32)."""
    free = torch.cuda.mem_get_info()[0]
    if free < 12 * 2**30:
        pytest.skip("needs 12 GiB of free device memory")
    nb = (2**32 // (16 * 128)) + 4096
    _fp8_attention_case([(300, 900), (5, 700)], 4, 1, {}, num_blocks=nb)


@pytest.mark.gpu
@pytest.mark.parametrize("body", ["portable"], indirect=True)
@pytest.mark.parametrize("per_page,page_size", [(True, 16), (True, 1), (False, 16)],
                         ids=["per_page16", "per_key", "per_tensor"])
@pytest.mark.parametrize("name", ["prefix_hit_gqa4", "mha_tile_edges", "sink_tokens_8", "softcap_window_sinks"])
def test_fp8_prefill_head_dim_64(name, per_page, page_size, body):
    """d = 64: the portable body only (the Hopper kernel's FP8 path is d = 128)."""
    seqs, hq, hk, kw = FP8_CASES[name]
    _fp8_attention_case(seqs, hq, hk, kw, per_page=per_page, page_size=page_size, d=64)


def _rising_keys(kc, table, seqs_k, scales, u, jump=600):
    """K of key j = (0.003 j + 6 [j >= jump]) u + noise, stored as e4m3 under its page's scale: with Q
    along u the logits rise along the keys, a little on every tile (P > 1 under the lazy reference
    max) and by 6 (more than 2^8 in P) at key `jump`, which must move it and rescale O (past 1024
    keys: O's fp32 partial too). The range stays small: Q's rounding moves a logit by about 0.2 % of it."""
    g = torch.Generator().manual_seed(9)
    ps = kc.shape[1]
    for b, n in enumerate(seqs_k):
        j = torch.arange(n)
        pages, slots = table[b, j // ps].cpu().long(), j % ps
        k = (0.003 * j + 6.0 * (j >= jump))[:, None, None] * u + 0.05 * torch.randn(n, kc.shape[2], kc.shape[3], generator=g)
        s = scales["k_descale"].cpu()[pages][:, :, None] if "k_descale" in scales else scales["k_scale"]
        kc[pages.to(DEV), slots.to(DEV)] = (k / s).to(kc.dtype).to(DEV)


@pytest.mark.gpu
@pytest.mark.parametrize("per_page", [True, False], ids=["per_page", "per_tensor"])
@pytest.mark.parametrize("seqs,jump", [([(300, 1000), (64, 700)], 600), ([(300, 2600), (64, 700)], 1500)],
                         ids=["short", "past_promotion"])
def test_fp8_prefill_row_max_that_keeps_growing(per_page, seqs, jump, body):
    d = 128
    u = (torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(4)) * 2 - 1) / d ** 0.5  # flat: +-1/sqrt(d)

    def q_along_u(q):
        q.copy_((u * d ** 0.5 + 0.05 * torch.randn(q.shape, generator=torch.Generator().manual_seed(5))).to(q.dtype))

    _fp8_attention_case(seqs, 4, 2, {}, per_page=per_page, q_edit=q_along_u,
                        cache_edit=lambda kc, table, seqs_k, scales: _rising_keys(kc, table, seqs_k, scales, u, jump))
