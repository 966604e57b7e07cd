"""Audio through the server (docs/multimodal.md §6), with the official `openai` client: a chat `input_audio` part
(`{"data": base64, "format": "wav"}`, OpenAI's shape), streamed and not, gives the engine's tokens for the same
prompt and clip; the clip's soft tokens count in usage and in /tokenize; a second question about the same clip is a
prefix-cache hit, another clip behind the same placeholders is not; undecodable, too long and too short clips, and
a model without audio, get 400s naming the part. The model is audio_fixtures' tiny E2B-like one with a 512-token
real vocabulary whose ids 504-506 are the audio tokens."""
from __future__ import annotations

import base64
import io
import shutil

import httpx
import numpy as np
import pytest
import soundfile

import gem4
from gem4 import SamplingParams
from gem4.chat import encode_prompt
from gem4.engine.media import media_prompt
from gem4.media.audio import decode_audio
from gem4.parser import Gemma4Parser
from gem4.server import ServerConfig, create_app
from audio_fixtures import build_audio_hf
from server_helpers import API_KEY, InProcessServer, assert_openai_error, client_for, serve_checkpoint
from test_audio_tower import clip
from text_fixtures import templates, tiny_tokenizer_dir, tiny_vocab, write_hf_dir
from vision_fixtures import TOKEN_IDS

CONTROL = 3
MAX_MODEL_LEN = 1024
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


AUDIO_TOKENS = (("audio_token_id", "<|audio|>"), ("boa_token_id", "<|audio>"), ("eoa_token_id", "<audio|>"))
IMAGE_TOKENS = (("image_token_id", "<|image|>"), ("boi_token_id", "<|image>"), ("eoi_token_id", "<image|>"))


def audio_tokenizer_dir(directory, specials=AUDIO_TOKENS):
    """The tiny real vocabulary with ids 504-506 turned into <|audio|>, <|audio>, <audio|> (CONTROL), and whatever
    other `specials` say."""
    tokens, types, merges = tiny_vocab()
    for name, text in specials:
        tokens[TOKEN_IDS[name]], types[TOKEN_IDS[name]] = text, CONTROL
    present = set(tokens)
    merges = [m for m in merges if all(x in present for x in (*m.split(" ", 1), m.replace(" ", "", 1)))]
    return write_hf_dir(directory, tokens, types, merges, chat_template=templates()["C"], template_file=True)


def encoded(wave: np.ndarray, fmt: str = "WAV", rate: int = 16000, subtype: str | None = None) -> str:
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format=fmt, subtype=subtype)
    return base64.b64encode(buf.getvalue()).decode()


def ask(data: str, question: str = "What is this?", fmt: str = "wav") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": question},
                                         {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}]}]


@pytest.fixture(scope="module")
def audio_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio-server") / "model"
    build_audio_hf().save_pretrained(d)
    audio_tokenizer_dir(d)
    with serve_checkpoint(d, "audio", MAX_MODEL_LEN) as served:
        yield served


def oracle(model, tok, messages, data: str, max_tokens=8):
    """The engine alone on the same prompt: the template with an audio part, its placeholder expanded."""
    engine = gem4.Engine(model, tok, max_model_len=MAX_MODEL_LEN, prefill_chunk=512, enable_prefix_caching=False)
    parts = [{"type": "audio"} if p["type"] == "input_audio" else p for p in messages[0]["content"]]
    ids = encode_prompt(tok, [{"role": "user", "content": parts}], enable_thinking=False)
    ids, media = media_prompt(ids, [decode_audio(base64.b64decode(data))], audio=model.audio.config)
    events = list(engine.submit(ids, SamplingParams(temperature=0, max_tokens=max_tokens), media=media))
    parser = Gemma4Parser(tok, prompt_ids=ids, tool_names=frozenset())
    parser.feed([e.token_id for e in events if e.token_id is not None])
    parser.finish()
    return parser.result.content, ids, media


