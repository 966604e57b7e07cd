"""Images in (docs/multimodal.md): Pillow preprocessing bit-exact with transformers' PIL processor, the vision
tower's soft tokens within 1e-5 of transformers', and the text model with two images in its prompt within 1e-4
(float32) of `Gemma4ForConditionalGeneration` on tiny random models of both tower flavours, greedy tokens equal to
its generate(). Each image pitfall of the spec is made on purpose once and must move the result."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

import gem4
from gem4.kv_cache import KVPool, SeqStep
from gem4.media.image import BUDGETS, ImageError, decode, preprocess, target_size
from gem4.model import gemma4, vision
from gem4.model.gemma4 import MediaItem
from gem4.weights.checkpoint import CheckpointError
from vision_fixtures import build_vision_hf, greedy_with_media, sample_image

EMBED_TOL = 1e-5
LOGIT_TOL = 1e-4          # relative to the largest |logit|
SIZES = [(96, 144), (120, 100)]   # (height, width) of the prompt's two images; at budget 70: 60 and 63 tokens
BUDGET = 70


def hf_processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil()


# ---- preprocessing ----

@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("size", [(224, 224), (100, 150), (270, 480), (20, 2000), (480, 336), (7, 5)])
def test_patches_equal_transformers_pil_processor(size, budget):
    img = sample_image(*size, seed=size[0] + budget)
    out = hf_processor()(images=[img], max_soft_tokens=budget, return_tensors="np")
    mine = preprocess(img, budget, patch_size=16, pooling=3)
    n = mine.patches.shape[0]
    assert mine.num_tokens == out["num_soft_tokens_per_image"][0] <= budget
    assert np.array_equal(mine.patches, out["pixel_values"][0][:n])                # bit for bit
    assert np.array_equal(mine.positions, out["image_position_ids"][0][:n])
    assert (out["image_position_ids"][0][n:] == -1).all()                          # the rest is transformers' padding


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P"])
def test_transparency_and_modes_as_transformers(mode):
    """Transparency is composited onto white; palette (with a transparent index), grey and grey+alpha images come
    out as transformers' processor makes them."""
    base = sample_image(100, 150, seed=3, mode="RGBA" if mode in ("RGBA", "P") else "LA")
    if mode == "P":
        img = base.convert("RGB").quantize(16)
        img.info["transparency"] = 0
    elif mode == "L":
        img = base.convert("L")
    else:
        img = base
    if mode != "L":
        assert "A" in img.getbands() or img.info.get("transparency") is not None
    out = hf_processor()(images=[img], max_soft_tokens=140, return_tensors="np")
    mine = preprocess(img, 140, patch_size=16, pooling=3)
    assert np.array_equal(mine.patches, out["pixel_values"][0][:mine.patches.shape[0]])
    if mode in ("RGBA", "LA"):          # a fully transparent pixel is white
        clear = base.copy()
        clear.putalpha(0)
        assert np.all(preprocess(clear, 70, patch_size=16, pooling=3).patches == 1.0)


