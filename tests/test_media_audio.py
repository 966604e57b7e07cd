"""media/audio.py: decoding, resampling and the log-mel front end against transformers 5.23.0.

Every signal is generated here (numpy sines, sweeps, noise) and encoded with soundfile or PyAV; nothing is
downloaded. transformers' `load_audio(..., backend="soundfile")` and `Gemma4AudioFeatureExtractor` are the
oracles: the waveform must be identical, the features equal within float32 rounding.
"""
from __future__ import annotations

import io
import math
from types import SimpleNamespace

import numpy as np
import pytest

from gem4.media import audio as A

TOL = 1e-5


def tone(rate: int, seconds: float, channels: int = 1, seed: int = 0) -> np.ndarray:
    """[n, channels] float32: a 440 Hz sine, a 100 Hz -> 7 kHz sweep and noise, one per channel in turn."""
    t = np.arange(int(round(rate * seconds))) / rate
    rng = np.random.default_rng(seed)
    kinds = [0.5 * np.sin(2 * np.pi * 440 * t),
             0.4 * np.sin(2 * np.pi * (100 * t + (7000 - 100) / (2 * seconds) * t * t)),
             0.2 * rng.standard_normal(t.shape)]
    return np.stack([kinds[c % 3] for c in range(channels)], axis=1).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    import soundfile
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def encode_av(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """Encode [n, channels] float samples with PyAV (FFmpeg), for the formats libsndfile cannot write."""
    import av

    layout = {1: "mono", 2: "stereo"}[samples.shape[1]]
    pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=layout)   # interleaved
        frame.sample_rate = rate
        ctx = stream.codec_context
        fit = av.AudioResampler(format=ctx.format.name, layout=layout, rate=rate, frame_size=ctx.frame_size or None)
        for f in fit.resample(frame) + fit.resample(None):
            out.mux(stream.encode(f))
        out.mux(stream.encode(None))
    return buf.getvalue()


def hf_extractor(**kwargs):
    from transformers import Gemma4AudioFeatureExtractor
    return Gemma4AudioFeatureExtractor(**kwargs)


def hf_features(wave: np.ndarray, **kwargs) -> np.ndarray:
    """transformers' features of one clip, its valid frames only (the others are zeroed and masked)."""
    out = hf_extractor(**kwargs)([wave], return_tensors="np")
    return out["input_features"][0][out["input_features_mask"][0]]


# ---- decode + resample ----

@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", None), ("OGG", None),
                                         ("MP3", None)])
@pytest.mark.parametrize("rate,channels", [(44100, 2), (8000, 1), (16000, 1), (48000, 3)])
def test_decoding_equals_transformers_load_audio(tmp_path, fmt, subtype, rate, channels):
    from transformers.audio_utils import load_audio

    if fmt == "MP3" and rate == 8000:
        rate = 11025            # not an MP3 rate libsndfile writes
    if fmt == "MP3" and channels > 2:
        channels = 2
    data = encode(tone(rate, 1.3, channels), rate, fmt, subtype)
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    ours = A.decode_audio(data)
    theirs = load_audio(str(path), sampling_rate=16000, backend="soundfile")
    assert ours.dtype == np.float32 and ours.shape == (math.ceil(len(tone(rate, 1.3)) * 16000 / rate),)
    assert np.array_equal(ours, theirs)


def test_formats_libsndfile_cannot_read_go_through_ffmpeg():
    rate = 44100
    samples = tone(rate, 1.0, 2)
    # lossless PCM in a Matroska container: libsndfile does not read it, FFmpeg gives the very samples
    mkv = encode_av(samples, rate, "matroska", "pcm_s16le")
    pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
    assert np.array_equal(A.decode_audio(mkv), A.decode_audio(encode(pcm, rate, "WAV", "PCM_16")))
    # AAC in an M4A (lossy): a 440 Hz sine comes back as a 440 Hz sine, a second long give or take the
    # encoder's priming and last-frame padding (up to three 1024-sample AAC frames)
    m4a = encode_av(tone(rate, 1.0, 1), rate, "ipod", "aac")
    wave = A.decode_audio(m4a)
    assert 0 <= len(wave) - 16000 <= 3 * 1024 * 16000 // rate
    peak = np.argmax(np.abs(np.fft.rfft(wave[2000:14000]))) * 16000 / 12000
    assert abs(peak - 440) < 3


def test_undecodable_and_silent_and_overlong_media_are_refused_by_cause():
    with pytest.raises(A.AudioError) as e:
        A.decode_audio(b"not audio at all" * 50)
    assert e.value.cause == "undecodable"
    with pytest.raises(A.AudioError) as e:
        A.decode_audio(encode(tone(16000, 3.0), 16000, "WAV"), max_seconds=2)
    assert e.value.cause == "too_long"
    with pytest.raises(A.AudioError) as e:
        A.decode_audio(encode_av(tone(16000, 3.0), 16000, "matroska", "pcm_s16le"), max_seconds=2)
    assert e.value.cause == "too_long"
    with pytest.raises(A.AudioError) as e:
        A.log_mel(np.zeros(160, np.float32))
    assert e.value.cause == "too_short"


