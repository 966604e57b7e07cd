"""`gem4 run MODEL --audio PATH --image PATH -p ...` in a subprocess: the files go before the prompt in the user
turn, as the server's content parts do, and the printed answer is the engine's for the same prompt and media
(greedy, float32); a file the model has no tower for, or one that does not decode, is a one-line error naming it."""
from __future__ import annotations

import io

import pytest
import soundfile

import gem4
from gem4 import Engine, SamplingParams
from gem4.chat import encode_prompt
from gem4.cli import _stream_chat, assistant_message
from gem4.engine.media import media_prompt
from gem4.media.audio import decode_audio

from audio_fixtures import build_audio_hf
from test_audio_server import audio_tokenizer_dir
from test_audio_tower import clip
from test_cli import STATS, run_cli
from vision_fixtures import sample_image


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-audio") / "model"
    build_audio_hf().save_pretrained(d)
    audio_tokenizer_dir(d)
    return d


def test_run_with_audio_clips_prints_the_engines_answer(audio_model, tmp_path):
    waves = [clip(20000, seed=2), clip(9000, seed=3)]
    paths = [tmp_path / "a.wav", tmp_path / "b.flac"]
    for wave, path in zip(waves, paths):
        soundfile.write(path, wave, 16000)
    proc = run_cli(["run", str(audio_model), "--audio", str(paths[0]), "--audio", str(paths[1]), "-p", "Compare them.",
                    "-n", "8", "--temperature", "0", "--dtype", "float32"], tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr

    tok = gem4.Tokenizer.from_file(audio_model)
    model = gem4.load(audio_model, dtype="float32")
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "audio"},
                                             {"type": "text", "text": "Compare them."}]}]
    ids = encode_prompt(tok, messages, enable_thinking=False)
    ids, media = media_prompt(ids, [decode_audio(p.read_bytes()) for p in paths], audio=model.audio.config)
    out = io.StringIO()
    with Engine(model, tok) as engine:
        _, last, _ = _stream_chat(engine, tok, ids, SamplingParams(temperature=0, top_k=64, top_p=0.95, max_tokens=8),
                                  out, media)
    assert proc.stdout == out.getvalue() and [m.num_tokens for m in media] == [31, 14]
    m = STATS.search(proc.stderr)
    assert m and int(m.group(1)) == len(ids) and int(m.group(3)) == last.completion_tokens


def test_media_the_model_cannot_take_is_a_one_line_error(audio_model, tmp_path):
    image = tmp_path / "pic.png"
    sample_image(64, 64).save(image)
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF but not really a wave file" * 10)
    for flag, path, says in (("--image", image, "this model has no vision tower"),
                             ("--audio", broken, "could not be decoded")):
        proc = run_cli(["run", str(audio_model), flag, str(path), "-p", "What?", "-n", "2", "--dtype", "float32"],
                       tmp_path / "cache")
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and proc.stdout == ""
        assert last.startswith(f"gem4: error: {flag} {path}: ") and says in last, proc.stderr


def test_chat_attaches_files_to_the_next_message_and_keeps_them_in_the_history(audio_model, tmp_path):
    wave = clip(16000, seed=5)
    path = tmp_path / "q.wav"
    soundfile.write(path, wave, 16000)
    script = f"/audio {path}\nWhat is it?\nAnd again?\n/image {path}\n/audio\nBye\n/exit\n"
    proc = run_cli(["chat", str(audio_model), "-n", "6", "--temperature", "0", "--dtype", "float32"],
                   tmp_path / "cache", stdin=script)
    assert proc.returncode == 0, proc.stderr

    tok = gem4.Tokenizer.from_file(audio_model)
    model = gem4.load(audio_model, dtype="float32")
    params = SamplingParams(temperature=0, top_k=64, top_p=0.95, max_tokens=6)
    history, want = [], ""
    with Engine(model, tok) as engine:
        for content in ([{"type": "audio"}, {"type": "text", "text": "What is it?"}], "And again?", "Bye"):
            history.append({"role": "user", "content": content})
            ids = encode_prompt(tok, history, enable_thinking=False)
            ids, media = media_prompt(ids, [decode_audio(path.read_bytes())], audio=model.audio.config)
            out = io.StringIO()
            result, _, _ = _stream_chat(engine, tok, ids, params, out, media)
            history.append(assistant_message(result))
            want += out.getvalue()
    assert proc.stdout == want
    assert f"(audio {path} attached to the next message)" in proc.stderr
    assert f"gem4: error: /image {path}: this model has no vision tower" in proc.stderr
    assert "gem4: error: /audio needs a PATH" in proc.stderr


def test_run_with_a_video_prints_the_engines_answer(tmp_path):
    from gem4.media.video import decode as decode_video
    from test_video import make_clip
    from test_video_server import video_tokenizer_dir
    from vision_fixtures import build_vision_hf

    d = tmp_path / "model"
    build_vision_hf("31b").save_pretrained(d)
    video_tokenizer_dir(d)
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_clip(frames=4, fps=2))
    proc = run_cli(["run", str(d), "--video", str(path), "-p", "What moves?", "-n", "6", "--temperature", "0",
                    "--dtype", "float32"], tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr

    tok = gem4.Tokenizer.from_file(d)
    model = gem4.load(d, dtype="float32")
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}]
    ids = encode_prompt(tok, messages, enable_thinking=False)
    ids, media = media_prompt(ids, [decode_video(path.read_bytes(), patch_size=16, pooling=3)],
                              vision=model.vision.config, tokenize=lambda t: tok.encode(t, add_bos=False))
    out = io.StringIO()
    with Engine(model, tok) as engine:
        _stream_chat(engine, tok, ids, SamplingParams(temperature=0, top_k=64, top_p=0.95, max_tokens=6), out, media)
    assert proc.stdout == out.getvalue() and len(media) == 4
    m = STATS.search(proc.stderr)
    assert m and int(m.group(1)) == len(ids)

    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"no video here")
    proc = run_cli(["run", str(d), "--video", str(broken), "-p", "x", "-n", "2"], tmp_path / "cache")
    assert proc.returncode == 2 and f"--video {broken}: the video cannot be decoded" in proc.stderr
