"""A request's images -> its prompt ids and `MediaInput`s (docs/multimodal.md §5.1).

The chat template writes one `<|image|>` per image; `image_prompt` expands each, in order, into `<|image>`,
one `<|image|>` per soft token of that image, and `<image|>`, and records where each image's soft tokens lie,
with a hash of its patches (the prefix cache's key for those positions) and whether the model lets them see each
other both ways.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from gem4.config import VisionConfig
from gem4.engine.sequence import MediaInput
from gem4.media.image import ImagePatches


def image_prompt(ids: Sequence[int], vision: VisionConfig | None, images: Sequence[ImagePatches]
                 ) -> tuple[list[int], list[MediaInput]]:
    """ids with one image placeholder per image (in order) -> (the expanded ids, the images' MediaInputs)."""
    if not images:
        return list(ids), []
    if vision is None:
        raise ValueError("this model has no vision tower: it does not take images")
    where = [i for i, t in enumerate(ids) if t == vision.image_token_id]
    if len(where) != len(images):
        raise ValueError(f"the prompt has {len(where)} image placeholders for {len(images)} images")
    out: list[int] = []
    media: list[MediaInput] = []
    last = 0
    for i, image in zip(where, images):
        check_fits(image, vision)
        out += list(ids[last:i]) + [vision.boi_token_id]
        n = image.num_tokens
        media.append(MediaInput(len(out), n, "image", image, digest(image), vision.bidirectional))
        out += [vision.image_token_id] * n + [vision.eoi_token_id]
        last = i + 1
    return out + list(ids[last:]), media


def check_fits(image: ImagePatches, vision: VisionConfig) -> None:
    """ValueError when the image's patch grid is wider or taller than the tower's position table."""
    if max(image.grid) > vision.position_embedding_size:
        raise ValueError(f"an image of {image.grid[1]}x{image.grid[0]} patches is wider or taller than this "
                         f"tower's {vision.position_embedding_size} positions; use a smaller token budget")


def digest(image: ImagePatches) -> str:
    """A hash of what the tower reads: the patches and their grid."""
    h = hashlib.sha256(f"image {image.grid} {image.pooling}".encode())
    h.update(image.patches.tobytes())
    return h.hexdigest()
