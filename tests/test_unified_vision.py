"""The 12B ("unified", encoder-free) vision path (docs/multimodal.md §2.5) against transformers 5.23.0's
`Gemma4UnifiedForConditionalGeneration` on a tiny random model built at test time: 48 px patches bit-exact with
its image processor, image soft tokens within 1e-5 of `get_image_features`, the logits of a prompt with two
images and an audio clip within 1e-4 relative of its forward pass under `create_masks_for_generate`'s masks (image
tokens both ways on sliding layers only, as llama.cpp), greedy tokens equal to `generate()` with a static cache --
the one way `generate()` builds those masks: with its default dynamic cache it calls `forward()`, whose 12B mask
is bidirectional on every layer. The 12B's pitfalls are made on purpose and must move the result."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import gem4
from gem4.engine.media import media_prompt
from gem4.kv_cache import KVPool
from gem4.media.image import BUDGETS, preprocess, target_size
from gem4.model import unified_vision
from gem4.model.audio import encode_audio
from gem4.model.gemma4 import MediaItem
from gem4.weights.checkpoint import CheckpointError
from torchvision_stub import import_stubbed, stubbed_normalize
from unified_fixtures import build_unified_hf, clip
from vision_fixtures import greedy_with_media, sample_image

EMBED_TOL = 1e-5
LOGIT_TOL = 1e-4          # relative to the largest |logit|
SIZES = [(96, 144), (120, 100)]   # (height, width) of the prompt's two images; at budget 70: 60 and 63 tokens
BUDGET = 70


@pytest.fixture(scope="module")
def hf_pixels():
    """images, budget -> transformers' `Gemma4UnifiedImageProcessor` output (pixel_values padded to the budget,
    image_position_ids, num_soft_tokens_per_image), its torchvision resize stubbed (tests/torchvision_stub.py)."""
    from transformers.image_utils import PILImageResampling

    Gemma4UnifiedImageProcessor = import_stubbed(
        "transformers.models.gemma4_unified.image_processing_gemma4_unified", "Gemma4UnifiedImageProcessor")
    processor = object.__new__(Gemma4UnifiedImageProcessor)

    def run(images, budget: int) -> dict:
        tensors = [torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1) for img in images]
        return Gemma4UnifiedImageProcessor._preprocess(
            processor, tensors, do_resize=True, resample=PILImageResampling.BICUBIC, do_rescale=True,
            rescale_factor=1 / 255, do_normalize=False, image_mean=None, image_std=None, return_tensors="pt",
            patch_size=16, max_soft_tokens=budget, pooling_kernel_size=3)

    return run


# ---- preprocessing ----

@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("size", [(224, 224), (100, 150), (270, 480), (20, 2000), (480, 336), (7, 5)])
def test_patches_equal_transformers_unified_processor(hf_pixels, size, budget):
    img = sample_image(*size, seed=size[0] + budget)
    out = hf_pixels([img], budget)
    mine = preprocess(img, budget, patch_size=48, pooling=1, processor="torchvision")
    n = mine.patches.shape[0]
    assert mine.num_tokens == n == out["num_soft_tokens_per_image"][0] <= budget
    assert mine.patches.shape[1] == 48 * 48 * 3
    assert np.array_equal(mine.patches, out["pixel_values"][0][:n].numpy())          # bit for bit
    assert np.array_equal(mine.positions, out["image_position_ids"][0][:n].numpy())
    assert (out["image_position_ids"][0][n:] == -1).all()


def test_the_size_rule_is_the_towers_at_48_px():
    """One 48 px patch per token with no pooling sizes an image as 16 px patches pooled 3 x 3 do."""
    for h, w in [(1, 1), (7, 5), (20, 2000), (2000, 20), (1080, 1920), (333, 777)]:
        for budget in BUDGETS:
            assert target_size(h, w, budget, 48, 1) == target_size(h, w, budget, 16, 3)


def test_pitfall_pillow_resize_is_not_the_12b_processors(hf_pixels):
    """The 12B's processor resizes with torchvision (torch's uint8 kernel), not Pillow as the PIL processor of the
    other models does: Pillow's pixels are not its pixels."""
    img = sample_image(100, 150, seed=3)
    want = hf_pixels([img], 280)["pixel_values"][0].numpy()
    wrong = preprocess(img, 280, patch_size=48, pooling=1, processor="pil")
    assert not np.array_equal(wrong.patches, want[:wrong.patches.shape[0]])