def test_broken_media_are_audio_errors_never_other_exceptions():
    import av

    video = io.BytesIO()                                       # a video without sound
    with av.open(video, mode="w", format="matroska") as out:
        stream = out.add_stream("ffv1", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(3):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i, np.uint8), format="rgb24")))
        out.mux(stream.encode(None))
    with pytest.raises(A.AudioError, match="no audio stream") as e:
        A.decode_audio(video.getvalue())
    assert e.value.cause == "undecodable"
    empty = A.decode_audio(encode(np.zeros((0, 1), np.float32), 16000, "WAV"))
    with pytest.raises(A.AudioError) as e:
        A.log_mel(empty)
    assert e.value.cause == "too_short"
    for fmt in ("WAV", "FLAC", "MP3", "OGG"):                  # cut short: decoded as far as it goes, or refused
        data = encode(tone(16000, 1.0), 16000, fmt)
        for cut in (len(data) // 2, 40, 0):
            try:
                A.decode_audio(data[:cut])
            except A.AudioError as e:
                assert e.cause == "undecodable"


# ---- log-mel ----

@pytest.mark.parametrize("n", [161, 200, 320, 1000, 16000, 16123, 16500, 33333, 160 * 128 + 7, 480000, 500001])
@pytest.mark.parametrize("kind", ["sine", "sweep", "noise", "silence"])
def test_log_mel_equals_the_feature_extractor(n, kind):
    if kind == "silence":
        wave = np.zeros(n, np.float32)
    else:
        wave = tone(16000, n / 16000, 3, seed=n)[:n, ["sine", "sweep", "noise"].index(kind)]
    ours = A.log_mel(wave)
    theirs = hf_features(wave)
    assert ours.shape == theirs.shape == (A.num_frames(n), 128)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)


def test_stereo_44k1_file_through_the_whole_front_end_equals_transformers(tmp_path):
    from transformers.audio_utils import load_audio

    path = tmp_path / "clip.flac"
    path.write_bytes(encode(tone(44100, 2.37, 2), 44100, "FLAC"))
    ours = A.log_mel(A.decode_audio(path.read_bytes()))
    theirs = hf_features(load_audio(str(path), sampling_rate=16000, backend="soundfile"))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)


def test_token_count_is_ceil_of_a_quarter_of_the_frames_capped_at_750():
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    processor = SimpleNamespace(feature_extractor=hf_extractor(), audio_seq_length=750)
    for n in [161, 200, 799, 800, 801, 16000, 16123, 16161, 16500, 40000 + 3, 479999, 480000, 480001, 900000]:
        assert A.num_soft_tokens(n) == Gemma4Processor._compute_audio_num_tokens(processor, np.zeros(n), 16000), n
    assert [A.num_soft_tokens(n) for n in (16000, 16123, 16500, 480000)] == [25, 25, 26, 750]
    # P11: the "25 per second" shortcut ceil(ms / 40) is one too many for some lengths
    assert math.ceil(16123 / 16 / 40) == 26 != A.num_soft_tokens(16123)


def test_features_beyond_30_s_are_cut_as_transformers_cuts_them():
    wave = tone(16000, 31.0, 3)[:, 1]
    assert A.log_mel(wave).shape == (2999, 128)
    np.testing.assert_array_equal(A.log_mel(wave), A.log_mel(wave[:480000]))


@pytest.mark.parametrize("mistake", ["power spectrum", "log10", "mel floor 1e-10", "symmetric hann",
                                     "no left pad", "first sample dropped", "slaney-like area norm"])
def test_each_front_end_mistake_moves_the_features(monkeypatch, mistake):
    """P10: each of these is a plausible reading of "log-mel" that transformers does not do."""
    wave = tone(16000, 1.5, 3)[:, 1] + tone(16000, 1.5, 3)[:, 2]
    magnitude, mel = A.magnitude, A._MEL
    if mistake == "power spectrum":
        monkeypatch.setattr(A, "magnitude", lambda f: magnitude(f) ** 2)
    elif mistake == "log10":
        monkeypatch.setattr(A, "np", SimpleNamespace(**{**vars(np), "log": np.log10}))
    elif mistake == "mel floor 1e-10":
        monkeypatch.setattr(A, "MEL_FLOOR", 1e-10)
    elif mistake == "symmetric hann":
        monkeypatch.setattr(A, "_WINDOW", np.hanning(A.FRAME_LENGTH).astype(np.float32))
    elif mistake == "no left pad":
        monkeypatch.setattr(A, "LEFT_PAD", 0)
    elif mistake == "first sample dropped":              # unfold 321 and keep the last 320 instead of the first
        monkeypatch.setattr(A, "LEFT_PAD", A.LEFT_PAD - 1)
    elif mistake == "slaney-like area norm":
        monkeypatch.setattr(A, "_MEL", mel / np.maximum(mel.sum(axis=0, keepdims=True), 1e-12))
    wrong = A.log_mel(wave)
    right = hf_features(wave)
    rows = min(len(wrong), len(right))
    assert np.abs(wrong[:rows] - right[:rows]).max() > 1000 * TOL


def test_left_padding_in_the_extractor_shifts_the_frames_gem4_behaves_as_right_padding():
    """P12: some published processor configs say padding_side "left"; gem4 always computes the right-padded
    (= unpadded) features, as llama.cpp does. Left padding keeps the count and changes the values."""
    wave = tone(16000, 1.0, 3)[:16000 - 37, 1]              # not a multiple of 128
    ours = A.log_mel(wave)
    np.testing.assert_allclose(ours, hf_features(wave, padding_side="right"), rtol=0, atol=TOL)
    left = hf_features(wave, padding_side="left")
    assert left.shape == ours.shape
    assert np.abs(left - ours).max() > 1000 * TOL
