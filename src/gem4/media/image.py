"""An image -> the vision tower's input: patches in [0, 1] with their (x, y) grid positions (docs/multimodal.md §2).

The same pixels as transformers' Gemma 4 PIL image processor (`Gemma4ImageProcessorPil`), bit for bit:
- decode with Pillow; turn by the EXIF orientation; composite transparency onto white; RGB. (transformers'
  `load_image` turns by EXIF but drops alpha, its processor composites on white but ignores EXIF: gem4 does
  both, the way a viewer shows the picture.)
- resize to the budget's size (`target_size`): the image is always rescaled to fill the budget -- small images
  are upscaled -- with both sides multiples of patch x pooling (48 px), by Pillow's bicubic on the uint8 image,
  and only when the size changes.
- rescale by 1/255 (no mean/std: the tower maps [0, 1] to [-1, 1] itself).
- patchify row-major over the (rows, cols) grid of 16 px patches; each patch vector is (row in patch,
  column in patch, channel), channel fastest; position (x, y) = (column, row).
transformers pads the patches to budget x 9 with positions (-1, -1); gem4 does not (padding is masked out of
everything, so it only costs work).

The 12B ("unified") has no PIL processor: transformers' `Gemma4UnifiedImageProcessor` resizes with torchvision
(`resize(bicubic, antialias=True)` on the uint8 image: torch's native uint8 kernel on the CPU, which gem4 calls, as
media/video.py does for frames), rescales by `uint8 * (1/255)` in float32, and cuts 16 px patches that it merges
3 x 3 into 48 px ones -- the same vectors as cutting 48 px patches directly (row, column, channel), at the
48 px grid's positions. `preprocess(..., processor="torchvision", patch_size=48, pooling=1)` does that; the size
rule is the same (`target_size(h, w, B, 48, 1)` equals `target_size(h, w, B, 16, 3)`).

A budget is a most number of soft tokens, one per pooling x pooling patches (48 x 48 px); the number an image
gets depends on its aspect ratio and is at most the budget (`ImagePatches.num_tokens`).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

BUDGETS = (70, 140, 280, 560, 1120)     # the soft-token budgets the model was trained with
DEFAULT_BUDGET = 280                    # transformers' and the released processor_config.json's default
PROCESSORS = ("pil", "torchvision")     # which transformers image processor's resize and rescale to follow
MAX_PIXELS = 64 * 2**20                 # the most pixels a decoded image may have (a decompression bomb guard:
                                        # a few KB of PNG can claim gigapixels)


class ImageError(ValueError):
    """The image cannot be used: undecodable, too large, or a budget the model does not take."""


@dataclass(frozen=True)
class ImagePatches:
    """One image as the tower reads it."""

    patches: np.ndarray       # [n, patch * patch * 3] float32 in [0, 1], row-major over the grid
    positions: np.ndarray     # [n, 2] int64: (x, y) = (column, row) of each patch
    grid: tuple[int, int]     # (rows, cols) of patches
    pooling: int              # patches per soft token along each side

    @property
    def num_tokens(self) -> int:
        return self.patches.shape[0] // self.pooling ** 2


def target_size(height: int, width: int, budget: int, patch_size: int, pooling: int) -> tuple[int, int]:
    """The (height, width) an image of that size is resized to for a budget of `budget` soft tokens: the largest
    size with the image's aspect ratio whose sides are multiples of patch_size * pooling and which holds at most
    budget * pooling^2 patches (transformers' `get_aspect_ratio_preserving_size`, its edge cases included)."""
    if budget not in BUDGETS:
        raise ImageError(f"the image token budget must be one of {BUDGETS}, got {budget!r}")
    if height < 1 or width < 1:
        raise ImageError(f"an image of {width}x{height} pixels has no pixels")
    max_patches = budget * pooling ** 2
    target_px = max_patches * patch_size ** 2
    factor = math.sqrt(target_px / (height * width))
    side = pooling * patch_size
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ImageError(f"an image of {width}x{height} pixels cannot be resized to a budget of {budget} tokens")
    longest = budget * side
    if th == 0:                         # very wide: one row of tokens
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:                       # very tall: one column
        tw, th = side, min(int(math.floor(height / width)) * side, longest)
    if th * tw > target_px:
        raise ImageError(f"an image of {width}x{height} pixels would take more than {budget} tokens")
    return th, tw


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Image file bytes (any format Pillow reads) -> an RGB image, turned by its EXIF orientation, transparency
    composited onto white."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_pixels:
            raise ImageError(f"the image has {image.width}x{image.height} pixels, more than the {max_pixels} allowed")
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"the image cannot be decoded ({e})") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """EXIF orientation applied, transparency composited onto white, RGB (transformers' `convert_to_rgb`)."""
    image = ImageOps.exif_transpose(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, budget: int = DEFAULT_BUDGET, *, patch_size: int, pooling: int,
               processor: str = "pil") -> ImagePatches:
    """An image (any mode: `to_rgb` is applied) -> its patches for a budget of `budget` soft tokens. `patch_size`,
    `pooling` and `processor` are the checkpoint's (VisionConfig, UnifiedVisionConfig): "pil" resizes with
    Pillow's bicubic and rescales in float64 (transformers' PIL processor), "torchvision" with torch's uint8
    bicubic + antialias and rescales in float32 (its torchvision processors; the 12B has no other)."""
    if processor not in PROCESSORS:
        raise ValueError(f"processor must be one of {PROCESSORS}, got {processor!r}")
    image = to_rgb(image)
    th, tw = target_size(image.height, image.width, budget, patch_size, pooling)
    if processor == "torchvision":
        resized = resize_uint8(np.array(image), th, tw)                                     # [3, th, tw] uint8
        return patchify((resized * (1 / 255)).permute(1, 2, 0).numpy(), patch_size, pooling)
    if (image.height, image.width) != (th, tw):
        image = image.resize((tw, th), resample=Image.Resampling.BICUBIC)
    pixels = (np.asarray(image).astype(np.float64) * (1 / 255)).astype(np.float32)     # [th, tw, 3]
    return patchify(pixels, patch_size, pooling)


def resize_uint8(rgb: np.ndarray, th: int, tw: int) -> torch.Tensor:
    """RGB uint8 [h, w, 3] -> [3, th, tw] uint8 as torchvision's `resize(bicubic, antialias=True)` makes it on the
    CPU: it hands a uint8 tensor to torch's native uint8 bicubic+antialias kernel as is (unchanged when the size
    is)."""
    pixels = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]        # [1, 3, h, w] uint8
    if pixels.shape[-2:] != (th, tw):
        pixels = torch.nn.functional.interpolate(pixels, size=(th, tw), mode="bicubic", align_corners=False,
                                                 antialias=True)                   # uint8 in, uint8 out
    return pixels[0]


def patchify(pixels: np.ndarray, patch_size: int, pooling: int) -> ImagePatches:
    """Pixels [h, w, 3] float32 in [0, 1], both sides multiples of patch_size -> the tower's patches, row-major
    (images here; video frames in video.py)."""
    th, tw = pixels.shape[:2]
    rows, cols = th // patch_size, tw // patch_size
    patches = (pixels.reshape(rows, patch_size, cols, patch_size, 3)
               .transpose(0, 2, 1, 3, 4).reshape(rows * cols, patch_size * patch_size * 3))
    x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    positions = np.stack([x, y], axis=-1).reshape(rows * cols, 2).astype(np.int64)
    return ImagePatches(np.ascontiguousarray(patches), positions, (rows, cols), pooling)
