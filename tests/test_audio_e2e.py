"""Audio soft tokens through the text model (E2B-like, causal) against transformers: logits of a prompt with two
clips, and greedy tokens equal to generate(); then through the engine (docs/multimodal.md §5.4): the same tokens,
the prefix cache keyed on the clips' samples, batch invariance beside text requests, preemption."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import gem4
from gem4.model.audio import encode_audio
from gem4.model.gemma4 import MediaItem

from audio_fixtures import build_audio_hf
from test_audio_tower import clip
from vision_fixtures import TOKEN_IDS, greedy_with_media


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    hf = build_audio_hf()
    path = tmp_path_factory.mktemp("e2e")
    hf.save_pretrained(path)
    model = gem4.load(path, dtype="float32")
    waves = [clip(16123, seed=1), clip(7000, seed=2)]
    encoded = [encode_audio(model.audio, w) for w in waves]
    ids, media = [2, 17, 33], []
    for e in encoded:
        ids.append(TOKEN_IDS["boa_token_id"])
        media.append(MediaItem(len(ids), e.embeddings, e.bidirectional))
        ids += [TOKEN_IDS["audio_token_id"]] * e.n_tokens + [TOKEN_IDS["eoa_token_id"], 40, 41]
    return hf, model, waves, ids, media


def hf_inputs(waves, ids):
    from transformers import Gemma4AudioFeatureExtractor

    feats = Gemma4AudioFeatureExtractor()(waves, return_tensors="pt")
    return dict(input_ids=torch.tensor([ids]), input_features=feats["input_features"],
                input_features_mask=feats["input_features_mask"])


def test_logits_with_two_clips_match_transformers(case):
    hf, model, waves, ids, media = case
    with torch.no_grad():
        expected = hf(**hf_inputs(waves, ids)).logits[0]
    got = model.extend(torch.tensor(ids), model.new_cache(), logits=len(ids), media=media)
    rel = (got - expected).abs().max() / expected.abs().max()
    assert rel < 1e-4, rel


def test_greedy_tokens_equal_transformers_generate(case):
    hf, model, waves, ids, media = case
    with torch.no_grad():
        out = hf.generate(**hf_inputs(waves, ids), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert greedy_with_media(model, ids, media, len(out)) == out


# ---- through the engine (docs/multimodal.md §5.4) ----

GREEDY = dict(temperature=0, max_tokens=6, logprobs=True)
AUDIO = TOKEN_IDS["audio_token_id"]


def run(engine, ids, media, **params):
    from gem4 import SamplingParams

    events = list(engine.submit(ids, SamplingParams(**dict(GREEDY, **params)), media=media))
    return [e.token_id for e in events], [e.logprob for e in events], events[-1].stats


def greedy_extend(model, ids, media, n=6):
    cache = model.new_cache()
    logits = model.extend(torch.tensor(ids), cache, media=media)
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        out.append(int(model.extend(torch.tensor(out[-1:]), cache)[-1].argmax()))
    return out


def engine_prompt(model, waves, question):
    from gem4.engine.media import media_prompt

    return media_prompt([2, 17, 33, AUDIO, 40, 41, AUDIO, 40, 41] + question, waves, audio=model.audio.config)


def test_media_prompt_expands_each_clip_with_the_checkpoints_ids(case):
    _, model, waves, ids, media = case
    got, inputs = engine_prompt(model, waves, [])
    assert got == ids and [(m.start, m.num_tokens, m.kind, m.bidirectional) for m in inputs] == \
        [(item.start, item.embeds.shape[0], "audio", False) for item in media]


def test_engine_greedy_equals_model_extend_and_transformers(case):
    """Through the engine in prefill chunks of 16 (each clip is split across chunks: audio is causal): the
    tokens Model.extend gives, which test_greedy_tokens_equal_transformers_generate holds to generate()."""
    from gem4 import Engine

    hf, model, waves, ids, media = case
    want = greedy_extend(model, ids, media)
    prompt, inputs = engine_prompt(model, waves, [])
    got, _, stats = run(Engine(model, prefill_chunk=16, block_size=4), prompt, inputs)
    assert got == want and stats.prompt_tokens == len(ids)
    with torch.no_grad():
        assert hf.generate(**hf_inputs(waves, ids), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist() == got


def test_engine_prefix_cache_is_keyed_on_the_clip(case):
    """A second question about the same clips reuses their K/V and answers as a cold run; other clips behind the
    same placeholders hit only the text before them."""
    from gem4 import Engine

    _, model, waves, _, _ = case
    engine = Engine(model, prefill_chunk=64, block_size=4)
    run(engine, *engine_prompt(model, waves, [30, 31, 32]))
    ids, media = engine_prompt(model, waves, [50, 51])
    warm = run(engine, ids, media)
    cold = run(Engine(model, prefill_chunk=64, block_size=4, enable_prefix_caching=False), ids, media)
    assert warm[2].cached_tokens >= media[1].end and warm[0] == cold[0]
    assert warm[1] == pytest.approx(cold[1], rel=1e-5, abs=1e-6)
    other = [clip(16123, seed=11), clip(7000, seed=12)]
    ids, media = engine_prompt(model, other, [50, 51])
    miss = run(engine, ids, media)
    assert miss[2].cached_tokens <= media[0].start
    assert miss[0] == run(Engine(model, prefill_chunk=64, block_size=4, enable_prefix_caching=False), ids, media)[0]


def test_engine_batches_audio_requests_with_text_ones(case):
    """Requests with different clips and a text-only one, side by side, each get their tokens alone."""
    from gem4 import Engine, SamplingParams

    _, model, waves, _, _ = case
    requests = [engine_prompt(model, waves, [30, 31]), engine_prompt(model, [clip(9000, seed=5), waves[1]], [30]),
                ([2, 5, 6, 7, 8], [])]
    alone = [run(Engine(model, prefill_chunk=64, block_size=4), ids, media)[0] for ids, media in requests]
    engine = Engine(model, prefill_chunk=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=80)
    streams = [engine.submit(ids, SamplingParams(**GREEDY), media=media) for ids, media in requests]
    assert [[e.token_id for e in s] for s in streams] == alone


def test_preempted_audio_requests_recompute_with_the_same_soft_tokens(case):
    """A pool too small for three audio requests at once preempts; each still gets the tokens it gets alone."""
    from gem4 import Engine, SamplingParams
    from gem4.engine.pool import kv_pool_size

    _, model, _, _, _ = case
    from gem4.engine.media import media_prompt

    requests = [media_prompt([2, 10, AUDIO, 30, 31], [clip(14000, seed=s)], audio=model.audio.config)
                for s in (41, 42, 43)]
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [[e.token_id for e in Engine(model, prefill_chunk=64).submit(ids, params, media=m)] for ids, m in requests]
    size = kv_pool_size(model.config, model.dtype, max_chunk=64, num_seqs=3, max_model_len=128, prefix_caching=True)
    engine = Engine(model, prefill_chunk=64, max_num_seqs=3, max_model_len=128,
                    kv_cache_bytes=size.num_sliding_blocks * size.sliding_block_bytes + 11 * size.block_bytes)
    streams = [engine.submit(ids, params, media=m) for ids, m in requests]
    assert [[e.token_id for e in s] for s in streams] == want and engine.num_preemptions > 0


def test_engine_and_media_prompt_refuse_bad_audio(case, variants):
    from gem4 import Engine
    from gem4.engine.media import media_prompt

    _, model, waves, _, _ = case
    ids, media = engine_prompt(model, waves, [30])
    with pytest.raises(ValueError, match="audio placeholders without an audio"):
        Engine(model, prefill_chunk=64).submit(ids, media=media[:1])
    with pytest.raises(ValueError, match="not the audio's placeholders"):
        Engine(model, prefill_chunk=64).submit([5] + ids[1:], media=[dataclasses.replace(media[0], start=0)])
    with pytest.raises(ValueError, match="2 audio placeholders for 1 audios"):
        media_prompt([2, AUDIO, 3, AUDIO], waves[:1], audio=model.audio.config)
    with pytest.raises(ValueError, match="no audio tower"):
        media_prompt([2, AUDIO], waves[:1])
    with pytest.raises(ValueError, match="too short for one soft token"):
        media_prompt([2, AUDIO], [clip(100, seed=1)], audio=model.audio.config)
    text_only = gem4.load(variants["dense_plain"].hf_mm, dtype="float32")
    with pytest.raises(ValueError, match="no tower for media of kind 'audio'"):
        Engine(text_only, prefill_chunk=64).submit(ids, media=media)


def test_an_image_and_a_clip_in_one_prompt(tmp_path):
    """Both towers (as E2B/E4B): media_prompt expands an image and a clip in the prompt's order; the engine's
    greedy tokens equal transformers' generate() with pixel values and audio features together."""
    from transformers import Gemma4ImageProcessorPil

    from gem4 import Engine
    from gem4.engine.media import media_prompt
    from gem4.media.image import preprocess
    from vision_fixtures import sample_image

    hf = build_audio_hf(seed=9, vision=True)
    hf.save_pretrained(tmp_path)
    model = gem4.load(tmp_path, dtype="float32")
    image, wave = sample_image(96, 144, seed=3), clip(12000, seed=4)
    image_id = TOKEN_IDS["image_token_id"]
    ids, media = media_prompt([2, 10, AUDIO, 20, image_id, 30, 31], [wave, preprocess(image, 70, patch_size=16,
                                                                                         pooling=3)],
                              vision=model.vision.config, audio=model.audio.config)
    assert [m.kind for m in media] == ["audio", "image"] and media[1].start > media[0].end
    got, _, _ = run(Engine(model, prefill_chunk=32, block_size=4), ids, media)
    pixels = Gemma4ImageProcessorPil()(images=[image], max_soft_tokens=70, return_tensors="pt")
    inputs = hf_inputs([wave], ids)
    with torch.no_grad():
        want = hf.generate(**inputs, pixel_values=pixels["pixel_values"],
                           image_position_ids=pixels["image_position_ids"],
                           mm_token_type_ids=(inputs["input_ids"] == image_id).long(), max_new_tokens=6,
                           do_sample=False)[0, len(ids):].tolist()
    assert got == want


