"""A video file -> up to 32 frames, each the vision tower's input at a budget of 70 tokens, with its timestamp
(docs/multimodal.md §4).

What transformers' Gemma 4 video processor (`Gemma4VideoProcessor`, its default PyAV backend) computes:
- decode with PyAV (FFmpeg, bundled in its wheel): the first video stream, the chosen frames as RGB uint8.
- choose `FRAMES` frames uniformly: indices `arange(32) * total // 32`. transformers refuses a video of fewer
  than 32 frames; gem4 takes every frame of such a video (indices 0 .. total - 1) instead.
- fps from the stream's `average_rate` (24 when the container does not say); a frame's time is index / fps,
  written `mm:ss` (whole seconds, rounded down) in the prompt.
- each frame resized to the image rule's size for budget 70 (`image.target_size`) with torchvision's resize as
  transformers calls it (`tvF.resize(bicubic, antialias=True)` on the uint8 frames): on the CPU torchvision 0.28
  and 0.29 hand a uint8 tensor to `torch.nn.functional.interpolate(mode="bicubic", antialias=True)` as is (torch's
  native uint8 kernel), and so does gem4 -- not a float32 resize rounded back, which differs by up to 21 levels
  on a sharp upscale. Images go through Pillow's bicubic instead, as transformers' PIL image processor; a frame
  is not resized by Pillow because transformers' video processor does not.
- rescaled by 1/255 in float32 (transformers folds the 1/255 into a mean 0 / std 255 normalisation), patchified
  as an image (`image.patchify`).
No audio track is read.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from gem4.media.image import ImagePatches, patchify, resize_uint8, target_size

FRAMES = 32                 # the most frames a video gives (transformers' num_frames)
BUDGET = 70                 # soft tokens per frame (transformers' video max_soft_tokens)
DEFAULT_FPS = 24.0          # when the stream has no average rate (transformers' fallback)
MAX_FRAMES = 36_000         # the most frames a file may have (20 minutes at 30 fps): frames are decoded in turn to
                            # reach the chosen ones, so a longer file is refused before it is decoded
MAX_PIXELS = 16 * 2**20     # the most pixels a frame may have


class VideoError(ValueError):
    """The video cannot be used; `cause` is "undecodable" or "too_long"."""

    def __init__(self, message: str, cause: str = "undecodable"):
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class Frame:
    """One chosen frame as the tower reads it, and when it is shown."""

    patches: ImagePatches
    seconds: float

    @property
    def timestamp(self) -> str:
        """`mm:ss` as the prompt writes it (transformers' format)."""
        return f"{int(self.seconds // 60):02d}:{int(self.seconds % 60):02d}"


@dataclass(frozen=True)
class Video:
    """A video's chosen frames, in order."""

    frames: tuple[Frame, ...]
    fps: float
    total_frames: int


def frame_indices(total: int, frames: int = FRAMES) -> list[int]:
    """The frames chosen from `total`: `arange(frames) * total // frames` (transformers' uniform choice); every
    frame when there are fewer."""
    if total < 1:
        raise VideoError("the video has no frames")
    if total < frames:
        return list(range(total))
    return [i * total // frames for i in range(frames)]


def decode(data: bytes, *, patch_size: int, pooling: int, max_frames: int = MAX_FRAMES) -> Video:
    """Video file bytes (any container and codec PyAV's FFmpeg reads) -> its chosen frames preprocessed.
    `patch_size` and `pooling` are the checkpoint's (VisionConfig).

    The frame count is the stream header's (`stream.frames`, what transformers' PyAV reader takes); a container
    that does not state it (WebM, Matroska) is decoded once to count. Only the chosen frames are kept, each
    preprocessed as it is decoded, so memory stays at 32 budget-70 frames whatever the file; a chosen index past
    the frames actually decoded (a header that overstates) is dropped, as transformers drops it."""
    import av                                        # only a request with a video pays for importing FFmpeg

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = first_stream(container)
            total = stream.frames
            if total <= 0:
                total = 0
                for _ in container.decode(stream):
                    total += 1
                    if total > max_frames:
                        break
        if total > max_frames:
            raise VideoError(f"the video has more than the {max_frames} frames allowed", "too_long")
        chosen = frame_indices(total)
        wanted, frames = set(chosen), {}
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = first_stream(container)
            fps = float(stream.average_rate) if stream.average_rate else DEFAULT_FPS
            for i, frame in enumerate(container.decode(stream)):
                if i > chosen[-1]:
                    break
                if i in wanted:
                    frames[i] = preprocess_frame(frame.to_ndarray(format="rgb24"), patch_size=patch_size,
                                                 pooling=pooling)
    except VideoError:
        raise
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as e:
        raise VideoError(f"the video cannot be decoded ({e})") from None
    if not frames:
        raise VideoError("the video has no frames that decode")
    return Video(tuple(Frame(frames[i], i / fps) for i in chosen if i in frames), fps, total)


def first_stream(container):
    """The container's first video stream; VideoError without one or with frames too large."""
    if not container.streams.video:
        raise VideoError("the file has no video stream")
    stream = container.streams.video[0]
    if stream.width * stream.height > MAX_PIXELS:
        raise VideoError(f"the video's frames have {stream.width}x{stream.height} pixels, more than the "
                         f"{MAX_PIXELS} allowed")
    return stream


def preprocess_frame(rgb: np.ndarray, budget: int = BUDGET, *, patch_size: int, pooling: int) -> ImagePatches:
    """One RGB uint8 frame [h, w, 3] -> its patches at `budget` (module docstring: torchvision's bicubic)."""
    h, w = rgb.shape[:2]
    th, tw = target_size(h, w, budget, patch_size, pooling)
    frame = resize_uint8(rgb, th, tw)                                                   # [3, th, tw] uint8
    pixels = (frame.permute(1, 2, 0).float() / 255.0).numpy()                           # [th, tw, 3] float32
    return patchify(pixels, patch_size, pooling)
