"""A model's attention facts from a Hugging Face config.json or from a few flags (torch-free).

What the kernels care about: query / kv heads, head dim, the query dtype, the KV cache dtypes
the deployment may use (each one is its own set of variants), sinks (gpt-oss), the window of
every layer (``layer_types`` / ``sliding_window``), soft-cap and the page size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from atom_backend.planning import ModelFacts, PlanError, reduce_layer_windows
from hip_kernels.runtime.arch import native_fp8_name

_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}


@dataclass
class ModelSpec:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    kv_dtypes: tuple = ("auto",)  # auto (= dtype) | bf16 | fp16 | fp8 (the arch's native e4m3)
    kv_scale_mode: str = "per_tensor"  # for fp8 caches (vLLM passes per-tensor scales)
    has_sinks: bool = False
    layer_windows: tuple = (0,)  # one entry per layer (0: full attention)
    sink_tokens: int = 0
    softcap: float = 0.0
    page_size: int = 16
    name: str = "model"
    notes: list = field(default_factory=list)

    def facts(self, arch: str) -> list[ModelFacts]:
        """One ModelFacts per KV cache dtype, for `arch` (fp8 = its native e4m3 flavour)."""
        ws = set(self.layer_windows)
        window = next(iter(ws)) if len(ws) == 1 else 0
        out = []
        for kv in self.kv_dtypes:
            if kv == "auto":
                kv_dtype, scale = self.dtype, "none"
            elif kv.startswith("fp8"):
                kv_dtype = native_fp8_name(arch)
                scale = self.kv_scale_mode
            else:
                kv_dtype, scale = _DTYPES.get(kv, kv), "none"
            out.append(ModelFacts(self.num_q_heads, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                                  kv_dtype=kv_dtype, kv_scale_mode=scale, has_sinks=self.has_sinks, window=window,
                                  sink_tokens=self.sink_tokens, softcap=self.softcap, page_size=self.page_size,
                                  layer_windows=reduce_layer_windows(self.layer_windows)))
        return out

    def describe(self) -> str:
        ws = sorted(set(self.layer_windows))
        win = "full" if ws == [0] else ", ".join(f"{self.layer_windows.count(w)} layers {'full' if w == 0 else f'window {w}'}"
                                                  for w in ws)
        return (f"{self.name}: {self.num_q_heads} q / {self.num_kv_heads} kv heads, head dim {self.head_dim}, "
                f"{self.dtype}, kv {'/'.join(self.kv_dtypes)}, {'sinks, ' if self.has_sinks else ''}{win}, "
                f"page {self.page_size}" + (f", softcap {self.softcap}" if self.softcap else ""))


def from_hf_config(path: str | Path, **overrides) -> ModelSpec:
    """Read a Hugging Face config.json (a file or a model directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = json.loads(p.read_text())
    cfg = cfg.get("text_config", cfg) if "num_attention_heads" not in cfg else cfg
    try:
        hq = int(cfg["num_attention_heads"])
    except KeyError:
        raise PlanError(f"{p}: no num_attention_heads (not a decoder config?)") from None
    hk = int(cfg.get("num_key_value_heads") or hq)
    d = cfg.get("head_dim") or (int(cfg["hidden_size"]) // hq)
    dtype = _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
    n_layers = int(cfg.get("num_hidden_layers", 1))
    sw = cfg.get("sliding_window") or 0
    if cfg.get("use_sliding_window") is False:
        sw = 0
    types = cfg.get("layer_types")
    if types:
        windows = tuple(int(sw) if t == "sliding_attention" else 0 for t in types)
    else:
        windows = (int(sw),) * n_layers
    model_type = str(cfg.get("model_type", ""))
    spec = ModelSpec(
        num_q_heads=hq, num_kv_heads=hk, head_dim=int(d), dtype=dtype,
        has_sinks=model_type.startswith("gpt_oss") or bool(cfg.get("attention_sinks")),
        layer_windows=windows or (0,), softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        name=str(cfg.get("_name_or_path") or model_type or p.parent.name),
    )
    for k, v in overrides.items():
        if v is not None:
            setattr(spec, k, v)
    return spec


def parse_layer_windows(text: str, num_layers: int | None = None) -> tuple:
    """'0,128' -> (0, 128): a repeating per-layer pattern; 'W' -> every layer W."""
    ws = tuple(int(x) for x in text.split(",") if x.strip() != "")
    if not ws or any(w < 0 for w in ws):
        raise ValueError(f"layer windows {text!r}: comma-separated ints >= 0")
    if num_layers:
        ws = tuple(ws[i % len(ws)] for i in range(num_layers))
    return ws
