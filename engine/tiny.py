"""Tiny random-initialised Llama / Qwen2 / Mistral models with a character-level tokenizer.

Built in-process (no download), seeded, with a ChatML chat template like SmolLM2's: real
transformers model code at a size where a test forward takes milliseconds. ``--model tiny:llama``
uses them from the command line too (fast demos, screenshots, CI smoke tests); their text is
random characters, but every cache behaviour is the real one.
"""
from __future__ import annotations

import string

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .errors import EngineError

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer():
    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
        bos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny(kind: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2, max_positions: int = 4096,
               sliding_window: int | None = None):
    """Return (model, tokenizer) for kind in {"llama", "qwen2", "mistral"}.

    ``sliding_window`` (mistral, qwen2) makes attention windowed: every Mistral layer, and every
    Qwen2 layer but the first (a mix of full and sliding layers, as real Qwen2 configs have)."""
    tok = build_tokenizer()
    common = dict(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    configs = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }
    if kind not in configs:
        raise EngineError(f"unknown tiny model {kind!r} (tiny:llama, tiny:qwen2, tiny:mistral)")
    cfg_cls, model_cls = configs[kind]
    if sliding_window is not None and kind == "llama":
        raise EngineError("tiny:llama has no sliding window (use mistral or qwen2)")
    if kind == "mistral":
        common["sliding_window"] = sliding_window
    elif kind == "qwen2" and sliding_window is not None:
        common.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
    cfg = cfg_cls(**common)
    cfg._attn_implementation = "sdpa"
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = model_cls(cfg)
        # Larger-than-default init so greedy text is not one repeated token.
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.25)
    model.eval()
    return model, tok
