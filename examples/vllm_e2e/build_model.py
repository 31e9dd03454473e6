"""Builds a tiny LLaVA-style model with random weights, its own tokenizer
and processor, in a folder vLLM can serve. Nothing is downloaded.

    python build_model.py OUT_DIR [IMAGE_SIZE]

- text: a Llama of 2 layers, hidden size 128, 2 heads of 64 (vLLM's CPU
  attention wants a head size of 32 or more; tensor parallel 2 splits the
  heads);
- vision: a CLIP tower of 2 layers, hidden size 64, IMAGE_SIZE square
  images (default 64) in 16x16 patches ((IMAGE_SIZE/16)^2 image tokens per
  image: 16 at 64, 64 at 128). The processor's output, and so each cached
  item, grows with the square of IMAGE_SIZE (48 KiB of float32 pixels at
  64, 192 KiB at 128);
- tokenizer: word-level, trained with ``tokenizers`` on a made-up corpus,
  with ``<image>`` as a special token and a chat template.

The weights are random (seed 0): the model says nonsense, the same
nonsense for the same input, which is what a comparison of token ids
needs.
"""

import json
import random
import sys
from pathlib import Path

WORDS = (
    "a the cat dog bird tree house river sky cloud sun moon red blue green "
    "small big old new one two three picture image photo shows see there is "
    "are of in on with and what describe user assistant color shape left right"
).split()


def corpus(n=2000, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))


def build(out: Path, size: int = 64) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<pad>", "<s>", "</s>", "<image>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus(), trainers.WordLevelTrainer(special_tokens=specials))
    chat_template = (
        "{% for m in messages %}{{ m['role'] }}: "
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<image> "
        "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<image>"],
    )
    fast.chat_template = chat_template
    image_token_id = fast.convert_tokens_to_ids("<image>")

    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=size,
        patch_size=16,
        projection_dim=128,
    )
    text = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(size // 16) ** 2,
    )
    cfg.dtype = "float32"
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    _classic_vision_keys(out / "model.safetensors")

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=fast,
        patch_size=16,
        vision_feature_select_strategy="default",
        chat_template=chat_template,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out)
    fast.save_pretrained(out)
    (out / "BUILT").write_text(json.dumps({"image_token_id": image_token_id, "vocab": len(fast), "image_size": size}))
    print(f"model in {out}: vocab {len(fast)}, image token {image_token_id}")


def _classic_vision_keys(path: Path) -> None:
    """transformers 5 saves the CLIP tower as ``vision_tower.*``; vLLM's
    LLaVA loader (and transformers 4) expect ``vision_tower.vision_model.*``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {
        ("vision_tower.vision_model." + k[len("vision_tower.") :])
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
        else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, str(path), metadata={"format": "pt"})


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and int(sys.argv[2]) % 16):
        sys.exit(__doc__)
    build(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 64)