def test_12b_raw_frames_through_the_engine(tmp_path):
    """The 12B's encoder-free audio: ceil(N / 640) soft tokens a clip, the engine's tokens those of Model.extend
    with the frames' embeddings."""
    from transformers import (Gemma4UnifiedAudioConfig, Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration,
                              Gemma4UnifiedTextConfig)

    from gem4 import Engine
    from gem4.engine.media import media_prompt
    from model_fixtures import VARIANTS

    hf = Gemma4UnifiedForConditionalGeneration(Gemma4UnifiedConfig(
        text_config=Gemma4UnifiedTextConfig(**VARIANTS["dense_keqv"]), vision_config=None,
        audio_config=Gemma4UnifiedAudioConfig(audio_embed_dim=640), **TOKEN_IDS)).eval()
    with torch.no_grad():
        hf.model.embed_audio.embedding_projection.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    hf.save_pretrained(tmp_path)
    model = gem4.load(tmp_path, dtype="float32")
    wave = clip(5000, seed=7)
    ids, media = media_prompt([2, 10, AUDIO, 30], [wave], audio=model.audio.config)
    assert media[0].num_tokens == 8 and ids[media[0].start - 1] == TOKEN_IDS["boa_token_id"]
    items = [MediaItem(media[0].start, encode_audio(model.audio, wave).embeddings, False)]
    assert run(Engine(model, prefill_chunk=16, block_size=4), ids, media)[0] == greedy_extend(model, ids, items)


