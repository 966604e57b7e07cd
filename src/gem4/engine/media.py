"""A request's images and audio clips -> its prompt ids and `MediaInput`s (docs/multimodal.md §5.1).

The chat template writes one `<|image|>` per image and one `<|audio|>` per clip; `media_prompt` expands each, in
order, into its opening token, one placeholder per soft token of that item, and its closing token (`<|image>` ...
`<image|>`, `<|audio>` ... `<audio|>`, the ids the checkpoint's config names), and records where each item's soft
tokens lie, with a hash of its content (the prefix cache's key for those positions) and whether the model lets
them see each other both ways (images on "vision" configs; audio never). A video's one `<|video|>` becomes its
frames, each written as an image with `<|video|>` placeholders and its `mm:ss` timestamp before it (§4.2).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from gem4.config import AudioConfig, FrameAudioConfig, VisionConfig
from gem4.engine.sequence import MediaInput
from gem4.media import audio as media_audio
from gem4.media.image import ImagePatches
from gem4.media.video import Video

Item = ImagePatches | np.ndarray | Video  # an image preprocessed, a 16 kHz mono waveform (media/audio.py), a video's
                                          # frames (media/video.py)


def image_prompt(ids: Sequence[int], vision: VisionConfig | None, images: Sequence[ImagePatches]
                 ) -> tuple[list[int], list[MediaInput]]:
    """ids with one image placeholder per image (in order) -> (the expanded ids, the images' MediaInputs)."""
    return media_prompt(ids, images, vision=vision)


def media_prompt(ids: Sequence[int], items: Sequence[Item], *, vision: VisionConfig | None = None,
                 audio: AudioConfig | FrameAudioConfig | None = None,
                 tokenize: Callable[[str], list[int]] | None = None) -> tuple[list[int], list[MediaInput]]:
    """ids with one placeholder per media item, in the items' order (an image's `<|image|>`, a clip's
    `<|audio|>`, a video's `<|video|>`) -> (the expanded ids, the items' MediaInputs: one per video frame).
    `tokenize` (text -> ids, no special tokens) writes a video's frame timestamps. ValueError when the model has no
    tower for an item's kind or the placeholders do not match the items one for one."""
    if not items:
        return list(ids), []
    kinds = [kind_of(item) for item in items]
    for kind, config in (("image", vision), ("audio", audio), ("video", vision)):
        if kind in kinds and config is None:
            raise ValueError(f"this model has no {'audio' if kind == 'audio' else 'vision'} tower: it does not "
                             f"take {kind}s")
    if "video" in kinds and (vision.video_token_id is None or tokenize is None):
        raise ValueError("this model does not take videos" if vision.video_token_id is None
                         else "a video's timestamps need the model's tokenizer")
    placeholder = {}
    if vision is not None:
        placeholder[vision.image_token_id] = "image"
        if vision.video_token_id is not None:
            placeholder[vision.video_token_id] = "video"
    if audio is not None:
        placeholder[audio.audio_token_id] = "audio"
    where = [(i, placeholder[t]) for i, t in enumerate(ids) if t in placeholder]
    for kind in ("image", "audio", "video"):
        have, want = sum(k == kind for _, k in where), kinds.count(kind)
        if have != want:
            raise ValueError(f"the prompt has {have} {kind} placeholders for {want} {kind}s")
    out: list[int] = []
    media: list[MediaInput] = []
    last = 0
    for (i, kind), item in zip(where, items):
        if kind != kind_of(item):
            raise ValueError(f"the prompt's {kind} placeholder at {i} stands where the request has {kind_of(item)}")
        out += list(ids[last:i])
        if kind == "video":
            out += video_ids(item, vision, tokenize, len(out), media)
            last = i + 1
            continue
        if kind == "image":
            check_fits(item, vision)
            open_id, token_id, close_id, n = vision.boi_token_id, vision.image_token_id, vision.eoi_token_id, \
                item.num_tokens
            media.append(MediaInput(len(out) + 1, n, "image", item, digest(item), vision.bidirectional))
        else:
            open_id, token_id, close_id, n = audio.boa_token_id, audio.audio_token_id, audio.eoa_token_id, \
                audio_tokens(audio, item)
            media.append(MediaInput(len(out) + 1, n, "audio", item, audio_digest(item), False))
        out += [open_id] + [token_id] * n + [close_id]
        last = i + 1
    return out + list(ids[last:]), media


def video_ids(video: Video, vision: VisionConfig, tokenize: Callable[[str], list[int]], start: int,
              media: list[MediaInput]) -> list[int]:
    """A video's prompt ids (docs/multimodal.md §4.2): per frame `mm:ss <|image>` + n x `<|video|>` + `<image|>`,
    the frames joined by " "; each frame's MediaInput (its own block, as an image) appended to `media`, its soft
    tokens placed from `start` on."""
    out: list[int] = []
    for k, frame in enumerate(video.frames):
        check_fits(frame.patches, vision)
        out += tokenize((" " if k else "") + frame.timestamp + " ")
        out.append(vision.boi_token_id)
        n = frame.patches.num_tokens
        media.append(MediaInput(start + len(out), n, "video", frame.patches, digest(frame.patches),
                                vision.bidirectional))
        out += [vision.video_token_id] * n + [vision.eoi_token_id]
    return out


def kind_of(item: Item) -> str:
    if isinstance(item, ImagePatches):
        return "image"
    if isinstance(item, np.ndarray):
        return "audio"
    if isinstance(item, Video):
        return "video"
    raise TypeError(f"a media item must be ImagePatches, a waveform array or a Video, got {type(item).__name__}")


def audio_tokens(audio: AudioConfig | FrameAudioConfig, waveform: np.ndarray) -> int:
    """A clip's soft tokens (docs/multimodal.md §3.2, §3.4): 25 a second; the conformer's at most 750 (30 s)."""
    if waveform.ndim != 1:
        raise ValueError(f"an audio clip must be a mono waveform [samples], got shape {waveform.shape}")
    n = waveform.shape[0]
    tokens = (media_audio.frame_tokens(n, audio.samples_per_token) if isinstance(audio, FrameAudioConfig)
              else media_audio.num_soft_tokens(n))
    if tokens < 1:
        raise ValueError(f"an audio clip of {n} samples is too short for one soft token")
    return tokens


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


def audio_digest(waveform: np.ndarray) -> str:
    """A hash of what the tower reads: the 16 kHz samples (float32)."""
    wave = np.ascontiguousarray(waveform, dtype=np.float32)
    h = hashlib.sha256(f"audio {wave.shape[0]}".encode())
    h.update(wave.tobytes())
    return h.hexdigest()
