"""Images through the server (docs/multimodal.md §6), with the official `openai` client: a chat `image_url` part
holding a base64 data URI, streamed and not, gives the engine's tokens for the same prompt and images; the
image's soft tokens count in usage; a second question about the same image is a prefix-cache hit, another image
behind the same placeholders is not; bad images, URLs and budgets get 400s naming the part; a text-only model
refuses images. The model is the tiny 31B-like vision model of test_vision.py with a 512-token real vocabulary
whose ids 500-502 are the image tokens."""
from __future__ import annotations

import base64
import io
import shutil

import httpx
import pytest

import gem4
from gem4 import SamplingParams
from gem4.chat import encode_prompt
from gem4.engine.media import image_prompt
from gem4.media.image import preprocess
from gem4.parser import Gemma4Parser
from gem4.server import ServerConfig, create_app
from server_helpers import API_KEY, InProcessServer, assert_openai_error, client_for, serve_checkpoint
from text_fixtures import templates, tiny_tokenizer_dir, tiny_vocab, write_hf_dir
from vision_fixtures import TOKEN_IDS, build_vision_hf, sample_image

CONTROL = 3
MAX_MODEL_LEN = 1024


def vision_tokenizer_dir(directory):
    """The tiny real vocabulary with ids 500-502 turned into <|image|>, <|image>, <image|> (CONTROL)."""
    tokens, types, merges = tiny_vocab()
    for name, text in (("image_token_id", "<|image|>"), ("boi_token_id", "<|image>"), ("eoi_token_id", "<image|>")):
        tokens[TOKEN_IDS[name]], types[TOKEN_IDS[name]] = text, CONTROL
    present = set(tokens)
    merges = [m for m in merges if all(x in present for x in (*m.split(" ", 1), m.replace(" ", "", 1)))]
    return write_hf_dir(directory, tokens, types, merges, chat_template=templates()["C"], template_file=True)


def data_uri(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def ask(uri: str, question: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": question},
                                         {"type": "image_url", "image_url": {"url": uri}}]}]


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision-server") / "model"
    build_vision_hf("31b").save_pretrained(d)
    vision_tokenizer_dir(d)
    with serve_checkpoint(d, "vision", MAX_MODEL_LEN) as served:
        yield served


def oracle(model, tok, messages, image, budget=280, max_tokens=8):
    """The engine alone on the same prompt: the template with an image part, its placeholder expanded."""
    engine = gem4.Engine(model, tok, max_model_len=MAX_MODEL_LEN, prefill_chunk=512, enable_prefix_caching=False)
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in messages[0]["content"]]
    ids = encode_prompt(tok, [{"role": "user", "content": parts}], enable_thinking=False)
    ids, media = image_prompt(ids, model.vision.config, [preprocess(image, budget, patch_size=16, pooling=3)])
    events = list(engine.submit(ids, SamplingParams(temperature=0, max_tokens=max_tokens), media=media))
    parser = Gemma4Parser(tok, prompt_ids=ids, tool_names=frozenset())
    parser.feed([e.token_id for e in events if e.token_id is not None])
    parser.finish()
    return parser.result.content, ids, media


def test_chat_with_an_image_matches_the_engine(vision_server):
    base, model, tok = vision_server
    image = sample_image(150, 200, seed=3)
    messages = ask(data_uri(image))
    client = client_for(base)
    r = client.chat.completions.create(model="vision", messages=messages, temperature=0, max_tokens=8,
                                       extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}})
    want, ids, media = oracle(model, tok, messages, image, budget=70)
    assert (r.choices[0].message.content or "") == (want or "")
    assert r.usage.prompt_tokens == len(ids) and media[0].num_tokens <= 70
    stream = client.chat.completions.create(model="vision", messages=messages, temperature=0, max_tokens=8,
                                            stream=True, extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (want or "")
    # the picture is what the model reads: another one changes the first token's distribution
    logprobs = [client.chat.completions.create(model="vision", messages=ask(data_uri(img)), temperature=0,
                                               max_tokens=1, logprobs=True, top_logprobs=5,
                                               extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}})
                .choices[0].logprobs.content[0].top_logprobs for img in (image, sample_image(150, 200, seed=8))]
    assert [(t.token, t.logprob) for t in logprobs[0]] != [(t.token, t.logprob) for t in logprobs[1]]


