#!/usr/bin/env python3
"""Stage vLLM 0.26.0 (CUDA build) for the lent GPU machine, which has no network and no index.

The device tool copies the working tree plus at most 8 ignored paths, <= 64 MiB a call, so the
payload travels as a few chunks of <= 60 MiB carried by back-to-back calls (the machine keeps
/tmp only while warm: ~30 s after a call). This script, run here (standard library only):

1. downloads vllm==0.26.0 and the wheels its serving path imports (DEPS below, pinned, each
   with its reason) into .stage/dl/ (kept: a rerun downloads only what is missing);
2. writes a slimmed vLLM wheel (DROP below; RECORD fixed, so it stays pip-installable) and
   re-stores every wheel uncompressed (ZIP_STORED: same files, same RECORD) so that xz sees
   the raw bytes: the CUDA kernels compress far better that way than inside deflate;
   unless --all-archs, the kernels that an sm_90 GPU (H100/H200) can never load are zeroed
   in place in vLLM's extensions (see prune_fatbin: same size and layout, RECORD updated),
   which takes the payload from three chunks to about one (DEP_DROP trims the rest);
3. packs the wheels into one tar.xz and splits it into the fewest chunks of <= --chunk-mib,
   .stage/c0/, .stage/c1/, ... (each holds its part and a copy of MANIFEST), and writes
   .stage/MANIFEST (names, sizes, sha256).

On the machine, deploy/gpu-dev/install_vllm.sh checks, reassembles and installs them into
/tmp/vllm-site. `stage_vllm.py commands` prints the device calls (deploy/gpu-dev/README.md).

Everything the machine already has (torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0,
numpy 2.5.2, numba 0.68.0, aiohttp, httpx, anyio, prometheus-client, ...) is not carried.
Known metadata mismatches that are deliberately left as they are (all installs use --no-deps):
vLLM pins numba==0.65.0 and setuptools<81 (machine: 0.68.0, 81.0.0); mistral_common caps
numpy<2.4 on Python 3.12 (machine: 2.5.2).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import lzma
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / ".stage"
PAYLOAD = "vllm-stage.tar.xz"
LAYOUT = 2  # bump when the payload's layout or packing changes (invalidates the cache)

VLLM = ("vllm", "0.26.0")

# Members dropped from the vLLM wheel: (path or folder prefix inside the wheel, why).
DROP = [
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
     "FA2 (305 MB): on Hopper FLASH_ATTN runs FA3 (fa_utils.get_flash_attn_version)"),
    ("vllm/vllm-rs",
     "Rust frontend binary: used only with VLLM_USE_RUST_FRONTEND=1 (default 0)"),
    ("vllm/third_party/deep_gemm/",
     "DeepGEMM (FP8 block-quant GEMMs): has_deep_gemm() is then False"),
    ("vllm/third_party/fmha_sm100/",
     "SM100 sparse attention, imported only by MiniMax-M3 on Blackwell"),
    ("vllm/_flashmla_C.abi3.so", "FlashMLA (MLA models): import guarded"),
    ("vllm/_flashmla_extension_C.abi3.so", "FlashMLA sparse: import guarded"),
    ("vllm/_qutlass_C.abi3.so", "QuTLASS FP4 kernels: import suppressed"),
]

# Members dropped from other wheels, by canonical name (same mechanism, RECORD fixed too).
DEP_DROP = {
    "pycountry": [("pycountry/locales/",
                   "gettext catalogs (country/language names in other languages, 2.7 MiB of "
                   "xz): nothing on the serving path translates; without them the payload "
                   "fits one 60 MiB chunk")],
}

# Wheels carried besides vLLM: (name, version, reason). cp312 / abi3 / pure, manylinux x86-64.
DEPS = [
    # OpenAI server: FastAPI app, uvicorn, /metrics
    ("fastapi", "0.136.3", "the OpenAI server's app; vLLM wants >=0.133,<0.137"),
    ("starlette", "1.10.0", "fastapi's ASGI core; vLLM wants >=1.0.1"),
    ("pydantic", "2.14.4", "vLLM's configs and protocol models (>=2.12)"),
    ("pydantic_core", "2.50.5", "the exact core that pydantic 2.14.4 pins"),
    ("annotated-types", "0.8.0", "pydantic dependency"),
    ("typing-inspection", "0.4.5", "pydantic and fastapi dependency"),
    ("uvicorn", "0.54.0", "HTTP server started by vllm.entrypoints.launcher"),
    ("httptools", "0.9.0", "uvicorn[standard] HTTP parser (auto-selected when present)"),
    ("websockets", "17.4", "uvicorn[standard]; vLLM's websocket (realtime) routes"),
    ("python-dotenv", "1.2.4", "uvicorn[standard] (--env-file)"),
    ("watchfiles", "1.3.0", "vLLM requirement; uvicorn reload and the SSL cert refresher"),
    ("python-multipart", "0.0.34", "fastapi form/upload routes (transcription) need it at app build"),
    ("email-validator", "2.4.0", "fastapi[standard]; pydantic EmailStr"),
    ("dnspython", "2.9.2", "email-validator dependency"),
    ("prometheus-fastapi-instrumentator", "8.1.0", "the server's /metrics (vLLM wants >=8)"),
    ("model-hosting-container-standards", "0.1.16",
     "imported by api_server at startup (SageMaker router), vLLM wants >=0.1.14,<1"),
    ("jmespath", "1.1.0", "model-hosting-container-standards dependency"),
    ("supervisor", "4.3.0", "model-hosting-container-standards dependency"),
    # OpenAI protocol, gpt-oss chat format
    ("openai", "2.54.0", "protocol types imported by vllm.entrypoints (>=2); last 2.x: "
     "httpx-based (machine has httpx), all 80 openai imports of vLLM 0.26 resolve"),
    ("jiter", "0.19.0", "openai dependency"),
    ("distro", "1.9.0", "openai dependency"),
    ("sniffio", "1.3.1", "openai dependency"),
    ("openai-harmony", "0.0.8", "gpt-oss (harmony) format; imported at startup via vllm.reasoning"),
    # engine core, workers, compile
    ("msgspec", "0.23.0", "engine-core <-> frontend message serialization"),
    ("pyzmq", "27.3.0", "engine-core IPC sockets (zmq)"),
    ("cbor2", "6.3.0", "vllm.utils.hashing, imported by vllm.config"),
    ("pybase64", "1.5.1", "vllm.multimodal media, imported at startup"),
    ("blake3", "1.0.11", "default multimodal hasher"),
    ("setproctitle", "1.3.8", "names the engine-core and worker processes"),
    ("cachetools", "8.0.2", "vLLM requirement (caches in model and tokenizer utils)"),
    ("python-json-logger", "4.2.0", "vLLM requirement (JSON logging configs)"),
    ("ijson", "3.6.0", "mistral tool parser"),
    ("partial-json-parser", "0.2.1.1.post7", "streaming tool-call parsers"),
    ("depyf", "0.20.0", "torch.compile path (vllm.compilation.wrapper/monitor); vLLM pin"),
    ("astor", "0.8.1", "depyf dependency"),
    ("dill", "0.4.1", "depyf dependency"),
    ("compressed-tensors", "0.17.0", "quantization configs (vLLM pin)"),
    ("loguru", "0.7.3", "compressed-tensors dependency"),
    # tokenizer backends and structured output (all imported when the engine starts)
    ("mistral_common", "1.13.1", "transformers' MistralCommonBackend, imported by "
     "vllm.v1.structured_output at startup (its numpy<2.4 cap is ignored)"),
    ("pydantic-extra-types", "2.11.1", "mistral_common dependency"),
    ("pycountry", "26.2.16", "pydantic-extra-types[pycountry]: mistral_common fails without it"),
    ("jsonschema", "4.26.0", "mistral_common and structured output (vLLM wants >=4.23)"),
    ("jsonschema-specifications", "2025.9.1", "jsonschema dependency"),
    ("referencing", "0.37.0", "jsonschema dependency"),
    ("rpds-py", "2026.9.1", "jsonschema dependency"),
    ("xgrammar", "0.2.7", "default structured-output backend; imported at startup "
     "(backend_xgrammar's dataclass annotations load it); newest that accepts tvm-ffi 0.1.10"),
    ("apache-tvm-ffi", "0.1.10", "xgrammar imports tvm_ffi unconditionally; vLLM pins 0.1.10"),
    ("llguidance", "1.7.6", "guidance backend, imported at startup (backend_guidance)"),
    ("outlines_core", "0.2.14", "outlines structured-output backend (vLLM pin)"),
    ("lark", "1.2.2", "grammar parsing (vLLM pin)"),
    ("lm-format-enforcer", "0.11.3", "lm-format-enforcer backend (vLLM pin)"),
    ("interegular", "0.3.3", "lm-format-enforcer dependency"),
    # tracing: vllm.tracing imports these at startup inside a try; small and pure Python
    ("opentelemetry-api", "1.45.2", "vllm.tracing (--otlp-traces-endpoint)"),
    ("opentelemetry-sdk", "1.45.2", "vllm.tracing"),
    ("opentelemetry-semantic-conventions", "0.66b2", "opentelemetry-sdk dependency"),
    ("opentelemetry-semantic-conventions-ai", "0.5.1", "vLLM requirement (tracing attributes)"),
    ("opentelemetry-exporter-otlp", "1.45.2", "vLLM requirement (OTLP exporters)"),
    ("opentelemetry-exporter-otlp-proto-grpc", "1.45.2", "OTLP over gRPC (grpcio is on the machine)"),
    ("opentelemetry-exporter-otlp-proto-http", "1.45.2", "OTLP over HTTP"),
    ("opentelemetry-exporter-otlp-common", "0.66b2", "OTLP exporters' dependency"),
    ("opentelemetry-exporter-otlp-proto-common", "1.45.2", "OTLP exporters' dependency"),
    ("opentelemetry-exporter-http-transport", "0.66b2", "OTLP HTTP exporter dependency"),
    ("opentelemetry-proto", "1.45.2", "OTLP exporters' dependency (protobuf 7 on the machine)"),
    ("googleapis-common-protos", "1.76.0", "OTLP exporters' dependency"),
]
# Left out on purpose (vLLM lists them; nothing on the serving path of a bf16 Llama / gpt-oss /
# Gemma-2 on Hopper imports them unconditionally): flashinfer-python, nvidia-cutlass-dsl,
# nvidia-cudnn-frontend, tilelang, quack-kernels, humming-kernels, tokenspeed-mla, torchcodec,
# PyNvVideoCodec, fastsafetensors, nvtx (profiling only), anthropic (vLLM never imports the
# SDK), mcp (only with --tool-server), fastapi-cli / fastapi-cloud-cli (the `fastapi` command).

PLATFORMS = ["manylinux_2_%d_x86_64" % n for n in (35, 34, 31, 28, 27, 26, 24, 17, 5)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64"]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_wheel(folder: Path, name: str, version: str) -> Path | None:
    hits = []
    for p in folder.glob("*.whl"):
        parts = p.name[:-4].split("-")
        if len(parts) >= 5 and canon(parts[0]) == canon(name) and parts[1] == version:
            hits.append(p)
    if len(hits) > 1:
        sys.exit(f"error: several wheels for {name}=={version} in {folder}: {hits}")
    return hits[0] if hits else None


def download(dl: Path, reqs: list[tuple[str, str]]) -> None:
    missing = [(n, v) for n, v in reqs if find_wheel(dl, n, v) is None]
    if not missing:
        print(f"downloads: all {len(reqs)} wheels already in {dl.relative_to(ROOT)}")
        return
    print(f"downloads: fetching {len(missing)} wheels: " + " ".join(f"{n}=={v}" for n, v in missing))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--python-version", "3.12", "--implementation", "cp",
           "-d", str(dl)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += [f"{n}=={v}" for n, v in missing]
    subprocess.run(cmd, check=True)
    still = [(n, v) for n, v in reqs if find_wheel(dl, n, v) is None]
    if still:
        sys.exit(f"error: still missing after download: {still}")


def dropped(member: str, drop: list[tuple[str, str]]) -> bool:
    return any(member == d or (d.endswith("/") and member.startswith(d)) for d, _ in drop)


FATBIN_MAGIC = 0xBA55ED50
KEEP_SM = 90  # the machine: NVIDIA H200, compute capability 9.0


def _elf_section(buf: bytes, wanted: str) -> tuple[int, int] | None:
    """(offset, size) of an ELF64 little-endian section, or None."""
    if buf[:4] != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", buf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", buf, shoff + i * shentsize) for i in range(shnum)]
    stroff = heads[shstrndx][4]
    for name, _type, _flags, _addr, off, size in heads:
        end = buf.index(b"\0", stroff + name)
        if buf[stroff + name:end].decode() == wanted:
            return off, size
    return None


def prune_fatbin(buf: bytes) -> tuple[bytes, int]:
    """Zero, in place, the fatbin images that a compute-capability-9.0 GPU never loads.

    A CUDA fatbin holds, per compiled unit (a container), one image per target: SASS cubins
    (kind 2) and PTX (kind 1). The driver runs a cubin only on its own major version
    (sm_80 code cannot run on sm_90, nor sm_100 code), and JIT-compiles PTX only when no
    cubin fits. So on sm_90: every cubin of another arch is dead, and so is the PTX of a
    container that has an sm_90 cubin. Their payloads are zeroed; headers, sizes and offsets
    stay, so the ELF and the fatbin are laid out exactly as before. Returns (bytes, zeroed).
    """
    sec = _elf_section(buf, ".nv_fatbin")
    if sec is None:
        return buf, 0
    out = bytearray(buf)
    off, size = sec
    p, end, zeroed = off, off + size, 0
    while p < end:
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", buf, p)
        if magic != FATBIN_MAGIC:
            if any(buf[p:p + 8]):
                raise ValueError(f"unexpected bytes in .nv_fatbin at {p:#x}")
            p += 8  # alignment padding between containers
            continue
        q, cend, images = p + hsize, p + hsize + fsize, []
        if cend > end:
            raise ValueError(f"fatbin container at {p:#x} overruns its section")
        while q < cend:
            kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", buf, q)
            arch, = struct.unpack_from("<I", buf, q + 28)
            if kind not in (1, 2) or ehsize < 64 or q + ehsize + psize > cend:
                raise ValueError(f"unexpected fatbin entry at {q:#x}")
            images.append((kind, arch, q + ehsize, psize))
            q += ehsize + psize
        has_sass = any(k == 2 and a == KEEP_SM for k, a, _, _ in images)
        for kind, arch, start, psize in images:
            if (kind == 2 and arch != KEEP_SM) or (kind == 1 and has_sass):
                out[start:start + psize] = bytes(psize)
                zeroed += psize
        p = cend
    return bytes(out), zeroed


def record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}\n"


def restore_wheel(src: Path, dst: Path, drop: list[tuple[str, str]], prune: bool) -> dict:
    """Rewrite src as dst with every member ZIP_STORED, leaving out the members in drop and,
    if prune, zeroing dead kernel images in its extensions; RECORD is rewritten to match."""
    stats = {"kept": 0, "dropped": 0, "zeroed": 0}
    changed: dict[str, bytes] = {}
    tmp = dst.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zo:
        members = zi.infolist()
        record = next(i for i in members if i.filename.endswith(".dist-info/RECORD"))
        for info in members:
            if info is record:
                continue
            if dropped(info.filename, drop):
                stats["dropped"] += 1
                continue
            data = zi.read(info)
            if prune and info.filename.endswith(".so"):
                data, zeroed = prune_fatbin(data)
                if zeroed:
                    changed[info.filename] = data
                    stats["zeroed"] += zeroed
            write_stored(zo, info, data)
            stats["kept"] += 1
        lines = []
        for line in zi.read(record).decode().splitlines(keepends=True):
            path = line.split(",", 1)[0]
            if dropped(path, drop):
                continue
            lines.append(record_line(path, changed[path]) if path in changed else line)
        write_stored(zo, record, "".join(lines).encode())
    tmp.replace(dst)
    return stats


def write_stored(zo: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes) -> None:
    out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    out.external_attr = info.external_attr
    out.create_system = info.create_system
    out.compress_type = zipfile.ZIP_STORED
    zo.writestr(out, data)


def build(args: argparse.Namespace) -> None:
    dl, build_dir = STAGE / "dl", STAGE / "build"
    dl.mkdir(parents=True, exist_ok=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    if args.vllm_wheel and find_wheel(dl, *VLLM) is None:
        src = Path(args.vllm_wheel).resolve()
        print(f"vllm wheel: copying {src}")
        shutil.copy2(src, dl / src.name)
    download(dl, [VLLM] + [(n, v) for n, v, _ in DEPS])

    sources = [find_wheel(dl, *VLLM)] + [find_wheel(dl, n, v) for n, v, _ in DEPS]
    key_src = [f"layout={LAYOUT}", f"all_archs={args.all_archs}"]
    key_src += [f"drop={d}" for d, _ in DROP]
    key_src += [f"drop:{n}={d}" for n, ds in sorted(DEP_DROP.items()) for d, _ in ds]
    print(f"hashing {len(sources)} wheels ...")
    key_src += [f"{p.name}={sha256(p)}" for p in sources]
    key = hashlib.sha256("\n".join(key_src).encode()).hexdigest()
    key_file = build_dir / "payload.key"
    payload = build_dir / PAYLOAD
    if (not args.force and key_file.exists() and key_file.read_text().strip() == key
            and payload.exists()):
        print(f"payload: up to date ({payload.relative_to(ROOT)}), not repacked")
    else:
        wheels = build_dir / "wheels"
        shutil.rmtree(wheels, ignore_errors=True)
        wheels.mkdir()
        for i, src in enumerate(sources):
            drop = DROP if i == 0 else DEP_DROP.get(canon(src.name.split("-")[0]), [])
            st = restore_wheel(src, wheels / src.name, drop, prune=(i == 0 and not args.all_archs))
            if i > 0 and st["dropped"]:
                print(f"{src.name}: dropped {st['dropped']} members")
            if i == 0:
                print(f"vllm wheel: kept {st['kept']} members, dropped {st['dropped']}, zeroed "
                      f"{st['zeroed'] / 2**20:.1f} MiB of non-sm_90 kernel images "
                      f"({(wheels / src.name).stat().st_size / 2**20:.1f} MiB stored)")
        listing = "".join(f"{n}=={v}  # {r}\n" for n, v, r in [VLLM + ("slimmed",)] + DEPS)
        listing += "".join(f"# dropped from {n}: {d} ({r})\n"
                           for n, ds in [("vllm", DROP)] + sorted(DEP_DROP.items()) for d, r in ds)
        tmp = payload.with_suffix(".tmp")
        print(f"payload: tar + xz -9e of {len(sources)} wheels (single thread, a few minutes) ...")
        with tarfile.open(tmp, "w:xz", preset=9 | lzma.PRESET_EXTREME, format=tarfile.PAX_FORMAT) as tar:
            def add_bytes(name: str, data: bytes) -> None:
                ti = tarfile.TarInfo(name)
                ti.size, ti.mtime, ti.mode = len(data), 1700000000, 0o644
                tar.addfile(ti, io.BytesIO(data))
            add_bytes("vllm-stage/WHEELS.txt", listing.encode())
            for p in sorted(wheels.iterdir()):
                ti = tar.gettarinfo(str(p), arcname=f"vllm-stage/wheels/{p.name}")
                ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.mode = 1700000000, 0, 0, "", "", 0o644
                with open(p, "rb") as f:
                    tar.addfile(ti, f)
        tmp.replace(payload)
        key_file.write_text(key + "\n")
        shutil.rmtree(wheels)
    split(payload, args.chunk_mib, "all archs" if args.all_archs else f"sm_{KEEP_SM} only")
    if args.copy_to:
        copy_to(Path(args.copy_to))
    print_commands()


def split(payload: Path, chunk_mib: int, kernels: str) -> None:
    size = payload.stat().st_size
    limit = chunk_mib * 2**20
    n = max(1, math.ceil(size / limit))
    part = math.ceil(size / n)
    for old in STAGE.glob("c[0-9]*"):
        shutil.rmtree(old)
    lines = [f"# vLLM {VLLM[1]} stage for the GPU machine: written by deploy/gpu-dev/stage_vllm.py",
             f"# {len(DEPS) + 1} wheels; {n} chunk(s) of <= {chunk_mib} MiB; "
             f"install with deploy/gpu-dev/install_vllm.sh",
             f"kernels {kernels.replace(' ', '-')}",
             f"payload {PAYLOAD} {size} {sha256(payload)}"]
    with open(payload, "rb") as f:
        for k in range(n):
            d = STAGE / f"c{k}"
            d.mkdir()
            name = f"{PAYLOAD}.part{k}"
            data = f.read(part)
            (d / name).write_bytes(data)
            lines.append(f"chunk c{k} {name} {len(data)} {hashlib.sha256(data).hexdigest()}")
    lines += [f"wheel {n_}=={v}" for n_, v in [VLLM] + [(a, b) for a, b, _ in DEPS]]
    manifest = "\n".join(lines) + "\n"
    (STAGE / "MANIFEST").write_text(manifest)
    for k in range(n):
        (STAGE / f"c{k}" / "MANIFEST").write_text(manifest)
    print(f"chunks: {n} x <= {chunk_mib} MiB from a {size / 2**20:.2f} MiB payload:")
    for l in lines:
        if l.startswith("chunk"):
            _, c, name, sz, h = l.split()
            print(f"  .stage/{c}/{name}  {int(sz)} bytes ({int(sz) / 2**20:.2f} MiB)  sha256 {h[:16]}...")


def copy_to(dest: Path) -> None:
    """Copy MANIFEST and the chunk folders into another checkout's .stage (replacing its own)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("c[0-9]*"):
        shutil.rmtree(old)
    shutil.copy2(STAGE / "MANIFEST", dest / "MANIFEST")
    for c in sorted(STAGE.glob("c[0-9]*")):
        shutil.copytree(c, dest / c.name)
    print(f"copied MANIFEST and {len(list(STAGE.glob('c[0-9]*')))} chunk folder(s) to {dest}")