# ---- the embedder and the text model, against transformers ----

class Case:
    """transformers' model, gem4's float32 load of its checkpoint, a prompt with two images and a clip."""

    def __init__(self, root, hf_pixels):
        self.hf = build_unified_hf()
        self.dir = root / "unified"
        self.hf.save_pretrained(self.dir)
        self.model = gem4.load(self.dir, dtype="float32")
        vc, ac = self.model.vision.config, self.model.audio.config
        self.images = [sample_image(h, w, seed=i + 1) for i, (h, w) in enumerate(SIZES)]
        self.pixels = hf_pixels(self.images, BUDGET)
        self.patches = [preprocess(img, BUDGET, patch_size=vc.patch_size, pooling=vc.pooling,
                                   processor=vc.image_processor) for img in self.images]
        self.wave = clip(5000, seed=7)
        template = [2, 10, 11, vc.image_token_id, 20, 21, ac.audio_token_id, 22, vc.image_token_id, 30, 31, 32]
        self.ids, self.inputs = media_prompt(template, [self.patches[0], self.wave, self.patches[1]], vision=vc,
                                             audio=ac)
        self.embeds = [self.model.vision.encode(p.patches, p.positions, p.grid) for p in self.patches]
        self.audio = encode_audio(self.model.audio, self.wave).embeddings
        with torch.no_grad():
            self.ref = self.hf(**self.hf_inputs(), attention_mask=self.generate_mask()).logits[0]

    def type_ids(self) -> torch.Tensor:
        ids = torch.tensor([self.ids])
        vc, ac = self.model.vision.config, self.model.audio.config
        return (ids == vc.image_token_id).long() + 3 * (ids == ac.audio_token_id).long()

    def hf_inputs(self) -> dict:
        from transformers import Gemma4UnifiedAudioFeatureExtractor

        feats = Gemma4UnifiedAudioFeatureExtractor()([self.wave], return_tensors="pt")
        return dict(input_ids=torch.tensor([self.ids]), pixel_values=self.pixels["pixel_values"],
                    image_position_ids=self.pixels["image_position_ids"], input_features=feats["input_features"],
                    input_features_mask=feats["input_features_mask"])

    def generate_mask(self) -> dict:
        """`create_masks_for_generate`'s masks (bidirectional on sliding layers only; `generate()` uses them with a
        static cache): `forward()` alone builds others."""
        ids = torch.tensor([self.ids])
        embeds = self.hf.get_input_embeddings()(ids)
        return self.hf.create_masks_for_generate(self.hf.config, embeds, None, None,
                                                 torch.arange(len(self.ids))[None], mm_token_type_ids=self.type_ids())

    def media(self, embeds=None, bidirectional=None) -> list[MediaItem]:
        bidi = self.model.vision.config.bidirectional if bidirectional is None else bidirectional
        images = iter(embeds or self.embeds)
        return [MediaItem(m.start, next(images), bidi) if m.kind == "image" else MediaItem(m.start, self.audio, False)
                for m in self.inputs]

    def error(self, logits: torch.Tensor) -> float:
        return float((logits - self.ref).abs().max() / self.ref.abs().max())


@pytest.fixture(scope="module")
def case(tmp_path_factory, hf_pixels):
    return Case(tmp_path_factory.mktemp("unified"), hf_pixels)


