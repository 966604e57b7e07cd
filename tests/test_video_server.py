"""Videos through the server (docs/multimodal.md §6), with the official `openai` client: a chat `video_url` part
(vLLM's shape) holding a base64 data URI gives the engine's tokens for the same prompt and frames, the frames' soft
tokens and timestamps count in usage; undecodable videos, URLs and a model without video get 400s naming the part.
The model is the tiny 31B-like vision model with a 512-token real vocabulary whose ids 500-503 are the image and
video tokens."""
from __future__ import annotations

import base64

import httpx
import pytest

import gem4
from gem4 import SamplingParams
from gem4.chat import encode_prompt
from gem4.engine.media import media_prompt
from gem4.media.video import decode
from gem4.parser import Gemma4Parser
from gem4.server import ServerConfig, create_app
from server_helpers import API_KEY, InProcessServer, assert_openai_error, client_for, serve_checkpoint
from test_video import make_clip
from text_fixtures import templates, tiny_vocab, write_hf_dir
from vision_fixtures import TOKEN_IDS, build_vision_hf

CONTROL = 3
MAX_MODEL_LEN = 1024


def video_tokenizer_dir(directory):
    """The tiny real vocabulary with ids 500-503 turned into <|image|>, <|image>, <image|>, <|video|> (CONTROL)."""
    tokens, types, merges = tiny_vocab()
    for name, text in (("image_token_id", "<|image|>"), ("boi_token_id", "<|image>"), ("eoi_token_id", "<image|>"),
                       ("video_token_id", "<|video|>")):
        tokens[TOKEN_IDS[name]], types[TOKEN_IDS[name]] = text, CONTROL
    present = set(tokens)
    merges = [m for m in merges if all(x in present for x in (*m.split(" ", 1), m.replace(" ", "", 1)))]
    return write_hf_dir(directory, tokens, types, merges, chat_template=templates()["C"], template_file=True)


def data_uri(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def ask(uri: str, question: str = "What happens?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def video_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("video-server") / "model"
    build_vision_hf("31b").save_pretrained(d)
    video_tokenizer_dir(d)
    with serve_checkpoint(d, "vision", MAX_MODEL_LEN) as served:
        yield served


def oracle(model, tok, messages, clip, max_tokens=8):
    """The engine alone on the same prompt: the template with a video part, its placeholder expanded."""
    engine = gem4.Engine(model, tok, max_model_len=MAX_MODEL_LEN, prefill_chunk=512, enable_prefix_caching=False)
    parts = [{"type": "video"} if p["type"] == "video_url" else p for p in messages[0]["content"]]
    ids = encode_prompt(tok, [{"role": "user", "content": parts}], enable_thinking=False)
    video = decode(clip, patch_size=16, pooling=3)
    ids, media = media_prompt(ids, [video], vision=model.vision.config,
                              tokenize=lambda t: tok.encode(t, add_bos=False))
    events = list(engine.submit(ids, SamplingParams(temperature=0, max_tokens=max_tokens), media=media))
    parser = Gemma4Parser(tok, prompt_ids=ids, tool_names=frozenset())
    parser.feed([e.token_id for e in events if e.token_id is not None])
    parser.finish()
    return parser.result.content, ids, media


def test_chat_with_a_video_matches_the_engine(video_server):
    base, model, tok = video_server
    clip = make_clip(frames=5, fps=2)
    messages = ask(data_uri(clip))
    client = client_for(base)
    r = client.chat.completions.create(model="vision", messages=messages, temperature=0, max_tokens=8)
    want, ids, media = oracle(model, tok, messages, clip)
    assert len(media) == 5 and all(m.kind == "video" for m in media)
    assert (r.choices[0].message.content or "") == (want or "")
    assert r.usage.prompt_tokens == len(ids)
    # the timestamps are in the prompt: 00:00 00:00 00:01 00:01 00:02 at 2 fps
    assert tok.encode("00:02 ", add_bos=False) == ids[media[4].start - 1 - len(tok.encode("00:02 ", add_bos=False)):
                                                      media[4].start - 1]


@pytest.mark.parametrize("url, fragment, param", [
    (data_uri(b"\x00\x01 not a video"), "cannot be decoded", "messages[0].content[0]"),
    ("data:video/mp4;base64,@@@", "not valid base64", "messages[0].content[0]"),
    ("https://example.com/clip.mp4", "does not fetch media URLs", "messages[0].content[0]"),
    ("data:image/png;base64,AAAA", "takes base64 data URIs of videos", "any"),
    (None, "needs 'input_video'", "any"),
])
def test_bad_videos_are_400s_naming_the_part(video_server, url, fragment, param):
    base, _, _ = video_server
    messages = ask(url) if url is not None else [{"role": "user", "content": [{"type": "input_video",
                                                                                "input_video": {"url": "x"}}]}]
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "vision", "messages": messages, "max_tokens": 2}, timeout=30)
    err = assert_openai_error(r, 400, param=param)
    assert fragment in err["message"]
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_a_model_without_video_refuses_it(tmp_path):
    d = tmp_path / "model"
    hf = build_vision_hf("31b")
    hf.config.video_token_id = None
    hf.save_pretrained(d)
    video_tokenizer_dir(d)
    engine = gem4.Engine(gem4.load(d, dtype="float32"), gem4.Tokenizer.from_file(d), max_model_len=MAX_MODEL_LEN)
    app = create_app(ServerConfig(served_model_name="v", api_key=API_KEY), engine)
    with InProcessServer(app) as base:
        r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "v", "max_tokens": 2, "messages": ask(data_uri(make_clip(frames=3)))},
                       timeout=30)
        err = assert_openai_error(r, 400, param="messages[0].content[0]")
        assert "does not take videos" in err["message"]


def test_llama_servers_input_video_is_the_same_video(video_server):
    base, model, tok = video_server
    clip = make_clip(frames=4, fps=2, shift=5)
    client = client_for(base)
    answers = [client.chat.completions.create(model="vision", messages=m, temperature=0, max_tokens=6, logprobs=True)
               for m in (ask(data_uri(clip)),
                         [{"role": "user", "content": [
                             {"type": "input_video", "input_video": {"data": base64.b64encode(clip).decode()}},
                             {"type": "text", "text": "What happens?"}]}])]
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens
    # the second is served from the prefix cache the first filled: the same tokens, logprobs within float32 noise
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert [t.logprob for t in answers[1].choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in answers[0].choices[0].logprobs.content], rel=1e-5, abs=1e-6)


def test_tokenize_counts_the_frames_and_timestamps(video_server):
    base, model, tok = video_server
    clip = make_clip(frames=3, fps=1)
    r = httpx.post(base + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30,
                   json={"model": "vision", "messages": ask(data_uri(clip))})
    assert r.status_code == 200, r.text
    _, ids, media = oracle(model, tok, ask(data_uri(clip)), clip, max_tokens=1)
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids) and len(media) == 3
