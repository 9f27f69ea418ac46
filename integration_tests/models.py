"""Tiny random-weight models and a WordLevel tokenizer, built at test time (no downloads)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 259  # w0..w255, <unk>, <s>, </s>


def _tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(256)} | {"<unk>": 256, "<s>": 257, "</s>": 258}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(d)


def build_llama(d: Path, heads: tuple[int, int] = (4, 2), head_dim: int = 32, max_len: int = 512) -> Path:
    """Llama-like: hidden 64, 2 layers, 4 q / 2 kv heads (GQA 2), head_dim 32 (the GPU suite: a
    GPU head size and a long context)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d.mkdir(parents=True, exist_ok=True)
    _tokenizer(d)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=head_dim,
                      max_position_embeddings=max_len, bos_token_id=257, eos_token_id=258, initializer_range=0.2,
                      torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def build_gptoss(d: Path, heads: tuple[int, int] = (8, 2), head_dim: int = 32, window: int = 32,
                 max_len: int = 512, top_k: int = 2) -> Path:
    """gpt-oss-like: sinks, sliding window on alternate layers (window 32 < the prompts), GQA 4,
    4 experts (top 2), head_dim 32."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    d.mkdir(parents=True, exist_ok=True)
    _tokenizer(d)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=head_dim,
                       num_local_experts=4, num_experts_per_tok=top_k, sliding_window=window,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=max_len, bos_token_id=257, eos_token_id=258, pad_token_id=258,
                       rope_scaling=None, initializer_range=0.2, torch_dtype="float32")
    torch.manual_seed(0)
    m = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)  # randn sinks (never zeros)
    m.save_pretrained(d)
    return d


def build_gemma2(d: Path, heads: tuple[int, int] = (4, 2), head_dim: int = 256, window: int = 256,
                 max_len: int = 512) -> Path:
    """Gemma-2-like: attention logit soft-cap 50 and final logit soft-cap 30, sliding window on
    alternate layers, GQA 2, head_dim 256."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    d.mkdir(parents=True, exist_ok=True)
    _tokenizer(d)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=head_dim,
                       sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=head_dim,
                       max_position_embeddings=max_len, bos_token_id=257, eos_token_id=258, pad_token_id=258,
                       initializer_range=0.2, torch_dtype="float32")
    torch.manual_seed(0)
    Gemma2ForCausalLM(cfg).save_pretrained(d)
    return d


# The GPU suite's models: head sizes the compiled kernels serve (d 128 / 64 / 256), gpt-oss's
# window of 128, contexts past 32k.
GPU_MAX_LEN = 40960
GPU_BUILDERS = {
    "llama": lambda d: build_llama(d, heads=(8, 2), head_dim=128, max_len=GPU_MAX_LEN),
    # every expert routed (top 4 of 4): a backend's last-bit differences move the routing weights a
    # little instead of flipping a top-2 choice, which changes a random-weight model's output
    # wholesale (vLLM's own two backends differed by 0.49 in logprob with top 2)
    "gptoss": lambda d: build_gptoss(d, heads=(16, 2), head_dim=64, window=128, max_len=GPU_MAX_LEN, top_k=4),
    "gemma2": lambda d: build_gemma2(d, heads=(4, 2), head_dim=256, window=512, max_len=GPU_MAX_LEN),
}