def test_the_checkpoint_loads_as_the_12b(case):
    vc = case.model.vision.config
    assert type(case.model.vision).__name__ == "UnifiedVisionModel"
    assert (vc.patch_size, vc.pooling, vc.embed_dim, vc.position_embedding_size) == (48, 1, 48, 64)
    assert vc.bidirectional and vc.video_token_id == 503 and vc.text_hidden_size == 64
    assert [m.kind for m in case.inputs] == ["image", "audio", "image"]
    assert [m.num_tokens for m in case.inputs] == [60, 8, 63]


def test_image_embeddings_match_transformers(case):
    with torch.no_grad():
        ref = case.hf.model.get_image_features(case.pixels["pixel_values"],
                                               case.pixels["image_position_ids"]).pooler_output
    for mine, want in zip(case.embeds, ref):
        assert mine.shape == want.shape
        err = float((mine - want).abs().max())
        print(f"12B image embeddings max |diff| {err:.1e}")
        assert err < EMBED_TOL


def test_logits_with_two_images_and_a_clip_match_transformers(case):
    err = case.error(case.model.logits(case.ids, case.media()))
    print(f"12B logits relative error {err:.1e}")
    assert err < LOGIT_TOL


def test_greedy_tokens_equal_transformers_generate(case):
    with torch.no_grad():
        want = case.hf.generate(**case.hf_inputs(), mm_token_type_ids=case.type_ids(), max_new_tokens=8,
                                do_sample=False, cache_implementation="static")[0, len(case.ids):].tolist()
    assert greedy_with_media(case.model, case.ids, case.media(), len(want)) == want


def test_engine_greedy_equals_transformers_generate(case):
    """Through the engine: the embedder's soft tokens computed by the runner, each image one prefill block."""
    from gem4 import Engine, SamplingParams

    with torch.no_grad():
        want = case.hf.generate(**case.hf_inputs(), mm_token_type_ids=case.type_ids(), max_new_tokens=6,
                                do_sample=False, cache_implementation="static")[0, len(case.ids):].tolist()
    engine = Engine(case.model, prefill_chunk=80, block_size=4)
    got = [e.token_id for e in engine.submit(case.ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                             media=case.inputs)]
    assert got == want


def test_bfloat16_cpu_path_takes_the_12bs_images(case):
    """The fast mode (bf16 weights, the CPU kernels' chunk attention where they run) gives the float32 logits within
    bf16 drift, and its mask is real: without the image spans it moves far more than that."""
    fast = gem4.load(case.dir, dtype="auto")
    embeds = [fast.vision.encode(p.patches, p.positions, p.grid) for p in case.patches]
    rel = max(float((e - f).abs().max() / f.abs().max()) for e, f in zip(embeds, case.embeds))
    audio = encode_audio(fast.audio, case.wave).embeddings

    def nmse(bidirectional):
        media = [MediaItem(m.start, e, bidirectional) for m, e in zip([m for m in case.inputs if m.kind == "image"],
                                                                    embeds)]
        media.append(MediaItem(case.inputs[1].start, audio, False))
        logits = fast.logits(case.ids, sorted(media, key=lambda m: m.start))
        return float(((logits - case.ref) ** 2).mean() / (case.ref ** 2).mean())

    err, causal = nmse(True), nmse(False)
    print(f"12B {fast.backend}: bf16 soft tokens {rel:.1e} relative; logits NMSE {err:.1e}, without the spans "
          f"{causal:.1e}")
    assert rel < 2e-2 and err <= 1e-3 and causal > 10 * err


# ---- the 12B's pitfalls, each made on purpose ----

def moved(case: Case, logits: torch.Tensor) -> float:
    err = case.error(logits)
    assert err > 100 * LOGIT_TOL, err
    return err