def test_fast_mode_audio_requests_are_batch_invariant_and_exact_on_prefix_hits(tmp_path):
    """The fast mode (bf16, the CPU kernels where they run): a request with clips gets bit-for-bit the same
    logprobs alone, beside other requests (text and other clips), and after a prefix-cache hit on its clips."""
    from gem4 import Engine, SamplingParams

    build_audio_hf().save_pretrained(tmp_path)
    fast = gem4.load(tmp_path, dtype="auto")
    waves = [clip(16123, seed=1), clip(7000, seed=2)]
    target = engine_prompt(fast, waves, [30, 31, 32])
    alone = run(Engine(fast, prefill_chunk=64, block_size=4, enable_prefix_caching=False), *target)
    engine = Engine(fast, prefill_chunk=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=80)
    streams = [engine.submit(ids, SamplingParams(**GREEDY), media=media)
               for ids, media in (engine_prompt(fast, [clip(9000, seed=3), waves[0]], [40]), target,
                                  ([2, 5, 6, 7, 8, 9], []))]
    beside = [(e.token_id, e.logprob) for e in streams[1]]
    for s in streams[0::2]:
        list(s)
    assert beside == list(zip(alone[0], alone[1]))
    hit = run(engine, *engine_prompt(fast, waves, [30, 31, 32]))
    assert hit[2].cached_tokens >= target[1][1].end and (hit[0], hit[1]) == (alone[0], alone[1])