def test_a_second_question_about_the_same_image_hits_the_prefix_cache(vision_server):
    base, model, tok = vision_server
    image = sample_image(160, 120, seed=4)
    client = client_for(base)
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}},
                                          {"type": "text", "text": "Describe it."}]}]
    client.chat.completions.create(model="vision", messages=first, temperature=0, max_tokens=2)
    second = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}},
                                           {"type": "text", "text": "What colour is it?"}]}]
    warm = client.chat.completions.create(model="vision", messages=second, temperature=0, max_tokens=6)
    want, ids, media = oracle(model, tok, second, image, max_tokens=6)
    assert warm.usage.prompt_tokens_details.cached_tokens >= media[0].end
    assert (warm.choices[0].message.content or "") == (want or "")
    other = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(sample_image(160, 120, seed=5))}},
                                          {"type": "text", "text": "What colour is it?"}]}]
    miss = client.chat.completions.create(model="vision", messages=other, temperature=0, max_tokens=2)
    assert miss.usage.prompt_tokens_details.cached_tokens <= media[0].start


@pytest.mark.parametrize("url, fragment", [
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot be decoded"),
    ("data:image/png;base64,@@@", "not valid base64"),
])
def test_bad_images_are_400s_naming_the_part(vision_server, url, fragment):
    base, _, _ = vision_server
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "vision", "messages": ask(url), "max_tokens": 2}, timeout=30)
    err = assert_openai_error(r, 400, param="messages[0].content[1]")
    assert fragment in err["message"]


@pytest.mark.parametrize("body, param, fragment", [
    (lambda: {"messages": ask("https://example.com/cat.png")}, "messages[0].content[1]", "does not fetch media URLs"),
    (lambda: {"messages": ask("ftp://example.com/cat.png")}, "any", "takes base64 data URIs of images"),
    (lambda: {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_uri(
        sample_image(32, 32))}}]}, {"role": "user", "content": "hi"}]}, "any", "user messages only"),
    (lambda: {"messages": ask(data_uri(sample_image(64, 64))), "mm_processor_kwargs": {"max_soft_tokens": 256}},
     "mm_processor_kwargs", "must be one of"),
    (lambda: {"messages": ask(data_uri(sample_image(64, 64))), "mm_processor_kwargs": {"size": 3}},
     "mm_processor_kwargs", "unknown key 'size'"),
])
def test_bad_image_requests_are_400s(vision_server, body, param, fragment):
    base, _, _ = vision_server
    body = body()
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "vision", "max_tokens": 2, **body}, timeout=30)
    err = assert_openai_error(r, 400, param=param)
    assert fragment in err["message"]
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_a_text_only_model_refuses_images(variants, tmp_path):
    d = tmp_path / "text"
    shutil.copytree(variants["dense_plain"].hf_causal, d)
    for f in tiny_tokenizer_dir().iterdir():
        shutil.copy(f, d / f.name)
    engine = gem4.Engine(gem4.load(d, dtype="float32"), gem4.Tokenizer.from_file(d), max_model_len=256)
    app = create_app(ServerConfig(served_model_name="text", api_key=API_KEY), engine)
    with InProcessServer(app) as base:
        r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "text", "max_tokens": 2, "messages": ask(data_uri(sample_image(32, 32)))},
                       timeout=30)
        err = assert_openai_error(r, 400, param="messages[0].content[1]")
        assert "does not take images" in err["message"]


def test_tokenize_counts_the_soft_tokens(vision_server):
    base, model, tok = vision_server
    image = sample_image(150, 200, seed=3)
    r = httpx.post(base + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30,
                   json={"model": "vision", "messages": ask(data_uri(image)),
                         "mm_processor_kwargs": {"max_soft_tokens": 140}})
    assert r.status_code == 200, r.text
    _, ids, media = oracle(model, tok, ask(data_uri(image)), image, budget=140, max_tokens=1)
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids) and media[0].num_tokens > 100


