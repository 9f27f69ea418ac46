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


def build_llama(d: Path) -> Path:
    """Llama-like: hidden 64, 2 layers, 4 q / 2 kv heads (GQA 2), head_dim 32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d.mkdir(parents=True, exist_ok=True)
    _tokenizer(d)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      bos_token_id=257, eos_token_id=258, initializer_range=0.2, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def build_gptoss(d: Path) -> Path:
    """gpt-oss-like: sinks, sliding window on alternate layers (window 32 < the prompts), GQA 4,
    4 experts (top 2), head_dim 32."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    d.mkdir(parents=True, exist_ok=True)
    _tokenizer(d)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=512, bos_token_id=257, eos_token_id=258, pad_token_id=258,
                       rope_scaling=None, initializer_range=0.2, torch_dtype="float32")
    torch.manual_seed(0)
    m = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)  # randn sinks (never zeros)
    m.save_pretrained(d)
    return d