def test_chat_with_a_clip_matches_the_engine(audio_server):
    base, model, tok = audio_server
    data = encoded(clip(24000, seed=3))
    messages = ask(data)
    client = client_for(base)
    r = client.chat.completions.create(model="audio", messages=messages, temperature=0, max_tokens=8)
    want, ids, media = oracle(model, tok, messages, data)
    assert (r.choices[0].message.content or "") == (want or "")
    assert r.usage.prompt_tokens == len(ids) and media[0].num_tokens == 38       # 1.5 s: 149 frames, ceil(149 / 4)
    stream = client.chat.completions.create(model="audio", messages=messages, temperature=0, max_tokens=8,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (want or "")
    # the clip is what the model hears: another one changes the first token's distribution
    logprobs = [client.chat.completions.create(model="audio", messages=ask(d), temperature=0, max_tokens=1,
                                               logprobs=True, top_logprobs=5).choices[0].logprobs.content[0].top_logprobs
                for d in (data, encoded(clip(24000, seed=8)))]
    assert [(t.token, t.logprob) for t in logprobs[0]] != [(t.token, t.logprob) for t in logprobs[1]]



def test_responses_take_a_clip_as_chat_does(audio_server):
    """A Responses `input_audio` part is the chat one: the same prompt and greedy reply."""
    base, model, tok = audio_server
    data = encoded(clip(24000, seed=3))
    want, ids, _ = oracle(model, tok, ask(data), data)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                          {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}]
    r = client_for(base).responses.create(model="audio", input=items, temperature=0, max_output_tokens=8, store=False)
    assert r.output_text == (want or "") and r.usage.input_tokens == len(ids)

def test_an_mp3_clip_is_heard_as_its_decoded_samples(audio_server):
    base, model, tok = audio_server
    data = encoded(clip(16000, seed=6), fmt="MP3")
    r = client_for(base).chat.completions.create(model="audio", messages=ask(data, fmt="mp3"), temperature=0,
                                                 max_tokens=6)
    want, ids, _ = oracle(model, tok, ask(data, fmt="mp3"), data, max_tokens=6)
    assert (r.choices[0].message.content or "") == (want or "") and r.usage.prompt_tokens == len(ids)


def test_a_second_question_about_the_same_clip_hits_the_prefix_cache(audio_server):
    base, model, tok = audio_server
    data = encoded(clip(20000, seed=4))
    client = client_for(base)

    def messages(d, question):
        return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": d, "format": "wav"}},
                                             {"type": "text", "text": question}]}]

    client.chat.completions.create(model="audio", messages=messages(data, "Describe it."), temperature=0, max_tokens=2)
    second = messages(data, "Who is speaking?")
    warm = client.chat.completions.create(model="audio", messages=second, temperature=0, max_tokens=6)
    want, ids, media = oracle(model, tok, second, data, max_tokens=6)
    assert warm.usage.prompt_tokens_details.cached_tokens >= media[0].end
    assert (warm.choices[0].message.content or "") == (want or "")
    miss = client.chat.completions.create(model="audio", messages=messages(encoded(clip(20000, seed=5)),
                                                                           "Who is speaking?"),
                                          temperature=0, max_tokens=2)
    assert miss.usage.prompt_tokens_details.cached_tokens <= media[0].start


def long_wav() -> str:
    """601 s of 8-bit audio at 1 kHz: 600 KB, past the 600 s the server decodes."""
    return encoded((np.random.default_rng(0).random(601_000) - 0.5).astype(np.float32), rate=1000, subtype="PCM_U8")


@pytest.mark.parametrize("data, fragment", [
    (lambda: base64.b64encode(b"not audio at all" * 20).decode(), "could not be decoded"),
    (lambda: "@@@", "not valid base64"),
    (long_wav, "more than the 600 s"),
    (lambda: encoded(clip(100, seed=1)), "too short for one soft token"),
])
def test_bad_clips_are_400s_naming_the_part(audio_server, data, fragment):
    base, _, _ = audio_server
    r = httpx.post(base + "/v1/chat/completions", headers=HEADERS, timeout=60,
                   json={"model": "audio", "messages": ask(data()), "max_tokens": 2})
    err = assert_openai_error(r, 400, param="messages[0].content[1]")
    assert fragment in err["message"]
    assert httpx.get(base + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("body, fragment", [
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]},
     "needs 'input_audio'"),
    ({"messages": [{"role": "system", "content": [{"type": "input_audio", "input_audio": {
        "data": "AAAA", "format": "wav"}}]}, {"role": "user", "content": "hi"}]}, "user messages only"),
])
def test_bad_audio_parts_are_400s(audio_server, body, fragment):
    base, _, _ = audio_server
    r = httpx.post(base + "/v1/chat/completions", headers=HEADERS, json={"model": "audio", "max_tokens": 2, **body},
                   timeout=30)
    assert fragment in assert_openai_error(r, 400)["message"]