def chunks() -> list[str]:
    manifest = STAGE / "MANIFEST"
    if not manifest.exists():
        return []
    return [l.split()[1] for l in manifest.read_text().splitlines() if l.startswith("chunk ")]


def print_commands() -> None:
    cs = chunks() or ["c0", "c1", "c2"]
    if len(cs) == 1:
        print("\nDevice call (one; a later call within ~30 s can reuse /tmp/vllm-site):")
    else:
        print(f"\nDevice calls: {len(cs)}, back to back (the machine keeps /tmp only ~30 s after a call):")
    for k, c in enumerate(cs):
        copy = f"mkdir -p /tmp/atom-stage && cp .stage/{c}/* /tmp/atom-stage/"
        if k < len(cs) - 1:
            cmd = f"{copy} && ls -l /tmp/atom-stage"
        else:
            cmd = (f"{copy} && bash deploy/gpu-dev/install_vllm.sh && "
                   f"export PYTHONPATH=/tmp/vllm-site${{PYTHONPATH:+:$PYTHONPATH}} "
                   f"PATH=/tmp/vllm-site/bin:$PATH && <your work>")
        print(f"  call {k + 1}: carry [\".stage/{c}\"]\n    {cmd}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="download, slim, pack and split (default)")
    b.add_argument("--vllm-wheel", help="a local vllm-0.26.0 wheel to use instead of downloading it")
    b.add_argument("--chunk-mib", type=int, default=60, help="largest chunk, MiB (default 60)")
    b.add_argument("--force", action="store_true", help="repack even if the inputs are unchanged")
    b.add_argument("--all-archs", action="store_true",
                   help="keep the kernels of every GPU arch (default: zero those an sm_90 GPU "
                        "never loads; about 3 chunks instead of 1)")
    b.add_argument("--copy-to", help="also copy MANIFEST and chunks into this .stage folder")
    sub.add_parser("commands", help="print the device calls for the chunks built")
    args = ap.parse_args()
    if args.cmd == "commands":
        print_commands()
        return
    if args.cmd is None:
        args = b.parse_args([])
    build(args)


if __name__ == "__main__":
    main()
