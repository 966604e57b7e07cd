"""Video in (docs/multimodal.md §4): frames decoded with PyAV and chosen as transformers chooses them, each a
budget-70 image to the tower, the prompt written per frame with its `mm:ss` timestamp; the text model with a video
in its prompt within 1e-4 (float32) of `Gemma4ForConditionalGeneration` (its `pixel_values_videos` path) on tiny
random models of both tower flavours, greedy tokens equal to its generate()."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import gem4
from gem4.engine.media import media_prompt
from gem4.media.video import FRAMES, VideoError, decode, frame_indices
from gem4.model.gemma4 import MediaItem
from vision_fixtures import build_vision_hf, greedy_with_media

LOGIT_TOL = 1e-4          # relative to the largest |logit|


def make_clip(frames: int = 40, width: int = 64, height: int = 48, fps: int = 10, codec: str = "mpeg4",
              shift: int = 0, container: str = "mp4") -> bytes:
    """A small clip of coloured shapes moving over a gradient, encoded with PyAV (`shift` moves the shapes)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        y, x = np.mgrid[0:height, 0:width]
        for t in range(frames):
            img = np.zeros((height, width, 3), np.uint8)
            img[..., 0] = (x * 255 // width).astype(np.uint8)
            img[..., 2] = (y * 255 // height).astype(np.uint8)
            cx, cy = (5 + 2 * t + shift) % width, (10 + t + shift) % height
            img[(x - cx) ** 2 + (y - cy) ** 2 < 64] = (250, 220, 30)
            img[max(0, cy - 6):cy + 6, max(0, width - cx - 8):width - cx] = (30, 200, 90)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def tokenize(text: str) -> list[int]:
    """A stand-in tokenizer for the tiny model: one id per character, below the media ids."""
    return [100 + ord(c) % 200 for c in text]


# ---- decoding and the frame choice ----

def test_frames_are_chosen_as_transformers_and_clamped():
    assert frame_indices(40) == [i * 40 // 32 for i in range(32)]
    assert frame_indices(64)[:3] == [0, 2, 4] and len(frame_indices(1000)) == FRAMES
    assert frame_indices(5) == [0, 1, 2, 3, 4]          # transformers refuses fewer than 32 frames; gem4 takes all
    with pytest.raises(VideoError):
        frame_indices(0)


def test_decode_gives_frames_timestamps_and_budget_70():
    import av

    data = make_clip(frames=40, fps=10)
    video = decode(data, patch_size=16, pooling=3)
    assert video.total_frames == 40 and video.fps == 10.0 and len(video.frames) == 32
    chosen = [i * 40 // 32 for i in range(32)]
    assert [f.seconds for f in video.frames] == [i / 10 for i in chosen]
    assert video.frames[-1].timestamp == "00:03" and video.frames[0].timestamp == "00:00"
    # 64x48 at budget 70 -> 336x432 px: 7 x 9 = 63 tokens, the image rule
    assert all(f.patches.grid == (21, 27) and f.patches.num_tokens == 63 for f in video.frames)
    # the frames are the decoded ones (not one frame repeated): they differ as the shapes move
    assert not np.array_equal(video.frames[0].patches.patches, video.frames[-1].patches.patches)
    # decoded pixels are PyAV's: the first frame resized from the same RGB array
    with av.open(io.BytesIO(data)) as c:
        first = next(c.decode(video=0)).to_ndarray(format="rgb24")
    from gem4.media.video import preprocess_frame
    assert np.array_equal(preprocess_frame(first, patch_size=16, pooling=3).patches, video.frames[0].patches.patches)


def test_frames_resize_as_torchvision_calls_torch():
    """transformers' video processor resizes uint8 frames with torchvision's bicubic + antialias, which on the CPU is
    torch's native uint8 kernel (not Pillow's bicubic, not a float resize rounded back); a frame already at its
    budget's size is left as is."""
    from PIL import Image

    from gem4.media.video import preprocess_frame

    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    got = preprocess_frame(rgb, patch_size=16, pooling=3)
    t = torch.from_numpy(rgb).permute(2, 0, 1)[None]
    want = torch.nn.functional.interpolate(t, size=(336, 432), mode="bicubic", antialias=True)[0].permute(1, 2, 0)
    assert np.array_equal(got.patches.reshape(21, 27, 16, 16, 3).transpose(0, 2, 1, 3, 4).reshape(336, 432, 3),
                          want.numpy().astype(np.float32) / np.float32(255))
    pil = np.asarray(Image.fromarray(rgb).resize((432, 336), Image.Resampling.BICUBIC))
    assert not np.array_equal(pil, want.numpy())
    exact = rng.integers(0, 256, (336, 432, 3), dtype=np.uint8)
    same = preprocess_frame(exact, patch_size=16, pooling=3)
    assert np.array_equal(same.patches[0].reshape(16, 16, 3), exact[:16, :16].astype(np.float32) / np.float32(255))


def test_a_container_without_a_frame_count_is_counted():
    """Matroska/WebM headers do not state the frame count: the frames are counted by decoding, and the choice is
    the same as for the same frames in MP4 (whose header states it)."""
    import av

    mkv = make_clip(frames=40, fps=10, codec="libvpx", container="matroska")
    with av.open(io.BytesIO(mkv)) as c:
        assert c.streams.video[0].frames == 0
    video = decode(mkv, patch_size=16, pooling=3)
    assert video.total_frames == 40 and [f.seconds for f in video.frames] == [i * 40 // 32 / 10 for i in range(32)]
    with pytest.raises(VideoError, match="more than the 30") as e:
        decode(mkv, patch_size=16, pooling=3, max_frames=30)
    assert e.value.cause == "too_long"


def test_short_and_bad_videos():
    video = decode(make_clip(frames=5, fps=25), patch_size=16, pooling=3)
    assert len(video.frames) == 5 and [f.timestamp for f in video.frames] == ["00:00"] * 5
    with pytest.raises(VideoError, match="cannot be decoded") as e:
        decode(b"not a video at all", patch_size=16, pooling=3)
    assert e.value.cause == "undecodable"
    with pytest.raises(VideoError, match="more than the 10") as e:
        decode(make_clip(frames=20), patch_size=16, pooling=3, max_frames=10)
    assert e.value.cause == "too_long"


# ---- the text model with a video, against transformers ----

def hf_inputs(video, ids: list[int], video_token_id: int) -> dict:
    """transformers' inputs for a prompt with one video: pixel_values_videos as its video processor lays them out
    (each frame's patches padded to 70 x 9 with positions (-1, -1)), mm_token_type_ids 2 on the video tokens."""
    frames = [f.patches for f in video.frames]
    width = 70 * 9
    pixels = torch.zeros(len(frames), width, frames[0].patches.shape[1])
    positions = torch.full((len(frames), width, 2), -1, dtype=torch.long)
    for i, p in enumerate(frames):
        pixels[i, :p.patches.shape[0]] = torch.from_numpy(p.patches)
        positions[i, :p.patches.shape[0]] = torch.from_numpy(p.positions)
    t = torch.tensor([ids])
    return dict(input_ids=t, pixel_values_videos=pixels, video_position_ids=positions,
                num_frames_per_video=torch.tensor([len(frames)]), mm_token_type_ids=(t == video_token_id).long() * 2)


class Case:
    def __init__(self, flavour: str, root):
        self.hf = build_vision_hf(flavour)
        self.dir = root / flavour
        self.hf.save_pretrained(self.dir)
        self.model = gem4.load(self.dir, dtype="float32")
        vc = self.model.vision.config
        self.video = decode(make_clip(frames=40, fps=10), patch_size=16, pooling=3)
        template = [2, 10, 11, vc.video_token_id, 20, 21, 22]
        self.ids, self.inputs = media_prompt(template, [self.video], vision=vc, tokenize=tokenize)
        self.embeds = [self.model.vision.encode(m.data.patches, m.data.positions, m.data.grid) for m in self.inputs]
        with torch.no_grad():
            self.ref = self.hf(**self.hf_inputs()).logits[0]

    def expected_ids(self) -> list[int]:
        """transformers' processor's expansion, written out: `mm:ss <|image>` + n x `<|video|>` + `<image|>` per
        frame, joined by " "."""
        vc = self.model.vision.config
        text = " ".join(f"{f.timestamp} \x01" for f in self.video.frames)
        out = []
        for part in text.split("\x01")[:-1]:
            n = self.video.frames[0].patches.num_tokens
            out += tokenize(part) + [vc.boi_token_id] + [vc.video_token_id] * n + [vc.eoi_token_id]
        return [2, 10, 11] + out + [20, 21, 22]

    def hf_inputs(self) -> dict:
        return hf_inputs(self.video, self.ids, self.model.vision.config.video_token_id)

    def media(self, bidirectional=None) -> list[MediaItem]:
        bidi = self.model.vision.config.bidirectional if bidirectional is None else bidirectional
        return [MediaItem(m.start, e, bidi) for m, e in zip(self.inputs, self.embeds)]

    def error(self, logits: torch.Tensor) -> float:
        return float((logits - self.ref).abs().max() / self.ref.abs().max())


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    return {f: Case(f, root) for f in ("e2b", "31b")}


FLAVOURS = ["e2b", "31b"]


def test_prompt_is_the_processors_expansion(cases):
    c = cases["31b"]
    assert c.ids == c.expected_ids()
    vc = c.model.vision.config
    assert vc.video_token_id == 503
    assert len(c.inputs) == 32 and all(m.kind == "video" and m.num_tokens == 63 for m in c.inputs)
    assert all(c.ids[m.start - 1] == vc.boi_token_id and c.ids[m.end] == vc.eoi_token_id for m in c.inputs)
    assert len({m.digest for m in c.inputs}) == 32     # each frame its own content key


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_logits_with_a_video_match_transformers(cases, flavour):
    c = cases[flavour]
    err = c.error(c.model.logits(c.ids, c.media()))
    print(f"{flavour}: logits with a 32-frame video, max relative error {err:.1e}")
    assert err < LOGIT_TOL
    if c.model.vision.config.bidirectional:          # each frame its own block both ways: causal frames differ
        causal = c.error(c.model.logits(c.ids, c.media(bidirectional=False)))
        print(f"{flavour}: frames attended causally move the logits by {causal:.1e}")
        assert causal > 100 * LOGIT_TOL


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_greedy_tokens_equal_transformers_generate(cases, flavour):
    c = cases[flavour]
    steps = 5
    with torch.no_grad():
        want = c.hf.generate(**c.hf_inputs(), max_new_tokens=steps, do_sample=False)[0, len(c.ids):].tolist()
    assert greedy_with_media(c.model, c.ids, c.media(), steps) == want


def test_timestamps_tokenized_in_pieces_equal_the_whole_on_the_real_vocabulary():
    """media_prompt tokenizes each timestamp piece alone; on Gemma 4's real vocabulary (digits split one by one)
    that equals transformers' tokenizing the expanded text whole, whatever text precedes the video."""
    from gem4.tokenizer import Tokenizer
    from text_fixtures import vocab_gguf

    tok = Tokenizer.from_file(vocab_gguf())

    def enc(text):
        return tok.encode(text, add_bos=False, parse_special=True)

    block = "<|image><|video|><image|>"
    for before in ("<|turn>user\n", "Describe", "look: ", "12"):
        whole = enc(f"{before}00:00 {block} 00:01 {block} 01:59 {block}what")
        parts = (enc(before) + enc("00:00 ") + enc(block) + enc(" 00:01 ") + enc(block) + enc(" 01:59 ") + enc(block)
                 + enc("what"))
        assert whole == parts, before


# ---- through the engine (docs/multimodal.md §5.4) ----

def run(engine, ids, media, max_tokens=5):
    from gem4 import SamplingParams

    events = list(engine.submit(ids, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=True),
                                media=media))
    return [e.token_id for e in events], [e.logprob for e in events], events[-1].stats


def test_engine_with_a_video_equals_generate_and_hits_the_prefix_cache(cases):
    """Through the engine in prefill chunks of 100 (a chunk ends before a frame it cannot hold whole): the tokens
    transformers' generate() gives; a second question about the same video reuses the frames' K/V and answers as a
    cold run; another video behind the same placeholders hits only the text before it."""
    from gem4 import Engine

    c = cases["31b"]
    vc = c.model.vision.config
    video = decode(make_clip(frames=8, fps=4), patch_size=16, pooling=3)
    ids, media = media_prompt([2, 10, 11, vc.video_token_id, 20, 21], [video], vision=vc, tokenize=tokenize)
    engine = Engine(c.model, prefill_chunk=100, block_size=4)
    got, _, stats = run(engine, ids, media)
    with torch.no_grad():
        want = c.hf.generate(**hf_inputs(video, ids, vc.video_token_id), max_new_tokens=5,
                             do_sample=False)[0, len(ids):].tolist()
    assert got == want and stats.prompt_tokens == len(ids) and len(media) == 8

    ids2, media2 = media_prompt([2, 10, 11, vc.video_token_id, 30, 31, 32], [video], vision=vc, tokenize=tokenize)
    warm = run(engine, ids2, media2)
    cold = run(Engine(c.model, prefill_chunk=100, block_size=4, enable_prefix_caching=False), ids2, media2)
    assert warm[2].cached_tokens >= media2[-1].end and warm[0] == cold[0]
    assert warm[1] == pytest.approx(cold[1], rel=1e-5, abs=1e-6)

    other = decode(make_clip(frames=8, fps=4, shift=17), patch_size=16, pooling=3)
    ids3, media3 = media_prompt([2, 10, 11, vc.video_token_id, 30, 31, 32], [other], vision=vc, tokenize=tokenize)
    assert ids3 == ids2                               # the same ids: only the frames' content tells them apart
    miss = run(engine, ids3, media3)
    assert miss[2].cached_tokens <= media3[0].start
    assert miss[0] == run(Engine(c.model, prefill_chunk=100, block_size=4, enable_prefix_caching=False),
                          ids3, media3)[0]


def test_frames_equal_transformers_video_processor():
    """media/video.py's frames are transformers' `Gemma4VideoProcessor._preprocess` output, its class defaults
    (budget 70, 16 px patches, pooling 3, 1/255 then mean 0 / std 1), bit for bit: patches and positions of each of
    the 32 frames. Its one torchvision call, the uint8 bicubic + antialias resize, is stubbed by the torch kernel
    torchvision calls on the CPU (tests/torchvision_stub.py: torchvision has no wheel here)."""
    from gem4.media.video import frame_indices
    from test_unified_vision import decoded_frames
    from torchvision_stub import import_stubbed, stubbed_normalize

    P = import_stubbed("transformers.models.gemma4.video_processing_gemma4", "Gemma4VideoProcessor")
    data = make_clip(frames=40, width=80, height=44, fps=10)
    frames = decoded_frames(data, frame_indices(40))
    with stubbed_normalize():
        out = P._preprocess(object.__new__(P), [frames], do_resize=P.do_resize, resample=P.resample,
                            do_rescale=P.do_rescale, rescale_factor=1 / 255, do_normalize=P.do_normalize,
                            image_mean=tuple(P.image_mean), image_std=tuple(P.image_std), return_tensors="pt",
                            patch_size=P.patch_size, max_soft_tokens=P.max_soft_tokens,
                            pooling_kernel_size=P.pooling_kernel_size)
    video = decode(data, patch_size=P.patch_size, pooling=P.pooling_kernel_size)
    assert len(video.frames) == out["pixel_values_videos"].shape[0] == 32
    assert video.frames[0].patches.num_tokens == out["num_soft_tokens_per_video"][0]
    for i, frame in enumerate(video.frames):
        n = frame.patches.patches.shape[0]
        assert np.array_equal(frame.patches.patches, out["pixel_values_videos"][i][:n].numpy())
        assert np.array_equal(frame.patches.positions, out["video_position_ids"][i][:n].numpy())
        assert (out["video_position_ids"][i][n:] == -1).all()                      # the rest is padding