def test_a_model_without_audio_refuses_clips(variants, tmp_path):
    d = tmp_path / "text"
    shutil.copytree(variants["dense_plain"].hf_causal, d)
    for f in tiny_tokenizer_dir().iterdir():
        shutil.copy(f, d / f.name)
    engine = gem4.Engine(gem4.load(d, dtype="float32"), gem4.Tokenizer.from_file(d), max_model_len=256)
    app = create_app(ServerConfig(served_model_name="text", api_key=API_KEY), engine)
    with InProcessServer(app) as base:
        r = httpx.post(base + "/v1/chat/completions", headers=HEADERS, timeout=30,
                       json={"model": "text", "max_tokens": 2, "messages": ask(encoded(clip(8000)))})
        err = assert_openai_error(r, 400, param="messages[0].content[1]")
        assert "does not take audio" in err["message"]


def test_tokenize_counts_the_soft_tokens(audio_server):
    base, model, tok = audio_server
    data = encoded(clip(40000, seed=3))
    r = httpx.post(base + "/tokenize", headers=HEADERS, timeout=30, json={"model": "audio", "messages": ask(data)})
    assert r.status_code == 200, r.text
    _, ids, media = oracle(model, tok, ask(data), data, max_tokens=1)
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids) and media[0].num_tokens == 63   # 2.5 s: 249 frames


def test_an_image_and_a_clip_in_one_message(tmp_path):
    """A model with both towers (as E2B/E4B): an input_audio part, an image_url part and text in one message reach
    the template in their order and the engine as the same prompt and media; /tokenize counts both blocks."""
    from gem4.media.image import preprocess
    from test_vision_server import data_uri
    from vision_fixtures import sample_image

    d = tmp_path / "model"
    build_audio_hf(seed=9, vision=True).save_pretrained(d)
    audio_tokenizer_dir(d, AUDIO_TOKENS + IMAGE_TOKENS)
    model, tok = gem4.load(d, dtype="float32"), gem4.Tokenizer.from_file(d)
    engine = gem4.Engine(model, tok, max_model_len=MAX_MODEL_LEN, prefill_chunk=512, block_size=4)
    app = create_app(ServerConfig(served_model_name="both", api_key=API_KEY,
                                  default_chat_template_kwargs={"enable_thinking": False}), engine)
    image, data = sample_image(96, 144, seed=2), encoded(clip(12000, seed=3))
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
        {"type": "image_url", "image_url": {"url": data_uri(image)}},
        {"type": "text", "text": "What do you see and hear?"}]}]
    ids = encode_prompt(tok, [{"role": "user", "content": [{"type": "audio"}, {"type": "image"}, messages[0][
        "content"][2]]}], enable_thinking=False)
    ids, media = media_prompt(ids, [decode_audio(base64.b64decode(data)), preprocess(image, 280, patch_size=16,
                                                                                     pooling=3)],
                              vision=model.vision.config, audio=model.audio.config)
    alone = gem4.Engine(model, tok, max_model_len=MAX_MODEL_LEN, prefill_chunk=512, enable_prefix_caching=False)
    events = list(alone.submit(ids, SamplingParams(temperature=0, max_tokens=6), media=media))
    parser = Gemma4Parser(tok, prompt_ids=ids, tool_names=frozenset())
    parser.feed([e.token_id for e in events if e.token_id is not None])
    parser.finish()
    with InProcessServer(app) as base:
        r = client_for(base).chat.completions.create(model="both", messages=messages, temperature=0, max_tokens=6)
        assert (r.choices[0].message.content or "") == (parser.result.content or "")
        assert r.usage.prompt_tokens == len(ids) and [m.kind for m in media] == ["audio", "image"]
        t = httpx.post(base + "/tokenize", headers=HEADERS, timeout=30, json={"model": "both", "messages": messages})
        assert t.json()["tokens"] == ids
