"""Audio bytes -> 16 kHz mono waveform -> log-mel frames: the audio front end (docs/multimodal.md §3.1-3.2).

Decoding is done by field libraries, never by hand: soundfile (libsndfile: WAV, FLAC, OGG/Vorbis/Opus, MP3)
first, PyAV (FFmpeg: AAC/M4A, WebM, anything soundfile cannot read) for the rest. The waveform is made mono
by averaging the channels in float32 and resampled with soxr at quality "soxr_hq", then padded or cut to
ceil(N * 16000 / rate) samples: the steps of transformers' `load_audio` (soundfile backend) and of
`librosa.load`, so the samples are the ones the transformers processor would see.

The log-mel features are those of transformers' Gemma 4 feature extractor, operation for operation in the
same numpy dtypes:

    x        = 160 zeros + waveform                    "semicausal" left pad of half a frame
    frame i  = x[160 i : 160 i + 320] * hann(320)      periodic Hann; the 321-sample unfold drops its last sample
    spectrum = |rfft(frame, 512)|                       MAGNITUDE (not power), 257 bins
    features = log(spectrum @ mel + 0.001)              128 HTK triangles over 0-8000 Hz, no area norm; natural log

Only frames whose last sample is real audio are kept (transformers zeroes and masks the others), so a
waveform of N samples gives F = floor((N - 1) / 160) frames, and the audio tower turns them into
ceil(F / 4) soft tokens (two stride-2 convolutions), 25 a second. Audio longer than 30 s is cut at
480000 samples, as transformers does (750 tokens); llama.cpp instead splits it into 30 s pieces.

The 12B ("unified") model has no audio tower and no mel features: its soft tokens are the raw waveform cut
into frames of 640 samples (40 ms), the last one zero-padded (`waveform_frames`), with no 30 s cut.

transformers' extractor also pads the batch to a multiple of 128 samples. Right padding (its default)
changes nothing; some published processor configs say `padding_side: "left"`, which shifts the frame grid
and changes the values (not the count). gem4 always behaves as right padding, as llama.cpp does.

No model and no tensors here: numpy arrays out. Nothing imports torch.
"""
from __future__ import annotations

import io
import math

import numpy as np

SAMPLE_RATE = 16_000        # Hz: what the audio tower was trained on
FRAME_LENGTH = 320          # samples, 20 ms
HOP_LENGTH = 160            # samples, 10 ms
FFT_LENGTH = 512            # the next power of two above the frame
N_MELS = 128
MEL_FLOOR = 1e-3            # log(mel + 0.001)
MAX_SAMPLES = 480_000       # 30 s at 16 kHz: longer audio is cut here (transformers' max_length, truncation=True)
MAX_DECODED_SECONDS = 600   # decoding stops being worth it long before this; longer media are refused
TOKENS_PER_SECOND = 25      # one soft token per 40 ms (4 frames of 10 ms)