def test_pitfall_pixels_mapped_to_minus_one_one(case, monkeypatch):
    """P3: the 12B's embedder reads [0, 1] pixels as they are; the other models' 2x - 1 does not belong here. Its
    first LayerNorm undoes an affine map of the patch but for its eps, so the mistake shows little on a busy
    patch (past the tolerance still) and much on a flat one, whose variance is near the eps: a clear sky."""
    from PIL import Image

    rng = np.random.default_rng(0)
    flat = Image.fromarray((128 + rng.integers(0, 2, (96, 144, 3))).astype(np.uint8))
    vc = case.model.vision.config
    images = [case.patches[0], preprocess(flat, BUDGET, patch_size=48, pooling=1, processor=vc.image_processor)]
    right = [case.model.vision.encode(p.patches, p.positions, p.grid) for p in images]
    forward = unified_vision.UnifiedPatchEmbedder.forward
    monkeypatch.setattr(unified_vision.UnifiedPatchEmbedder, "forward",
                        lambda self, x, pos: forward(self, 2 * x - 1, pos))
    wrong = [case.model.vision.encode(p.patches, p.positions, p.grid) for p in images]
    assert float((wrong[0] - right[0]).abs().max()) > 2 * EMBED_TOL
    assert float((wrong[1] - right[1]).abs().max()) > 0.1


def test_pitfall_bidirectional_on_all_layers(case, monkeypatch):
    """P9: transformers' 12B forward(mm_token_type_ids=...) -- and so generate() with its default dynamic cache --
    lets image tokens see each other on every layer; its create_masks_for_generate (generate() with a static
    cache) and llama.cpp do so on sliding layers only, and so does gem4. Both ways on full layers too moves the
    logits."""
    from gem4.config import FULL, SLIDING

    layout = KVPool.layout

    def both_ways_everywhere(self, seqs, prefill=False):
        out = layout(self, seqs, prefill)
        a, s = out.attend[FULL], out.attend[SLIDING]
        first = s.first_key[s.q_seq]
        out.attend[FULL] = type(a)(a.key_rows, a.q_seq, a.q_lo, torch.maximum(a.q_hi, s.q_hi + first), a.first_key)
        return out

    monkeypatch.setattr(KVPool, "layout", both_ways_everywhere)
    moved(case, case.model.logits(case.ids, case.media()))
    with torch.no_grad():                              # transformers' forward() alone: the all-layers mask
        forward_only = case.hf(**case.hf_inputs(), mm_token_type_ids=case.type_ids()).logits[0]
    assert case.error(forward_only) > 100 * LOGIT_TOL


def test_pitfall_no_bidirectional_mask(case):
    """The 12B's config says "vision": one image's tokens see each other both ways on sliding layers."""
    moved(case, case.model.logits(case.ids, case.media(bidirectional=False)))


def test_pitfall_x_and_y_swapped(case):
    """pos_embedding is (rows, 2, D): [:, 0] is x (the column), [:, 1] is y."""
    p = case.patches[0]
    wrong = case.model.vision.encode(p.patches, p.positions[:, ::-1].copy(), p.grid)
    assert float((wrong - case.embeds[0]).abs().max()) > 1e-2


# ---- the checkpoint ----