def test_exif_orientation_is_applied():
    """A JPEG stored sideways with EXIF orientation 6 is turned upright before resizing (transformers' load_image
    does so; its processor alone would not)."""
    from PIL import ImageOps

    upright = sample_image(90, 160, seed=5)
    exif = Image.Exif()
    exif[0x0112] = 6                                    # rotate 90 degrees clockwise to view
    buf = io.BytesIO()
    upright.transpose(Image.Transpose.ROTATE_90).save(buf, "PNG", exif=exif)
    stored = Image.open(io.BytesIO(buf.getvalue()))
    assert stored.size == (90, 160)                     # sideways on disk
    mine = preprocess(decode(buf.getvalue()), 280, patch_size=16, pooling=3)
    out = hf_processor()(images=[ImageOps.exif_transpose(stored).convert("RGB")], max_soft_tokens=280,
                         return_tensors="np")
    assert np.array_equal(mine.patches, out["pixel_values"][0][:mine.patches.shape[0]])
    assert mine.grid[0] < mine.grid[1]                  # landscape, as the picture is meant to be seen


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from(BUDGETS))
def test_target_size_is_transformers_rule(height, width, budget):
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    try:
        want = get_aspect_ratio_preserving_size(height=height, width=width, patch_size=16, max_patches=budget * 9,
                                                pooling_kernel_size=3)
    except ValueError:
        with pytest.raises(ImageError):
            target_size(height, width, budget, 16, 3)
        return
    got = target_size(height, width, budget, 16, 3)
    assert got == want
    assert got[0] % 48 == 0 and got[1] % 48 == 0 and (got[0] // 48) * (got[1] // 48) <= budget


def test_small_images_are_upscaled_to_fill_the_budget():
    """P1/P2: a 224x224 image at budget 280 becomes 768x768 (256 tokens), not 224 rounded to 48 px (llama.cpp)
    and not a fixed 280 or 256 tokens for every image."""
    assert target_size(224, 224, 280, 16, 3) == (768, 768)
    assert preprocess(sample_image(224, 224), 280, patch_size=16, pooling=3).num_tokens == 256
    assert preprocess(sample_image(1080, 1920), 280, patch_size=16, pooling=3).num_tokens == 264


def test_bad_images_and_budgets_are_refused():
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode(b"not an image at all")
    buf = io.BytesIO()
    sample_image(64, 64).save(buf, "PNG")
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode(buf.getvalue()[:60])                       # truncated
    with pytest.raises(ImageError, match="more than the 1000 allowed"):
        decode(buf.getvalue(), max_pixels=1000)
    with pytest.raises(ImageError, match="budget must be one of"):
        preprocess(sample_image(64, 64), 256, patch_size=16, pooling=3)
    assert decode(buf.getvalue()).size == (64, 64)


# ---- the tower and the text model, against transformers ----

class Case:
    """One flavour: the transformers model, gem4's float32 load of its checkpoint, two images and a prompt."""

    def __init__(self, flavour: str, root):
        self.flavour = flavour
        self.hf = build_vision_hf(flavour)
        self.dir = root / flavour
        self.hf.save_pretrained(self.dir)
        self.model = gem4.load(self.dir, dtype="float32")
        self.images = [sample_image(h, w, seed=i + 1) for i, (h, w) in enumerate(SIZES)]
        self.pixels = hf_processor()(images=self.images, max_soft_tokens=BUDGET, return_tensors="pt")
        self.patches = [preprocess(img, BUDGET, patch_size=16, pooling=3) for img in self.images]
        vc = self.model.vision.config
        self.embeds = [self.model.vision.encode(p.patches, p.positions, p.grid) for p in self.patches]
        n0, n1 = (e.shape[0] for e in self.embeds)
        self.ids = ([2, 10, 11, vc.boi_token_id] + [vc.image_token_id] * n0 + [vc.eoi_token_id, 20, 21, 22, vc.boi_token_id]
                    + [vc.image_token_id] * n1 + [vc.eoi_token_id, 30, 31, 32, 33])
        self.starts = [4, 4 + n0 + 5]
        with torch.no_grad():
            self.ref = self.hf(**self.hf_inputs()).logits[0]

    def hf_inputs(self) -> dict:
        ids = torch.tensor([self.ids])
        return dict(input_ids=ids, pixel_values=self.pixels["pixel_values"],
                    image_position_ids=self.pixels["image_position_ids"],
                    mm_token_type_ids=(ids == self.model.vision.config.image_token_id).long())

    def media(self, embeds=None, bidirectional=None) -> list[MediaItem]:
        bidi = self.model.vision.config.bidirectional if bidirectional is None else bidirectional
        return [MediaItem(s, e, bidi) for s, e in zip(self.starts, embeds or self.embeds)]

    def error(self, logits: torch.Tensor) -> float:
        return float((logits - self.ref).abs().max() / self.ref.abs().max())


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    return {f: Case(f, root) for f in ("e2b", "31b")}


FLAVOURS = ["e2b", "31b"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_image_embeddings_match_transformers(cases, flavour):
    c = cases[flavour]
    with torch.no_grad():
        ref = c.hf.model.get_image_features(c.pixels["pixel_values"], c.pixels["image_position_ids"]).pooler_output
    for mine, want in zip(c.embeds, ref):
        assert mine.shape == want.shape
        err = float((mine - want).abs().max())
        print(f"{flavour}: image embeddings max |diff| {err:.1e}")
        assert err < EMBED_TOL


def test_the_config_decides_the_flavour(cases):
    e2b, big = cases["e2b"].model.vision.config, cases["31b"].model.vision.config
    assert (e2b.clipped_linears, e2b.standardize, e2b.bidirectional) == (True, False, False)
    assert (big.clipped_linears, big.standardize, big.bidirectional) == (False, True, True)
    assert e2b.text_hidden_size == 64 and (e2b.image_token_id, e2b.boi_token_id, e2b.eoi_token_id) == (500, 501, 502)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_logits_with_two_images_match_transformers(cases, flavour):
    c = cases[flavour]
    err = c.error(c.model.logits(c.ids, c.media()))
    print(f"{flavour}: logits with two images, max relative error {err:.1e}")
    assert err < LOGIT_TOL


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_chunked_prefill_keeps_each_image_whole(cases, flavour):
    """A prefill in chunks that each hold whole images gives the one-pass logits; a chunk that splits a
    bidirectional image is refused (its first tokens' outputs depend on its last ones)."""
    c = cases[flavour]
    model, media = c.model, c.media()
    cache = model.new_cache()
    cut = c.starts[1] - 2                                  # between the two images
    first = model.extend(torch.tensor(c.ids[:cut]), cache, logits=cut, media=media)
    rest = model.extend(torch.tensor(c.ids[cut:]), cache, logits=len(c.ids) - cut, media=media)
    assert c.error(torch.cat([first, rest])) < LOGIT_TOL
    if media[0].bidirectional:
        with pytest.raises(ValueError, match="split by the step"):
            model.extend(torch.tensor(c.ids[:10]), model.new_cache(), media=media)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_greedy_tokens_equal_transformers_generate(cases, flavour):
    c = cases[flavour]
    steps = 6
    with torch.no_grad():
        want = c.hf.generate(**c.hf_inputs(), max_new_tokens=steps, do_sample=False)[0, len(c.ids):].tolist()
    assert greedy_with_media(c.model, c.ids, c.media(), steps) == want


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_bfloat16_cpu_path_takes_images(cases, flavour):
    """The fast mode (the CPU kernels' chunk attention where they run) gives the float32 logits within bf16 drift,
    and its mask is real: flipping the image spans' direction moves the logits far more than that."""
    c = cases[flavour]
    fast = gem4.load(c.dir, dtype="auto")
    embeds = [fast.vision.encode(p.patches, p.positions, p.grid) for p in c.patches]

    def nmse(logits):
        return float(((logits - c.ref) ** 2).mean() / (c.ref ** 2).mean())

    err = nmse(fast.logits(c.ids, c.media(embeds)))
    flipped = nmse(fast.logits(c.ids, c.media(embeds, bidirectional=not fast.vision.config.bidirectional)))
    print(f"{flavour} {fast.backend}: bf16 logits with two images, NMSE {err:.1e} (the text model's bf16 drift, "
          f"as test_model.py bounds it); with the image spans' direction flipped {flipped:.1e}")
    assert err <= 1e-3 and flipped > 10 * err


def test_bidirectional_span_layout():
    """Sliding layers: a query inside a span sees up to the span's end, its past still windowed; full layers
    stay causal."""
    from gem4.config import FULL, SLIDING

    class Geometry:   # a pool with no layers: the layout needs the window only
        sliding_window = 4
        layers = ()

    pool = KVPool(Geometry, num_blocks=4, num_sliding_blocks=4, dtype=torch.float32)
    layout = pool.layout([SeqStep(0, 12, [0], [0], logits=0, bidirectional=((3, 8),))], prefill=True)
    s, f = layout.attend[SLIDING], layout.attend[FULL]
    assert f.q_hi.tolist() == list(range(1, 13))
    assert s.q_hi.tolist() == [1, 2, 3, 8, 8, 8, 8, 8, 9, 10, 11, 12]
    assert s.q_lo.tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    later = pool.layout([SeqStep(8, 2, [0], [0], bidirectional=((3, 8),))])     # a span of an earlier step
    assert later.attend[SLIDING].q_hi.tolist() == [9 - 5, 10 - 5]
    with pytest.raises(ValueError, match="split by the step"):
        pool.layout([SeqStep(0, 5, [0], [0], bidirectional=((3, 8),))])
    rest = pool.layout([SeqStep(5, 4, [0], [0], bidirectional=((3, 8),))])      # after a hit inside the span
    assert rest.attend[SLIDING].q_hi.tolist() == [8 - 2, 8 - 2, 8 - 2, 9 - 2]


# ---- the pitfalls (docs/multimodal.md §11), each made on purpose ----

def moved(c: Case, logits: torch.Tensor) -> float:
    err = c.error(logits)
    assert err > 100 * LOGIT_TOL, err
    return err


def test_pitfall_soft_tokens_scaled_by_sqrt_h(cases):
    """P6: soft tokens go in as they are; text rows are the ones scaled by sqrt(H)."""
    c = cases["31b"]
    moved(c, c.model.logits(c.ids, c.media([e * math.sqrt(64) for e in c.embeds])))


def test_pitfall_ple_looked_up_with_placeholder_ids(cases, monkeypatch):
    """P7 (E2B/E4B): the per-layer token table is read with pad id 0 at media rows, not the placeholder's id."""
    c = cases["e2b"]
    monkeypatch.setattr(gemma4, "PAD_ID", c.model.vision.config.image_token_id)
    moved(c, c.model.logits(c.ids, c.media()))


def test_pitfall_no_bidirectional_mask(cases):
    """P8: on a "vision" config, one image's tokens see each other both ways on sliding layers."""
    c = cases["31b"]
    moved(c, c.model.logits(c.ids, c.media(bidirectional=False)))


def test_pitfall_bidirectional_on_a_causal_config(cases):
    """P8: E2B/E4B (use_bidirectional_attention null) are causal over images too."""
    c = cases["e2b"]
    moved(c, c.model.logits(c.ids, c.media(bidirectional=True)))


def test_pitfall_bidirectional_on_full_layers(cases, monkeypatch):
    """P8: the span is bidirectional on sliding layers only; full layers stay causal."""
    from gem4.config import FULL, SLIDING

    c = cases["31b"]
    layout = KVPool.layout

    def both_ways_everywhere(self, seqs, prefill=False):
        out = layout(self, seqs, prefill)
        a, s = out.attend[FULL], out.attend[SLIDING]
        first = s.first_key[s.q_seq]                   # the sliding key list starts at first_key, the full one at 0
        out.attend[FULL] = type(a)(a.key_rows, a.q_seq, a.q_lo, torch.maximum(a.q_hi, s.q_hi + first), a.first_key)
        return out

    monkeypatch.setattr(KVPool, "layout", both_ways_everywhere)
    moved(c, c.model.logits(c.ids, c.media()))


def test_pitfall_pixels_not_mapped_to_minus_one_one(cases, monkeypatch):
    """P3: the tower maps [0, 1] pixels to [-1, 1] itself (the processor only divides by 255)."""
    c = cases["31b"]
    p = c.patches[0]
    forward = vision.PatchEmbedder.forward
    monkeypatch.setattr(vision.PatchEmbedder, "forward", lambda self, x, pos: forward(self, (x + 1) / 2, pos))
    wrong = c.model.vision.encode(p.patches, p.positions, p.grid)
    assert float((wrong - c.embeds[0]).abs().max()) > 1e-2


def test_pitfall_x_and_y_swapped(cases):
    """P4: positions are (x, y) = (column, row): table [0] and the first half of each head are x."""
    c = cases["e2b"]
    p = c.patches[0]
    wrong = c.model.vision.encode(p.patches, p.positions[:, ::-1].copy(), p.grid)
    assert float((wrong - c.embeds[0]).abs().max()) > 1e-2


def test_pitfall_rope_halves_swapped(cases, monkeypatch):
    """P4: head dims [0, d/2) rotate with x, [d/2, d) with y."""
    c = cases["e2b"]
    p = c.patches[0]
    rope = vision.rope_2d
    monkeypatch.setattr(vision, "rope_2d", lambda x, cos, sin: rope(x, cos.flip(1), sin.flip(1)))
    wrong = c.model.vision.encode(p.patches, p.positions, p.grid)
    assert float((wrong - c.embeds[0]).abs().max()) > 1e-2


def test_pitfall_attention_scaled(cases, monkeypatch):
    """P4: the tower's attention scale is 1.0 (q and k are RMS-normed), not 1/sqrt(d)."""
    c = cases["31b"]
    p = c.patches[0]
    sdpa = vision.F.scaled_dot_product_attention
    monkeypatch.setattr(vision.F, "scaled_dot_product_attention",
                        lambda q, k, v, scale: sdpa(q, k, v, scale=q.shape[-1] ** -0.5))
    wrong = c.model.vision.encode(p.patches, p.positions, p.grid)
    assert float((wrong - c.embeds[0]).abs().max()) > 1e-2


# ---- the checkpoint: every value from it, refused by name when inconsistent ----

def edited(cases, tmp_path, flavour, config=None, tensors=None):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "edited"
    shutil.copytree(cases[flavour].dir, d)
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(d / "model.safetensors")
        tensors(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["vision_config"].update(use_clipped_linears=False), "use_clipped_linears=False but the checkpoint has"),
    (lambda c: c["vision_config"].update(standardize=True), "standardize=True but the checkpoint lacks"),
    (lambda c: c["text_config"].update(use_bidirectional_attention="all"), "use_bidirectional_attention 'all'"),
    (lambda c: c["vision_config"].update(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (lambda c: c["vision_config"].pop("head_dim"), "vision_config: config.json lacks 'head_dim'"),
    (lambda c: c["vision_config"].update(head_dim=18), "head_dim 18 must be a multiple of 4"),
    (lambda c: c["vision_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 100.0}), "rope_type"),
    (lambda c: c.pop("image_token_id"), "lacks 'image_token_id'"),
])
def test_inconsistent_vision_configs_are_refused(cases, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        gem4.load(edited(cases, tmp_path, "e2b", config=edit), dtype="float32")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.vision_tower.encoder.layers.1.mlp.up_proj.linear.weight"),
     "missing required tensor 'model.vision_tower.encoder.layers.1.mlp.up_proj.linear.weight'"),
    (lambda t: t.update({"model.vision_tower.extra.weight": torch.zeros(2)}),
     "unexpected vision tower tensor 'model.vision_tower.extra.weight'"),
    (lambda t: t.update({"model.embed_vision.embedding_projection.weight": torch.zeros(64, 16)}),
     r"'model.embed_vision.embedding_projection.weight' has shape \(64, 16\)"),
])
def test_inconsistent_vision_tensors_are_refused(cases, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        gem4.load(edited(cases, tmp_path, "e2b", tensors=edit), dtype="float32")


def test_text_only_checkpoints_have_no_tower(variants):
    assert gem4.load(variants["dense_plain"].hf_mm, dtype="float32").vision is None


# ---- through the engine ----

GREEDY = dict(temperature=0, max_tokens=6, logprobs=True)


def run(engine, ids, media, **params):
    from gem4 import SamplingParams

    stream = engine.submit(ids, SamplingParams(**dict(GREEDY, **params)), media=media)
    events = list(stream)
    return [e.token_id for e in events], [e.logprob for e in events], events[-1].stats


def engine_prompt(c: Case, question: list[int], images=None):
    from gem4.engine.media import image_prompt

    vc = c.model.vision.config
    ids = [2, 10, 11, vc.image_token_id, 20, 21, 22, vc.image_token_id] + question
    return image_prompt(ids, vc, images if images is not None else c.patches)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_engine_greedy_equals_transformers(cases, flavour):
    """Through the engine in prefill chunks of 64 (the images have 60 and 63 tokens: a chunk ends before an image
    rather than inside it): transformers' generate() tokens."""
    from gem4 import Engine

    c = cases[flavour]
    ids, media = engine_prompt(c, [30, 31, 32, 33])
    assert ids == c.ids and [m.start for m in media] == c.starts
    with torch.no_grad():
        want = c.hf.generate(**c.hf_inputs(), max_new_tokens=6, do_sample=False)[0, len(c.ids):].tolist()
    got, _, stats = run(Engine(c.model, prefill_chunk=64, block_size=4), ids, media)
    assert got == want and stats.prompt_tokens == len(ids)


def test_engine_prefix_cache_is_keyed_on_the_image(cases):
    """A second question about the same images reuses their K/V (cached tokens cover them) and answers as a cold
    run; the same placeholders with another image hit only the text before it."""
    from gem4 import Engine

    c = cases["31b"]
    engine = Engine(c.model, prefill_chunk=64, block_size=4)
    first_ids, media = engine_prompt(c, [30, 31, 32, 33])
    run(engine, first_ids, media)
    ids, media = engine_prompt(c, [40, 41, 42])
    warm = run(engine, ids, media)
    cold = run(Engine(c.model, prefill_chunk=64, block_size=4, enable_prefix_caching=False), ids, media)
    assert warm[2].cached_tokens >= media[1].end and warm[0] == cold[0]
    assert warm[1] == pytest.approx(cold[1], rel=1e-5, abs=1e-6)
    other = [preprocess(sample_image(h, w, seed=9 + i), BUDGET, patch_size=16, pooling=3)
             for i, (h, w) in enumerate(SIZES)]
    ids, media = engine_prompt(c, [40, 41, 42], other)
    miss = run(engine, ids, media)
    assert miss[2].cached_tokens <= media[0].start
    alone = run(Engine(c.model, prefill_chunk=64, block_size=4, enable_prefix_caching=False), ids, media)
    assert miss[0] == alone[0]


def test_engine_batches_image_requests_with_text_ones(cases):
    """Requests with different images and a text-only one, side by side, each get their tokens alone."""
    from gem4 import Engine, SamplingParams

    c = cases["31b"]
    other = [preprocess(sample_image(h, w, seed=20 + i), BUDGET, patch_size=16, pooling=3)
             for i, (h, w) in enumerate(SIZES)]
    requests = [engine_prompt(c, [30, 31]), engine_prompt(c, [30, 31], other), ([2, 5, 6, 7, 8], [])]
    alone = [run(Engine(c.model, prefill_chunk=64, block_size=4), ids, media)[0] for ids, media in requests]
    engine = Engine(c.model, prefill_chunk=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=160)
    streams = [engine.submit(ids, SamplingParams(**GREEDY), media=media) for ids, media in requests]
    assert [[e.token_id for e in s] for s in streams] == alone


def test_engine_refuses_bad_media(cases, variants):
    from gem4 import Engine
    from gem4.engine.media import image_prompt

    c = cases["31b"]
    ids, media = engine_prompt(c, [30])
    with pytest.raises(ValueError, match="longer than the prefill chunk"):
        Engine(c.model, prefill_chunk=32).submit(ids, media=media)
    with pytest.raises(ValueError, match="placeholders without an image"):
        Engine(c.model, prefill_chunk=64).submit(ids, media=media[:1])
    with pytest.raises(ValueError, match="not the image's placeholders"):
        Engine(c.model, prefill_chunk=64).submit([5] + ids[1:], media=[dataclasses_replace(media[0], start=0)])
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        image_prompt([2, 500, 3, 500], c.model.vision.config, c.patches[:1])
    with pytest.raises(ValueError, match="no vision tower"):
        image_prompt([2, 500], None, c.patches[:1])
    wide = preprocess(sample_image(20, 2000), 280, patch_size=16, pooling=3)          # 501 patches across
    with pytest.raises(ValueError, match="wider or taller than this tower's 64 positions"):
        image_prompt([2, 500], c.model.vision.config, [wide])
    text_only = gem4.load(variants["dense_plain"].hf_mm, dtype="float32")
    with pytest.raises(ValueError, match="no tower for media"):
        Engine(text_only, prefill_chunk=64).submit(ids, media=media)


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_fast_mode_image_requests_are_batch_invariant_and_exact_on_prefix_hits(cases):
    """The fast mode (bf16, the CPU kernels where they run): a request with images gets bit-for-bit the same
    logprobs alone, beside other requests, and after a prefix-cache hit on its images."""
    from gem4 import Engine, SamplingParams

    c = cases["31b"]
    fast = gem4.load(c.dir, dtype="auto")
    params = SamplingParams(**GREEDY)
    other = [preprocess(sample_image(h, w, seed=30 + i), BUDGET, patch_size=16, pooling=3)
             for i, (h, w) in enumerate(SIZES)]
    target = engine_prompt(c, [30, 31, 32])
    alone = run(Engine(fast, prefill_chunk=64, block_size=4, enable_prefix_caching=False), *target)
    engine = Engine(fast, prefill_chunk=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=160)
    streams = [engine.submit(ids, params, media=media)
               for ids, media in (engine_prompt(c, [40], other), target, ([2, 5, 6, 7, 8, 9], []))]
    beside = [(e.token_id, e.logprob) for e in streams[1]]
    for s in streams[0::2]:
        list(s)
    assert beside == list(zip(alone[0], alone[1]))
    hit = run(engine, *engine_prompt(c, [30, 31, 32]))
    assert hit[2].cached_tokens >= target[1][1].end and (hit[0], hit[1]) == (alone[0], alone[1])


def test_inspect_shows_the_tower(cases):
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.summary import format_summary, summarize

    s = summarize(open_checkpoint(cases["e2b"].dir))
    hf_params = sum(p.numel() for n, p in cases["e2b"].hf.named_parameters() if n.startswith("model.vision_tower.")
                    or n.startswith("model.embed_vision."))
    clips = sum(b.numel() for n, b in cases["e2b"].hf.named_buffers() if n.endswith(("_min", "_max")))
    assert s["vision"]["parameters"] == hf_params + clips and s["vision"]["clipped_linears"]
    assert "vision tower   2 layers x 32" in format_summary(s) and "causal over images" in format_summary(s)


def small_image_prompt(c: Case, seed: int):
    """[bos, text, one image of 60 tokens, text]: 66 tokens."""
    from gem4.engine.media import image_prompt

    vc = c.model.vision.config
    image = preprocess(sample_image(96, 144, seed=seed), BUDGET, patch_size=16, pooling=3)
    return image_prompt([2, 10, vc.image_token_id, 30, 31], vc, [image])


def test_preempted_image_requests_recompute_with_the_same_soft_tokens(cases):
    """A pool too small for three image requests at once preempts; each still gets the tokens it gets alone."""
    from gem4 import Engine, SamplingParams
    from gem4.engine.pool import kv_pool_size

    c = cases["31b"]
    requests = [small_image_prompt(c, seed) for seed in (41, 42, 43)]
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [[e.token_id for e in Engine(c.model, prefill_chunk=64).submit(ids, params, media=m)] for ids, m in requests]
    size = kv_pool_size(c.model.config, c.model.dtype, max_chunk=64, num_seqs=3, max_model_len=128, prefix_caching=True)
    engine = Engine(c.model, prefill_chunk=64, max_num_seqs=3, max_model_len=128,
                    kv_cache_bytes=size.num_sliding_blocks * size.sliding_block_bytes + 11 * size.block_bytes)
    streams = [engine.submit(ids, params, media=m) for ids, m in requests]
    assert [[e.token_id for e in s] for s in streams] == want and engine.num_preemptions > 0


def test_choices_of_an_image_request_are_its_seeded_runs(cases):
    """n = 2 with a seed: choice i is the n = 1 request with seed + i (the prompt, images included, computed once)."""
    from gem4 import Engine, SamplingParams

    c = cases["e2b"]
    ids, media = small_image_prompt(c, 44)
    runs = [[e.token_id for e in Engine(c.model, prefill_chunk=64).submit(
        ids, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8), media=media)] for i in range(2)]
    events = list(Engine(c.model, prefill_chunk=64, max_num_seqs=2).submit(
        ids, SamplingParams(temperature=1.0, seed=7, max_tokens=8), media=media, n=2))
    assert [[e.token_id for e in events if e.index == i] for i in range(2)] == runs


def test_convert_writes_the_tower_beside_the_text_gguf(cases, tmp_path, capsys):
    """The text GGUF holds the text model only; the tower goes to llama.cpp's mmproj beside it (tests/test_mmproj.py
    loads the pair)."""
    from gem4.cli import main as cli_main

    out = tmp_path / "text.gguf"
    assert cli_main(["convert", str(cases["e2b"].dir), str(out), "--type", "f32"]) == 0
    assert f"wrote {tmp_path / 'mmproj-text.gguf'} (f32)" in capsys.readouterr().out
    assert gem4.load(out, dtype="float32").vision is None


def test_a_cached_text_prefix_beside_an_image_prefix(cases):
    """The prefix cache compares positions by equality only: a cached text-only prompt whose tokens read like
    an image's start (`<|image>` then text) and a prompt with an image there share the first positions and no
    more, and both run."""
    from gem4 import Engine

    c = cases["31b"]
    vc = c.model.vision.config
    engine = Engine(c.model, prefill_chunk=64, block_size=4)
    text = [2, 10, vc.boi_token_id, 7, 8, 9, 11]
    run(engine, text, [])
    ids, media = small_image_prompt(c, 45)
    got = run(engine, ids, media)
    assert got[2].cached_tokens <= media[0].start
    assert got[0] == run(Engine(c.model, prefill_chunk=64, enable_prefix_caching=False), ids, media)[0]