def test_a_vision_model_takes_bodies_big_enough_for_photos(vision_server):
    """A few-MB photo as a data URI passes the default body limit of a model with a vision tower (the text
    limit, 1 MiB + 64 B a token, would refuse it)."""
    import numpy as np
    from PIL import Image

    from gem4.server.inputs import IMAGE_BODY_BYTES, default_body_limit

    base, _, _ = vision_server
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1100, 1100, 3), dtype=np.uint8))
    uri = data_uri(noise)                              # ~3.6 MB of PNG that does not compress, 4.8 MB as base64
    assert len(uri) > default_body_limit(MAX_MODEL_LEN) and len(uri) < IMAGE_BODY_BYTES
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": "vision", "messages": ask(uri), "max_tokens": 1,
                         "mm_processor_kwargs": {"max_soft_tokens": 70}})
    assert r.status_code == 200, r.text


def test_an_image_too_wide_for_the_tower_is_a_400(vision_server):
    base, _, _ = vision_server
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30,
                   json={"model": "vision", "max_tokens": 2, "messages": ask(data_uri(sample_image(20, 2000)))})
    err = assert_openai_error(r, 400, param="messages[0].content[1]")
    assert "wider or taller than this tower's 64 positions" in err["message"]


def test_responses_and_messages_take_images_as_chat_does(vision_server):
    """An image in a Responses `input_image` part and in a Messages `image` block (base64 source) is the chat
    `image_url` part: the same prompt (input tokens), the same greedy reply, streamed or not."""
    base, model, tok = vision_server
    image = sample_image(150, 200, seed=3)
    uri = data_uri(image)
    want, ids, _ = oracle(model, tok, ask(uri), image, max_tokens=8)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    client = client_for(base)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                          {"type": "input_image", "image_url": uri, "detail": "auto"}]}]
    r = client.responses.create(model="vision", input=items, temperature=0, max_output_tokens=8, store=False)
    assert r.output_text == (want or "") and r.usage.input_tokens == len(ids)
    events = client.responses.create(model="vision", input=items, temperature=0, max_output_tokens=8, store=False,
                                     stream=True)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (want or "")
    media_type, _, data = uri.removeprefix("data:").partition(";base64,")
    blocks = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}]}]
    m = httpx.post(base + "/v1/messages", headers=headers, timeout=60,
                   json={"model": "vision", "max_tokens": 8, "temperature": 0, "messages": blocks})
    assert m.status_code == 200, m.text
    assert "".join(b["text"] for b in m.json()["content"] if b["type"] == "text") == (want or "")
    usage = m.json()["usage"]                        # Anthropic's input_tokens leave out the cached ones
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids)
    count = httpx.post(base + "/v1/messages/count_tokens", headers=headers, timeout=60,
                       json={"model": "vision", "messages": blocks})
    assert count.json() == {"input_tokens": len(ids)}


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "data:image/png;base64,bm90"}]}]},
     "input[0].content[1]", "cannot be decoded"),
    ("/v1/responses", {"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/cat.png"}]}]},
     "input[1].content[0]", "does not fetch media URLs"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].image_url", "no Files API"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "input[0].content[0].type", "input_file"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90"}}]}]},
     "messages[0].content[2]", "cannot be decoded"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]},
     "messages[0].content[0]", "does not fetch media URLs"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "file-1"}}]}]},
     "messages[0].content[0].source", "no Files API"),
])
def test_bad_images_on_responses_and_messages_name_their_field(vision_server, path, body, param, fragment):
    base, _, _ = vision_server
    r = httpx.post(base + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30,
                   json={"model": "vision", "max_tokens" if path == "/v1/messages" else "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param", param) == param and fragment in err["message"], err
    if path == "/v1/messages":             # Anthropic's envelope has no param: the message names the field
        assert param in err["message"], err
    assert httpx.get(base + "/health", timeout=10).status_code == 200