class AudioError(ValueError):
    """Audio that cannot be used: undecodable bytes, no audio stream, too short or too long.

    `cause` is one word for the caller's error message ("undecodable", "too_short", "too_long")."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


# ---- decode + resample ----

def decode_audio(data: bytes, max_seconds: float = MAX_DECODED_SECONDS) -> np.ndarray:
    """Encoded audio (any container soundfile or FFmpeg reads) -> float32 mono waveform at 16 kHz [N].

    Media longer than `max_seconds` are refused (AudioError "too_long") instead of being decoded whole.
    """
    channels, rate = _decode(bytes(data), max_seconds)
    return to_model_rate(channels, rate)


def to_model_rate(channels: np.ndarray, rate: int) -> np.ndarray:
    """Samples [C, N] (float32, any channel count) at `rate` Hz -> mono float32 [ceil(N * 16000 / rate)] at 16 kHz:
    the channels averaged, then soxr "soxr_hq" (transformers' load_audio, librosa.load)."""
    import soxr

    channels = np.asarray(channels, dtype=np.float32)
    if channels.ndim != 2 or channels.shape[0] < 1:
        raise ValueError(f"samples must be [channels, n], got shape {channels.shape}")
    if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
        raise AudioError(f"the audio's sample rate {rate!r} is not a positive integer", "undecodable")
    wave = channels.mean(axis=0) if channels.shape[0] > 1 else channels[0]
    if rate != SAMPLE_RATE:
        n = math.ceil(wave.shape[-1] * SAMPLE_RATE / rate)
        wave = soxr.resample(wave, rate, SAMPLE_RATE, quality="soxr_hq")
        wave = np.pad(wave, (0, max(0, n - len(wave))))[:n]
    return np.ascontiguousarray(wave, dtype=np.float32)


def _decode(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """-> (samples [C, N] float32, sample rate): soundfile when it knows the format, else PyAV."""
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            if f.frames > max_seconds * f.samplerate:
                raise _too_long(f.frames / f.samplerate, max_seconds)
            return f.read(dtype="float32", always_2d=True).T, int(f.samplerate)
    except soundfile.LibsndfileError:       # not a format libsndfile reads (or a damaged one): FFmpeg's turn
        return _decode_av(data, max_seconds)


def _decode_av(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """PyAV (FFmpeg) for AAC/M4A, WebM, video containers' audio: the first audio stream, as planar float32."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise AudioError("the media has no audio stream", "undecodable")
            rate = stream.codec_context.sample_rate or stream.rate
            planar = av.AudioResampler(format="fltp", rate=rate)     # the stream's own layout and rate, as float32
            chunks, n = [], 0
            for frame in container.decode(stream):
                for out in planar.resample(frame):
                    chunks.append(out.to_ndarray())                  # [C, n]
                    n += chunks[-1].shape[1]
                if n > max_seconds * rate:
                    raise _too_long(n / rate, max_seconds)
            for out in planar.resample(None):                        # flush
                chunks.append(out.to_ndarray())
    except av.FFmpegError as e:
        raise AudioError(f"the audio could not be decoded ({e})", "undecodable") from None
    if not chunks:
        raise AudioError("the audio stream holds no samples", "too_short")
    return np.concatenate(chunks, axis=1).astype(np.float32, copy=False), int(rate)


def _too_long(seconds: float, max_seconds: float) -> AudioError:
    return AudioError(f"the audio lasts {seconds:.1f} s, more than the {max_seconds:g} s this server decodes",
                      "too_long")


# ---- log-mel features ----

def num_frames(n_samples: int) -> int:
    """Valid log-mel frames of a 16 kHz waveform of n samples (after the 30 s cut): floor((N - 1) / 160)."""
    n = min(n_samples, MAX_SAMPLES)
    return max(0, (n - 1) // HOP_LENGTH)


def num_soft_tokens(n_samples: int) -> int:
    """Audio soft tokens for a 16 kHz waveform of n samples: ceil(F / 4), at most 750.

    Not ceil(milliseconds / 40), which is one more for some lengths (16123 samples: 25, not 26)."""
    return -(-num_frames(n_samples) // 4)


def frame_tokens(n_samples: int, samples_per_token: int) -> int:
    """12B (encoder-free) soft tokens: ceil(N / samples_per_token), 25 a second at 640, no cap (as transformers)."""
    return -(-n_samples // samples_per_token)


def waveform_frames(waveform: np.ndarray, samples_per_token: int) -> np.ndarray:
    """12B (encoder-free): 16 kHz waveform [N] -> raw frames [ceil(N / S), S] float32, the last one zero-padded."""
    wave = np.asarray(waveform, dtype=np.float32).reshape(-1)
    if wave.shape[0] == 0:
        raise AudioError("the audio holds no samples", "too_short")
    n = frame_tokens(wave.shape[0], samples_per_token)
    return np.pad(wave, (0, n * samples_per_token - wave.shape[0])).reshape(n, samples_per_token)


def hann_window() -> np.ndarray:
    """Periodic Hann window of FRAME_LENGTH samples, float32: 0.5 - 0.5 cos(2 pi n / 320)."""
    return np.hanning(FRAME_LENGTH + 1)[:-1].astype(np.float32)


def mel_filters() -> np.ndarray:
    """[257, 128] float64 HTK triangular filters over 0..8000 Hz, no area normalisation.

    Centres equally spaced in mel = 2595 log10(1 + f / 700); each filter rises from its left neighbour's
    centre to its own and falls to its right neighbour's, over the FFT bins' frequencies."""
    def hz_to_mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    mels = np.linspace(hz_to_mel(0.0), hz_to_mel(SAMPLE_RATE / 2), N_MELS + 2)
    centres = 700.0 * (np.power(10, mels / 2595.0) - 1.0)                       # [130] Hz
    bins = np.linspace(0, SAMPLE_RATE // 2, FFT_LENGTH // 2 + 1)                 # [257] Hz
    slopes = centres[None, :] - bins[:, None]                                    # [257, 130]
    widths = np.diff(centres)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


_WINDOW = hann_window()
_MEL = mel_filters()
LEFT_PAD = FRAME_LENGTH // 2   # "semicausal": the first frame is centred on the first sample


def frames(waveform: np.ndarray) -> np.ndarray:
    """16 kHz waveform [N] (N <= 480000) -> its valid analysis frames [F, 320] float32, F = floor((N - 1) / 160):
    frame i is x[160 i : 160 i + 320] of x = 160 zeros + waveform (transformers unfolds 321 samples and drops
    the last one; a frame is valid when that 321st sample is real audio)."""
    x = np.concatenate([np.zeros(LEFT_PAD, dtype=np.float32), waveform])
    n = max(0, (x.shape[0] - (FRAME_LENGTH + 1)) // HOP_LENGTH + 1)
    starts = np.arange(n) * HOP_LENGTH
    return x[starts[:, None] + np.arange(FRAME_LENGTH)[None, :]]


def magnitude(frames: np.ndarray) -> np.ndarray:
    """Frames [F, 320] -> |rfft(frame * hann, 512)| [F, 257]: the magnitude, not the power."""
    return np.abs(np.fft.rfft(frames * _WINDOW, n=FFT_LENGTH, axis=-1))


def log_mel(waveform: np.ndarray) -> np.ndarray:
    """16 kHz mono waveform [N] -> log-mel features [F, 128] float32, F = floor((min(N, 480000) - 1) / 160).

    Raises AudioError ("too_short") when the audio is shorter than one frame (161 samples, ~10 ms)."""
    wave = np.asarray(waveform, dtype=np.float32).reshape(-1)[:MAX_SAMPLES]
    f = frames(wave)
    if f.shape[0] == 0:
        raise AudioError(f"the audio is {wave.shape[0]} samples long at 16 kHz, shorter than one "
                         f"{FRAME_LENGTH // 2 + 1}-sample frame", "too_short")
    return np.log(magnitude(f) @ _MEL + MEL_FLOOR).astype(np.float32)          # [F, 128], natural log
