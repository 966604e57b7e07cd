"""Towers batched across requests (docs/multimodal.md §5.4): images and video frames of one patch grid go through the
vision tower in one pass, audio clips of one length through the audio tower in one (engine/runner.py encode_all;
model/vision.py VisionModel.encode, model/audio.py AudioModel), whichever request they belong to, and each gets the
very floats it gets alone -- on the float32 reference path and on the CPU backend, whose prefill GEMM is row-invariant
(the towers' linears take it: layers.TOWER_PREFILL) -- so batching changes no token. The prefix cache's media are
not encoded again."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import gem4
from gem4 import Engine, SamplingParams
from gem4.engine import runner
from gem4.engine.media import image_prompt, media_prompt
from gem4.media.image import preprocess
from gem4.model import kernels
from gem4.model.audio import audio_input, encode_audio
from audio_fixtures import build_audio_hf
from test_audio_tower import clip
from vision_fixtures import build_vision_hf, sample_image

BUDGET = 70
GREEDY = dict(temperature=0, max_tokens=4, logprobs=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batching") / "31b"
    build_vision_hf("31b").save_pretrained(directory)
    return directory


def images(size: tuple[int, int], seeds) -> list:
    return [preprocess(sample_image(*size, seed=s), BUDGET, patch_size=16, pooling=3) for s in seeds]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batched_tower_pass_gives_each_image_its_floats_alone(checkpoint, dtype):
    if dtype == "bfloat16" and not kernels.available():
        pytest.skip("the CPU backend needs the compiled kernels")
    vision = gem4.load(checkpoint, dtype=dtype).vision
    assert vision.backend == ("torch" if dtype == "float32" else "cpu")
    pictures = images((96, 144), range(4))
    alone = [vision.encode(p.patches, p.positions, p.grid) for p in pictures]
    batched = vision.encode(np.stack([p.patches for p in pictures]), pictures[0].positions, pictures[0].grid)
    assert batched.shape == (4, *alone[0].shape)
    for one, row in zip(alone, batched):
        assert torch.equal(one, row)


def admitted_together(model, requests, config, monkeypatch) -> list[list[tuple[int, float]]]:
    """The requests' (token, logprob) events, all admitted in one engine step: the engine is held in its first step (a
    text request) while they arrive."""
    engine = Engine(model, **config)
    entered, release, run = threading.Event(), threading.Event(), engine._runner.run

    def gated(batch):
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return run(batch)

    monkeypatch.setattr(engine._runner, "run", gated)
    first = engine.submit([2, 5, 6, 7], SamplingParams(**GREEDY))
    assert entered.wait(30)
    streams = [engine.submit(ids, SamplingParams(**GREEDY), media=media) for ids, media in requests]
    release.set()
    got = [[(e.token_id, e.logprob) for e in s] for s in streams]
    list(first)
    return got


def alone(model, requests, config) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids, media in requests:
        events = list(Engine(model, **config).submit(ids, SamplingParams(**GREEDY), media=media))
        out.append(([e.token_id for e in events], [e.logprob for e in events]))
    return out


def assert_same_tokens(got, want) -> None:
    """The soft tokens are the very floats (each test checks); the float32 text model's decode passes are not
    batch-invariant (the fast mode's are: docs/multimodal.md §5.4), so the logprobs beside other requests move by
    float rounding."""
    for mine, (tokens, logprobs) in zip(got, want, strict=True):
        assert [t for t, _ in mine] == tokens
        assert [lp for _, lp in mine] == pytest.approx(logprobs, rel=1e-5, abs=1e-6)


def test_the_engine_runs_new_requests_images_of_one_grid_in_one_tower_pass(checkpoint, monkeypatch):
    """Four requests admitted in one step: three with a picture of one size (one grid, 540 patches), one with
    another size. The tower runs the three in passes of at most MAX_TOWER_PATCHES patches (two, then one), then the
    fourth; each image's soft tokens are those it gets alone, and every request gets the tokens it gets alone."""
    model = gem4.load(checkpoint, dtype="float32")
    vc = model.vision.config
    pictures = images((96, 144), (1, 2, 3)) + images((144, 96), (4,))
    requests = [image_prompt([2, 10 + k, vc.image_token_id, 20, 21], vc, [p]) for k, p in enumerate(pictures)]
    config = dict(prefill_chunk=64, block_size=4, max_num_seqs=5, max_num_batched_tokens=512)
    want = alone(model, requests, config)
    calls, encode = [], model.vision.encode

    def counted(patches, positions, grid):
        soft = encode(patches, positions, grid)
        calls.append((tuple(patches.shape), soft))
        return soft

    monkeypatch.setattr(model.vision, "encode", counted)
    got = admitted_together(model, requests, config, monkeypatch)
    n, other = pictures[0].patches.shape[0], pictures[3].patches.shape[0]
    assert runner.MAX_TOWER_PATCHES // n == 2
    assert [shape[:2] for shape, _ in calls] == [(2, n), (1, n), (1, other)]
    for picture, soft in zip(pictures, [soft for _, batch in calls for soft in batch]):
        assert torch.equal(soft, encode(picture.patches, picture.positions, picture.grid))
    assert_same_tokens(got, want)


@pytest.fixture(scope="module")
def audio_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batching") / "audio"
    build_audio_hf().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batched_audio_pass_gives_each_clip_its_floats_alone(audio_checkpoint, dtype):
    if dtype == "bfloat16" and not kernels.available():
        pytest.skip("the CPU backend needs the compiled kernels")
    audio = gem4.load(audio_checkpoint, dtype=dtype).audio
    inputs = [audio_input(audio, clip(14000, seed=s)) for s in range(3)]
    alone_ = [audio(torch.from_numpy(x)) for x in inputs]
    batched = audio(torch.from_numpy(np.stack(inputs)))
    assert batched.shape == (3, *alone_[0].shape)
    for one, row in zip(alone_, batched):
        assert torch.equal(one, row)


def test_the_engine_runs_new_requests_clips_of_one_length_in_one_tower_pass(audio_checkpoint, monkeypatch):
    """Three requests admitted in one step, two with a clip of 14000 samples, one of 9000: the audio tower runs twice
    (two clips, then one), and every request gets the tokens it gets alone."""
    model = gem4.load(audio_checkpoint, dtype="float32")
    ac = model.audio.config
    waves = [clip(14000, seed=1), clip(14000, seed=2), clip(9000, seed=3)]
    requests = [media_prompt([2, 10 + k, ac.audio_token_id, 20, 21], [w], audio=ac) for k, w in enumerate(waves)]
    config = dict(prefill_chunk=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=512)
    want = alone(model, requests, config)
    calls, forward = [], model.audio.forward

    def counted(features):
        soft = forward(features)
        calls.append((tuple(features.shape), soft))
        return soft

    monkeypatch.setattr(model.audio, "forward", counted)
    got = admitted_together(model, requests, config, monkeypatch)
    assert [shape[0] for shape, _ in calls] == [2, 1]
    for wave, soft in zip(waves, [soft for _, batch in calls for soft in batch]):
        assert torch.equal(soft, encode_audio(model.audio, wave).embeddings)
    assert_same_tokens(got, want)


def test_an_image_the_prefix_cache_holds_is_not_encoded_again(checkpoint, monkeypatch):
    """A second question about the same picture: the prefix cache gives the image's rows (and the question's first
    words), so the tower does not run for it -- the cost of that turn is its question -- and the answer is the one a
    cold engine gives. A different picture behind the same placeholders is encoded (a miss)."""
    model = gem4.load(checkpoint, dtype="float32")
    vc = model.vision.config
    picture, other = images((96, 144), (7, 8))
    first = image_prompt([2, 10, vc.image_token_id, 20, 21, 22], vc, [picture])
    second = image_prompt([2, 10, vc.image_token_id, 20, 23, 24, 25], vc, [picture])
    third = image_prompt([2, 10, vc.image_token_id, 20, 23, 24, 25], vc, [other])
    config = dict(prefill_chunk=64, block_size=4, max_num_batched_tokens=512)
    cold = alone(model, [second, third], config)
    calls, encode = [], model.vision.encode

    def counted(patches, positions, grid):
        calls.append(tuple(patches.shape))
        return encode(patches, positions, grid)

    monkeypatch.setattr(model.vision, "encode", counted)
    engine = Engine(model, **config)
    list(engine.submit(first[0], SamplingParams(**GREEDY), media=first[1]))
    assert len(calls) == 1
    events = list(engine.submit(second[0], SamplingParams(**GREEDY), media=second[1]))
    assert len(calls) == 1                                             # the hit covers the image: no tower pass
    assert events[-1].cached_tokens >= second[1][0].end
    assert_same_tokens([[(e.token_id, e.logprob) for e in events]], cold[:1])
    events = list(engine.submit(third[0], SamplingParams(**GREEDY), media=third[1]))
    assert len(calls) == 2                                             # another picture: encoded
    assert_same_tokens([[(e.token_id, e.logprob) for e in events]], cold[1:])