def edited(case: Case, tmp_path, config=None):
    import json
    import shutil

    d = tmp_path / "edited"
    shutil.copytree(case.dir, d)
    cfg = json.loads((d / "config.json").read_text())
    if config:
        config(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["vision_config"].update(output_proj_dims=32), "output_proj_dims 32 must equal mm_embed_dim 48"),
    (lambda c: c["vision_config"].pop("mm_posemb_size"), "mm_posemb_size"),
    (lambda c: c["vision_config"].update(mm_posemb_size=32), "pos_embedding' has shape"),
    (lambda c: c["vision_config"].update(pooling_kernel_size=2), "patch_ln1.weight' has shape"),
    (lambda c: c["vision_config"].update(rms_norm_eps=0.5), "rms_norm_eps"),
    (lambda c: c["text_config"].pop("use_bidirectional_attention"), "lacks use_bidirectional_attention"),
    (lambda c: c["text_config"].update(use_bidirectional_attention="all"), "'all' is not supported"),
    (lambda c: c.pop("vision_config"), "has no vision_config"),
])
def test_inconsistent_unified_configs_are_refused(case, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        gem4.load(edited(case, tmp_path, edit), dtype="float32")


def test_inspect_shows_the_embedder(case):
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.summary import format_summary, summarize

    s = summarize(open_checkpoint(case.dir))
    assert s["vision"]["parameters"] == sum(p.numel() for n, p in case.hf.named_parameters()
                                            if n.startswith("model.embed_vision."))
    text = format_summary(s)
    assert "vision         encoder-free embedder (12B): 48 px patches, one a token -> 48 -> 64" in text
    assert "images attend both ways on sliding layers" in text


# ---- through the server ----

def test_chat_with_an_image_on_the_12b_matches_the_engine(tmp_path):
    """An `image_url` part to a served 12B: its 48 px patches at the request's budget, the answer the engine gives
    on the same prompt, `usage.prompt_tokens` counting one soft token per patch."""
    from gem4 import Engine, SamplingParams
    from gem4.chat import encode_prompt
    from gem4.parser import Gemma4Parser
    from server_helpers import client_for, serve_checkpoint
    from test_vision_server import ask, data_uri, vision_tokenizer_dir

    d = tmp_path / "model"
    build_unified_hf().save_pretrained(d)
    vision_tokenizer_dir(d)
    image = sample_image(150, 200, seed=3)
    messages = ask(data_uri(image))
    with serve_checkpoint(d, "unified", 1024) as (base, model, tok):
        r = client_for(base).chat.completions.create(model="unified", messages=messages, temperature=0, max_tokens=8,
                                                     extra_body={"mm_processor_kwargs": {"max_soft_tokens": 140}})
        vc = model.vision.config
        patches = preprocess(image, 140, patch_size=vc.patch_size, pooling=vc.pooling, processor=vc.image_processor)
        parts = [{"type": "image"} if p["type"] == "image_url" else p for p in messages[0]["content"]]
        ids = encode_prompt(tok, [{"role": "user", "content": parts}], enable_thinking=False)
        ids, media = media_prompt(ids, [patches], vision=vc)
        engine = Engine(model, tok, max_model_len=1024, prefill_chunk=512, enable_prefix_caching=False)
        events = list(engine.submit(ids, SamplingParams(temperature=0, max_tokens=8), media=media))
    parser = Gemma4Parser(tok, prompt_ids=ids, tool_names=frozenset())
    parser.feed([e.token_id for e in events if e.token_id is not None])
    parser.finish()
    assert media[0].num_tokens == patches.patches.shape[0] == 130          # 150x200 at 140: 10 x 13 patches of 48 px
    assert r.usage.prompt_tokens == len(ids)
    assert (r.choices[0].message.content or "") == (parser.result.content or "")



# ---- video: frames through the same embedder ----

@pytest.fixture(scope="module")
def hf_video_pixels():
    """frames [T, 3, H, W] uint8, budget -> transformers' `Gemma4UnifiedVideoProcessor._preprocess` output, its
    torchvision resize stubbed as the image processor's is."""
    from transformers.image_utils import PILImageResampling

    Gemma4UnifiedVideoProcessor = import_stubbed(
        "transformers.models.gemma4_unified.video_processing_gemma4_unified", "Gemma4UnifiedVideoProcessor")
    processor = object.__new__(Gemma4UnifiedVideoProcessor)

    def run(frames: torch.Tensor, budget: int = 70) -> dict:
        with stubbed_normalize():
            return preprocess_video(frames, budget)

    def preprocess_video(frames: torch.Tensor, budget: int) -> dict:
        return Gemma4UnifiedVideoProcessor._preprocess(
            processor, [frames], do_resize=True, resample=PILImageResampling.BICUBIC, do_rescale=True,
            rescale_factor=1 / 255, do_normalize=True, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0),
            return_tensors="pt", patch_size=16, max_soft_tokens=budget, pooling_kernel_size=3)

    return run


def decoded_frames(data: bytes, indices: list[int]) -> torch.Tensor:
    import io

    import av

    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return torch.from_numpy(np.stack([frames[i] for i in indices])).permute(0, 3, 1, 2).contiguous()


