"""The requests every configuration gets (offline and through HTTP): made-
up square images (E2E_IMAGE_SIZE, default 64: the model's own size),
seeded, so every run sees the same pixels."""

import base64
import io
import os

# E2E_IMAGES: distinct images per pass (default 12); with more, a pass has
# as many prompts as it takes to show each image twice (two per prompt).
N_IMAGES = int(os.environ.get("E2E_IMAGES", "12"))
PER_PASS = max(20, N_IMAGES)
SIZE = int(os.environ.get("E2E_IMAGE_SIZE", "64"))
PROMPT = "user: <image> <image> what is in the picture\nassistant:"
SINGLE_PROMPT = "user: <image> describe the image\nassistant:"


def image(i: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1000 + i)
    return Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


def pass_pairs():
    """(first image, second image) of each prompt of a pass: 40 items over
    12 images by default."""
    return [(i % N_IMAGES, (3 * i + 1) % N_IMAGES) for i in range(PER_PASS)]


def pass_requests():
    return [
        {"prompt": PROMPT, "multi_modal_data": {"image": [image(a), image(b)]}}
        for a, b in pass_pairs()
    ]


def single_request(i: int):
    # Images not in any pass: each single request is a miss, then a put.
    return {"prompt": SINGLE_PROMPT, "multi_modal_data": {"image": image(100 + i)}}


def data_url(i: int) -> str:
    buf = io.BytesIO()
    image(i).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
