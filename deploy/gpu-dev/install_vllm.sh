#!/usr/bin/env bash
# Runs ON the GPU machine (no network, no index): installs the vLLM 0.26.0 stage that
# deploy/gpu-dev/stage_vllm.py built, from the chunks that the device calls copied into
# STAGE_DIR (default /tmp/atom-stage: MANIFEST + vllm-stage.tar.xz.part*), into /tmp/vllm-site.
#
#   bash deploy/gpu-dev/install_vllm.sh [STAGE_DIR]
#   export PYTHONPATH=/tmp/vllm-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/vllm-site/bin:$PATH
#
# Checks every chunk's size and sha256, reassembles and checks the payload, installs its wheels
# with pip (--no-index --no-deps --target), then runs a smoke check: imports of the serving
# path's entry modules and vLLM's kernels, plus three tiny GPU ops (RMSNorm from _C, MoE
# alignment from _moe_C, FA3 attention against a torch reference). Exits non-zero on any failure.
# Idempotent: a site already built from the same payload is kept (only the smoke check reruns).
# Env: VLLM_SITE (default /tmp/vllm-site), PYTHON (default python3), ATOM_SKIP_SMOKE=1.
set -euo pipefail

STAGE=${1:-${ATOM_STAGE:-/tmp/atom-stage}}
SITE=${VLLM_SITE:-/tmp/vllm-site}
PY=${PYTHON:-python3}
MANIFEST=$STAGE/MANIFEST

die() { echo "install_vllm: $1" >&2; exit "${2:-1}"; }

[ -f "$MANIFEST" ] || die "no $MANIFEST: copy the chunks first (cp .stage/cK/* $STAGE/, one device call per chunk)" 2
read -r _ PAYLOAD PAYLOAD_SIZE PAYLOAD_SHA < <(awk '$1 == "payload"' "$MANIFEST")
[ -n "${PAYLOAD_SHA:-}" ] || die "$MANIFEST has no payload line" 2
MARKER=$SITE/.atom-stage-payload

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$PAYLOAD_SHA" ]; then
  echo "install_vllm: $SITE already holds this stage (payload ${PAYLOAD_SHA:0:16}); not reinstalled"
else
  # 1. every chunk present, right size, right sha256
  missing=()
  parts=()
  while read -r _ chunk name size sha; do
    f=$STAGE/$name
    if [ ! -f "$f" ]; then
      missing+=("$chunk ($name: absent)")
    elif [ "$(stat -c %s "$f")" != "$size" ]; then
      missing+=("$chunk ($name: $(stat -c %s "$f") bytes, want $size)")
    elif [ "$(sha256sum "$f" | cut -d' ' -f1)" != "$sha" ]; then
      missing+=("$chunk ($name: sha256 mismatch)")
    fi
    parts+=("$f")
  done < <(awk '$1 == "chunk"' "$MANIFEST")
  [ "${#parts[@]}" -gt 0 ] || die "$MANIFEST lists no chunk" 2
  if [ "${#missing[@]}" -gt 0 ]; then
    printf 'install_vllm: missing or bad chunk: %s\n' "${missing[@]}" >&2
    die "carry every chunk again, in back-to-back calls: the machine keeps /tmp only ~30 s after a call" 3
  fi
  echo "install_vllm: ${#parts[@]} chunk(s) OK"

  # 2. reassemble, check, unpack (Python's tarfile: no xz binary needed)
  work=$STAGE/work
  rm -rf "$work" && mkdir -p "$work"
  cat "${parts[@]}" > "$work/$PAYLOAD"
  [ "$(sha256sum "$work/$PAYLOAD" | cut -d' ' -f1)" = "$PAYLOAD_SHA" ] || die "reassembled payload: sha256 mismatch"
  "$PY" - "$work/$PAYLOAD" "$work" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2], filter="data")
EOF
  rm -f "$work/$PAYLOAD"

  # 3. install the wheels into a fresh site, then swap it in
  rm -rf "$SITE.new"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$SITE.new" "$work"/vllm-stage/wheels/*.whl
  cp "$work/vllm-stage/WHEELS.txt" "$SITE.new/.atom-stage-wheels.txt"
  echo "$PAYLOAD_SHA" > "$SITE.new/.atom-stage-payload"
  rm -rf "$SITE" && mv "$SITE.new" "$SITE"
  rm -rf "$work"
  echo "install_vllm: installed $(ls "$SITE" | grep -c '\.dist-info$') wheels into $SITE"
