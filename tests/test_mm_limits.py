"""--limit-mm-per-prompt (vLLM's flag, docs/server.md *Media limits*): the most image / video / audio parts one request
may carry. A request with more gets a 400 naming the first part past the limit (`messages[i].content[j]`) and the
cause, before any part is fetched or decoded; within the limit it is served as before. The flag takes vLLM's JSON
object and refuses anything else in one line. The model is test_vision_server's tiny 31B-like vision model."""
from __future__ import annotations

import argparse

import httpx
import pytest

from gem4.argtypes import ArgParser
from gem4.server.inputs import DEFAULT_MM_LIMIT, parse_mm_limits
from gem4.server.main import add_arguments, limit_mm_per_prompt, server_config
from server_helpers import API_KEY, assert_openai_error, client_for, serve_checkpoint
from test_vision_server import MAX_MODEL_LEN, data_uri, vision_tokenizer_dir
from vision_fixtures import build_vision_hf, sample_image

UNDECODABLE = "data:image/png;base64,bm90IGFuIGltYWdl"          # "not an image"


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mm-limits") / "model"
    build_vision_hf("31b").save_pretrained(d)
    vision_tokenizer_dir(d)
    with serve_checkpoint(d, "vision", MAX_MODEL_LEN, limit_mm_per_prompt=parse_mm_limits('{"image": 2}')) as served:
        yield served


def chat(base: str, *parts: dict) -> httpx.Response:
    content = [{"type": "text", "text": "Compare them."}, *parts]
    return httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "vision", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
                            "mm_processor_kwargs": {"max_soft_tokens": 70}}, timeout=60)


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_images_within_the_limit_are_served(limited_server):
    base, _, _ = limited_server
    r = client_for(base).chat.completions.create(
        model="vision", max_tokens=2, extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Compare them."},
                                               image(data_uri(sample_image(96, 96, seed=1))),
                                               image(data_uri(sample_image(96, 96, seed=2)))]}])
    assert r.usage.prompt_tokens > 2 * 36


def test_a_part_past_the_limit_is_a_400_naming_it_before_anything_is_decoded(limited_server):
    """The three images are undecodable, and the first would be refused as such: the count is checked first, so the
    400 names the third part, for the limit."""
    base, _, _ = limited_server
    r = chat(base, image(UNDECODABLE), image(UNDECODABLE), image(UNDECODABLE))
    err = assert_openai_error(r, 400, param="messages[0].content[3]")
    assert "at most 2 image parts may be given in one request, and this is image part 3" in err["message"]
    assert "--limit-mm-per-prompt" in err["message"]
    # within the limit, the same parts get the decoder's 400, naming the first
    r = chat(base, image(UNDECODABLE), image(UNDECODABLE))
    assert "cannot be decoded" in assert_openai_error(r, 400, param="messages[0].content[1]")["message"]
    # the count is per request, over all its messages
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": "vision", "max_tokens": 2, "messages": [
                       {"role": "user", "content": [image(UNDECODABLE), image(UNDECODABLE)]},
                       {"role": "assistant", "content": "Two."},
                       {"role": "user", "content": [{"type": "text", "text": "And this?"}, image(UNDECODABLE)]}]})
    assert_openai_error(r, 400, param="messages[2].content[1]")


def test_a_kind_limited_to_zero_is_refused(tmp_path):
    d = tmp_path / "model"
    build_vision_hf("31b").save_pretrained(d)
    vision_tokenizer_dir(d)
    with serve_checkpoint(d, "vision", MAX_MODEL_LEN, limit_mm_per_prompt=parse_mm_limits('{"image": 0}')) as (base, _, _):
        r = chat(base, image(UNDECODABLE))
        err = assert_openai_error(r, 400, param="messages[0].content[1]")
        assert "this server takes no image parts (--limit-mm-per-prompt)" in err["message"]


def test_the_flag_takes_vllms_json_and_refuses_the_rest():
    parser = ArgParser()
    add_arguments(parser)
    assert server_config(parser.parse_args(["m"]), ["m"]).limit_mm_per_prompt == {}
    args = parser.parse_args(["m", "--limit-mm-per-prompt", '{"image": 4, "video": 1, "audio": 2}'])
    assert server_config(args, ["m"]).limit_mm_per_prompt == {"image": 4, "video": 1, "audio": 2}
    assert parse_mm_limits('{"audio": 0}') == {"image": DEFAULT_MM_LIMIT, "video": DEFAULT_MM_LIMIT, "audio": 0}
    for text, fragment in [('{"images": 4}', "unknown kind 'images'"), ('{"image": -1}', "integer >= 0"),
                           ('{"image": 1.5}', "integer >= 0"), ('{"image": true}', "integer >= 0"),
                           ('[4]', "JSON object"), ("image=4", "not JSON")]:
        with pytest.raises(argparse.ArgumentTypeError, match=fragment):
            limit_mm_per_prompt(text)
    with pytest.raises(SystemExit) as stop:                    # `gem4 serve`: one line, exit 2, before any load
        parser.parse_args(["m", "--limit-mm-per-prompt", '{"images": 4}'])
    assert stop.value.code == 2