def test_video_frames_equal_transformers_unified_video_processor(case, hf_video_pixels):
    """The 12B's video processor is the other models' (torchvision's resize on the uint8 frames, 1/255 folded into
    a mean 0 / std 255 normalisation) with 48 px patches: media/video.py at the 12B's patch size gives its pixels."""
    from gem4.media.video import decode, frame_indices
    from test_video import make_clip

    vc = case.model.vision.config
    data = make_clip(frames=40, fps=10)
    video = decode(data, patch_size=vc.patch_size, pooling=vc.pooling)
    out = hf_video_pixels(decoded_frames(data, frame_indices(40)))
    assert len(video.frames) == out["pixel_values_videos"].shape[0] == 32
    for i, frame in enumerate(video.frames):
        p = frame.patches
        assert p.num_tokens == out["num_soft_tokens_per_video"][0] == 63
        assert np.array_equal(p.patches, out["pixel_values_videos"][i][:p.num_tokens].numpy())
        assert np.array_equal(p.positions, out["video_position_ids"][i][:p.num_tokens].numpy())


def test_logits_with_images_a_clip_and_a_video_match_transformers(case):
    """Two images, a clip and an 8-frame video in one prompt: each frame its own block both ways on sliding layers,
    as `create_masks_for_generate` makes it; greedy tokens equal to `generate()` with a static cache."""
    from gem4.media.video import decode
    from test_video import make_clip

    vc, ac = case.model.vision.config, case.model.audio.config
    video = decode(make_clip(frames=8, fps=4), patch_size=vc.patch_size, pooling=vc.pooling)
    template = [2, 10, vc.image_token_id, 20, ac.audio_token_id, vc.image_token_id, 21, vc.video_token_id, 30, 31]
    ids, inputs = media_prompt(template, [case.patches[0], case.wave, case.patches[1], video], vision=vc, audio=ac,
                               tokenize=lambda text: [100 + ord(c) % 200 for c in text])
    assert [m.kind for m in inputs] == ["image", "audio", "image"] + ["video"] * 8
    media = [MediaItem(m.start, encode_audio(case.model.audio, m.data).embeddings if m.kind == "audio" else
                       case.model.vision.encode(m.data.patches, m.data.positions, m.data.grid), m.bidirectional)
             for m in inputs]
    frames = [f.patches for f in video.frames]
    pixels = torch.zeros(len(frames), 70, frames[0].patches.shape[1])
    positions = torch.full((len(frames), 70, 2), -1, dtype=torch.long)
    for i, p in enumerate(frames):                     # as the video processor pads each frame to the budget
        pixels[i, :p.num_tokens], positions[i, :p.num_tokens] = torch.from_numpy(p.patches), torch.from_numpy(p.positions)
    t = torch.tensor([ids])
    types = (t == vc.image_token_id).long() + 2 * (t == vc.video_token_id).long() + 3 * (t == ac.audio_token_id).long()
    inputs_hf = {**case.hf_inputs(), "input_ids": t, "pixel_values_videos": pixels, "video_position_ids": positions,
                 "num_frames_per_video": torch.tensor([len(frames)])}
    with torch.no_grad():
        masks = case.hf.create_masks_for_generate(case.hf.config, case.hf.get_input_embeddings()(t), None, None,
                                                  torch.arange(len(ids))[None], mm_token_type_ids=types)
        ref = case.hf(**inputs_hf, attention_mask=masks).logits[0]
        want = case.hf.generate(**inputs_hf, mm_token_type_ids=types, max_new_tokens=5,
                                do_sample=False, cache_implementation="static")[0, len(ids):].tolist()
    err = float((case.model.logits(ids, media) - ref).abs().max() / ref.abs().max())
    print(f"12B logits with two images, a clip and a video, relative error {err:.1e}")
    assert err < LOGIT_TOL
    assert greedy_with_media(case.model, ids, media, len(want)) == want