fi

# FlashInfer is not carried: vLLM 0.26's sampler imports it unless told not to.
echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH VLLM_USE_FLASHINFER_SAMPLER=0"

[ "${ATOM_SKIP_SMOKE:-0}" = 1 ] && exit 0

# 4. smoke check
PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" - <<'EOF'
import importlib, sys, time
t0 = time.time()
fails = []
mods = """vllm vllm._C_stable_libtorch vllm._moe_C_stable_libtorch vllm.vllm_flash_attn
vllm.entrypoints.openai.api_server vllm.entrypoints.cli.main vllm.entrypoints.llm
vllm.v1.engine.core vllm.v1.engine.async_llm vllm.v1.worker.gpu_worker vllm.v1.worker.gpu_model_runner
vllm.model_executor.models.llama vllm.model_executor.models.gpt_oss vllm.model_executor.models.gemma2
vllm.v1.attention.backends.flash_attn vllm.v1.attention.backends.triton_attn
vllm.v1.spec_decode.ngram_proposer""".split()
for m in mods:
    try:
        importlib.import_module(m)
    except BaseException as e:  # noqa: BLE001 - report every failure, keep going
        fails.append(m)
        print(f"FAIL import {m}: {type(e).__name__}: {e}")

def check(name, fn):
    try:
        fn()
        print(f"ok   {name}")
    except BaseException as e:  # noqa: BLE001
        fails.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {e}")

def platform():
    import torch
    import vllm
    from vllm.platforms import current_platform
    cap = torch.cuda.get_device_capability()
    print(f"     vllm {vllm.__version__} ({vllm.__file__}), torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, platform {type(current_platform).__name__}")
    assert current_platform.is_cuda(), "vLLM did not pick its CUDA platform"
    if cap[0] != 9:
        print("     warning: this stage keeps only sm_90 kernels (stage_vllm.py --all-archs keeps all)")

def fa3_available():
    from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    assert FA3_AVAILABLE, FA3_UNAVAILABLE_REASON
    v = get_flash_attn_version()
    assert v == 3, f"FLASH_ATTN would use FA{v}"

def rms_norm():  # a kernel of _C_stable_libtorch
    import torch
    from vllm import _custom_ops as ops
    x = torch.randn(7, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)

def moe_align():  # a kernel of _moe_C_stable_libtorch
    import torch
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    topk_ids = torch.randint(0, 32, (37, 4), dtype=torch.int32, device="cuda")
    sorted_ids, expert_ids, n_post_pad = moe_align_block_size(topk_ids, 16, 32)
    n = int(n_post_pad.item())
    assert n % 16 == 0 and n >= topk_ids.numel(), n
    valid = sorted_ids[:n][sorted_ids[:n] < topk_ids.numel()]
    assert valid.numel() == topk_ids.numel(), (valid.numel(), topk_ids.numel())
    assert valid.sort().values.equal(torch.arange(topk_ids.numel(), device="cuda", dtype=valid.dtype))

def fa3_attention():  # FA3 (FLASH_ATTN's kernel on Hopper) against torch SDPA
    import torch
    import torch.nn.functional as F
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    lens = [5, 33, 130]
    hq, hk, d = 8, 2, 128
    tot = sum(lens)
    q = torch.randn(tot, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tot, hk, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(tot, hk, d, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, max(lens), cu, max(lens), cu_seqlens_k=cu,
                                 causal=True, fa_version=3)
    refs, s = [], 0
    for n in lens:
        qs, ks, vs = (t[s:s + n].transpose(0, 1) for t in (q, k, v))
        refs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    .transpose(0, 1))
        s += n
    torch.testing.assert_close(out, torch.cat(refs), atol=2e-2, rtol=2e-2)

check("CUDA platform", platform)
check("FA3 available, chosen for FLASH_ATTN", fa3_available)
check("_C kernel: rms_norm", rms_norm)
check("_moe_C kernel: moe_align_block_size", moe_align)
check("FA3 kernel: varlen causal GQA vs SDPA", fa3_attention)
print(f"smoke check: {len(mods)} imports + 5 checks, {len(fails)} failed ({time.time() - t0:.0f} s)")
if fails:
    print("failed: " + " ".join(fails))
    sys.exit(1)
EOF
