#!/usr/bin/env python3
"""Build a tiny random-weight Qwen2-VL checkpoint fully offline.

Output: argv[1] (a directory); the test images go to its imgs/
  - config.json / model.safetensors  (Qwen2VLForConditionalGeneration, fp32, seed 0)
  - tokenizer.json / tokenizer_config.json  (small byte-level BPE trained here,
    plus the Qwen2 / Qwen2-VL special tokens)
  - preprocessor_config.json (Qwen2VLImageProcessor, small max_pixels)
  - chat_template (Qwen2-VL's)
Nothing is downloaded.
"""
import os
import sys
import shutil

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, Regex
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
)
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

OUT = sys.argv[1]

# Qwen2 special tokens, in Qwen2's order (real ids are 151643..151656; here
# they follow the small BPE vocab).
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
BPE_VOCAB = 480          # byte alphabet (256) + merges
VOCAB_SIZE = None        # set to len(tokenizer) (no unreachable ids)

# Qwen2-VL chat template (as shipped with Qwen/Qwen2-VL-*-Instruct).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "You are a helpful assistant.",
    "Describe this image. What is in the picture? The image shows a red square on a blue background.",
    "system user assistant Hello, how are you? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > | _ ! ? , . : ;",
    "Picture Video frame color shape circle triangle green yellow white black left right top bottom",
] * 50


def build_tokenizer():
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    # Qwen2's pre-tokenizer: split regex + byte level
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(
            Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            behavior="isolated",
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    return hf


def main():
    torch.manual_seed(0)
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)

    tokenizer = build_tokenizer()
    global VOCAB_SIZE
    VOCAB_SIZE = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    assert max(ids.values()) < VOCAB_SIZE, ids
    print("special ids:", ids)

    image_processor = Qwen2VLImageProcessor(
        min_pixels=56 * 56,          # >= 4 patches of 28x28 after merge
        max_pixels=112 * 112,        # <= 64 patches -> <= 16 image tokens
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
        chat_template=CHAT_TEMPLATE,
    )

    hidden, heads, kv_heads = 128, 4, 2
    head_dim = hidden // heads  # 32 -> mrope_section sums to 16
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [4, 6, 6]},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=64,
            hidden_size=hidden,   # merger output dim == LM hidden size
            mlp_ratio=2,
            num_heads=4,
            in_channels=3,
            in_chans=3,            # key present in the real Qwen2-VL hub configs; SGLang reads it
            spatial_patch_size=14, # likewise (hub config key)
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    # default init gives tiny std; widen it a bit so greedy outputs vary with the image
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.config.dtype = "float32"
    model.save_pretrained(OUT, safe_serialization=True)
    processor.save_pretrained(OUT)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {OUT}: {n/1e6:.2f}M params")
    print(sorted(os.listdir(OUT)))
    make_images(os.path.join(OUT, "imgs"))


def make_images(d, n=4):
    """Random-noise PNGs (84x112 -> 6x8 patches -> 12 image tokens) for the probes."""
    import numpy as np
    from PIL import Image

    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        a = rng.integers(0, 256, size=(84, 112, 3), dtype=np.uint8)
        Image.fromarray(a).save(os.path.join(d, f"img{i}.png"))
    print("images in", d)


if __name__ == "__main__":
    main()
