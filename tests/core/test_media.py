"""Image inputs (issue 29): media loading from data/http/file URLs with its limits, and OpenAI content parts ->
HF chat-template messages plus the ordered images (multimodal/media.py, multimodal/content_parts.py).

The http cases run against a real HTTP server on 127.0.0.1 (tests/support/media_server.py); images are made here
with PIL and compared pixel for pixel after the round trip.
"""

from __future__ import annotations

import asyncio
import io
import os
import time

import pytest
from media_server import MediaServer, data_url, huge_png_header, png_bytes
from PIL import Image

from pagedllm.errors import ParamError
from pagedllm.multimodal.content_parts import (DEFAULT_LIMIT_PER_PROMPT, parse_chat_messages,
                                               parse_limit_mm_per_prompt)
from pagedllm.multimodal.media import MediaConnector, MediaError, decode_image

F = "messages[0].content[1].image_url.url"


@pytest.fixture(scope="module")
def media():
    with MediaServer(big_bytes=300_000, slow_s=30.0) as srv:
        yield srv


def _refused(code: str, call, field: str = F) -> MediaError:
    with pytest.raises(MediaError) as e:
        call()
    assert e.value.code == code and e.value.field == field, (e.value.code, e.value.field, str(e.value))
    assert isinstance(e.value, ValueError) and str(e.value).startswith(f"{field}: ")
    return e.value


def _load(conn: MediaConnector, url: str):
    return asyncio.run(conn.load_image_async(url, F))


def _same_pixels(img, size, color) -> None:
    assert img.mode == "RGB" and img.size == size
    assert img.getcolors() == [(size[0] * size[1], color)]


# ---- data: URLs and decoding --------------------------------------------------------------------------------------
def test_data_url_round_trip_and_rgb_conversion():
    conn = MediaConnector()
    _same_pixels(_load(conn, data_url(png_bytes((7, 5), (10, 20, 30)))), (7, 5), (10, 20, 30))
    # transparency goes over white (vLLM's default background); greyscale and JPEG become RGB
    _same_pixels(conn.load_image(data_url(png_bytes((4, 4), (255, 0, 0, 0), "RGBA")), F), (4, 4), (255, 255, 255))
    assert conn.load_image(data_url(png_bytes((3, 3), 128, "L")), F).getpixel((0, 0)) == (128, 128, 128)
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 0, 255)).save(buf, "JPEG")
    assert conn.load_image(data_url(buf.getvalue(), "image/jpeg"), F).size == (16, 16)


def test_bad_data_urls_are_refused():
    conn = MediaConnector()
    _refused("invalid_image", lambda: conn.load_image("data:image/png;base64,!!!not base64!!!", F))
    _refused("invalid_image", lambda: conn.load_image("data:image/png,rawbytes", F))  # base64 only
    _refused("invalid_image", lambda: conn.load_image("data:image/png;base64", F))  # no comma
    _refused("unsupported_media_type", lambda: conn.load_image(data_url(b"RIFF....", "audio/wav"), F))
    _refused("invalid_media_url", lambda: conn.load_image("ftp://example.com/a.png", F))
    _refused("invalid_media_url", lambda: conn.load_image("", F))
    small = MediaConnector(max_bytes=1000)
    _refused("media_too_large", lambda: small.load_image(data_url(os.urandom(4000)), F))


def test_corrupt_and_truncated_images_are_refused():
    _refused("invalid_image", lambda: decode_image(b"definitely not an image", F))
    png = png_bytes((64, 64), (1, 2, 3))
    _refused("invalid_image", lambda: decode_image(png[: len(png) // 2], F))
    buf = io.BytesIO()
    Image.effect_noise((128, 128), 64).convert("RGB").save(buf, "JPEG")
    _refused("invalid_image", lambda: decode_image(buf.getvalue()[: buf.tell() // 2], F))
    bad_crc = bytearray(png)
    assert png[37:41] == b"IDAT"
    bad_crc[45] ^= 0xFF  # inside the IDAT data: its CRC no longer matches
    _refused("invalid_image", lambda: decode_image(bytes(bad_crc), F))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"  # PIL could open it only through Ghostscript
    _refused("invalid_image", lambda: decode_image(eps, F))


@pytest.mark.parametrize("width,height", [(10_000, 10_000), (20_000, 20_000)])  # 100 MP; past PIL's bomb limit
def test_huge_dimensions_are_refused_from_the_header(width, height):
    """Refused from the header: decoding 100-400 MP would take 100-400 MB and seconds."""
    data = huge_png_header(width, height)
    assert len(data) < 200
    t0 = time.monotonic()
    err = _refused("image_too_large", lambda: decode_image(data, F))
    assert time.monotonic() - t0 < 5.0
    assert "--max-image-pixels" in str(err)


def test_pixel_limit_is_the_operators():
    data = png_bytes((8, 6))
    assert decode_image(data, F, max_pixels=48).size == (8, 6)
    _refused("image_too_large", lambda: decode_image(data, F, max_pixels=47))


# ---- http(s) ------------------------------------------------------------------------------------------------------
def test_http_fetch(media):
    conn = MediaConnector(allowed_media_domains=["127.0.0.1"])
    _same_pixels(_load(conn, media.url("/img.png")), (8, 6), (200, 30, 40))
    _same_pixels(conn.load_image(media.url("/img.png"), F), (8, 6), (200, 30, 40))  # the offline (blocking) path
    _same_pixels(_load(MediaConnector(max_redirects=2), media.url("/hops/2")), (8, 6), (200, 30, 40))


def test_a_hanging_fetch_is_cut_at_the_timeout(media):
    conn = MediaConnector(fetch_timeout=0.5)
    t0 = time.monotonic()
    _refused("media_fetch_timeout", lambda: _load(conn, media.url("/slow")))
    assert time.monotonic() - t0 < 10.0  # far below the endpoint's 30 s


def test_oversized_bodies_are_refused(media):
    conn = MediaConnector(max_bytes=100_000)
    _refused("media_too_large", lambda: _load(conn, media.url("/big")))  # by its Content-Length, unread
    _refused("media_too_large", lambda: _load(conn, media.url("/big-chunked")))  # read up to the limit only


def test_redirect_limits(media):
    conn = MediaConnector(max_redirects=2)
    _refused("media_too_many_redirects", lambda: _load(conn, media.url("/loop")))
    _refused("media_too_many_redirects", lambda: _load(conn, media.url("/hops/3")))


def test_domains_outside_the_allowed_list_are_never_fetched(media):
    before = media.hits["/img.png"]
    conn = MediaConnector(allowed_media_domains=["images.example.com"])
    _refused("media_domain_not_allowed", lambda: _load(conn, media.url("/img.png")))
    # a redirect may not leave the list either: /away sends the client to localhost (another host name)
    conn = MediaConnector(allowed_media_domains=["127.0.0.1"])
    _refused("media_domain_not_allowed", lambda: _load(conn, media.url("/away")))
    assert media.hits["/img.png"] == before and media.hits["/away"] >= 1
    # the match is on the host name, case-insensitively
    assert _load(MediaConnector(allowed_media_domains=["LOCALHOST"]), media.url("/img.png", "localhost"))


def test_fetching_can_be_turned_off(media):
    before = sum(media.hits.values())
    conn = MediaConnector(enable_fetch=False)
    _refused("media_fetch_disabled", lambda: _load(conn, media.url("/img.png")))
    assert sum(media.hits.values()) == before
    assert conn.load_image(data_url(png_bytes()), F).size == (8, 6)  # data: URLs still work


def test_fetch_errors_are_refusals(media):
    conn = MediaConnector()
    _refused("media_fetch_failed", lambda: _load(conn, media.url("/missing")))
    _refused("invalid_image", lambda: _load(conn, media.url("/corrupt.png")))
    with MediaServer() as gone:
        url = gone.url("/img.png")
    _refused("media_fetch_failed", lambda: _load(conn, url))  # connection refused


def test_many_images_load_in_order(media):
    """More images than load at once (LOADS_PER_REQUEST): all come back, in request order."""
    from pagedllm.multimodal.content_parts import ChatInputs, ImageItem
    from pagedllm.multimodal.media import LOADS_PER_REQUEST

    colors = [(i * 20, 0, 255 - i * 20) for i in range(LOADS_PER_REQUEST + 4)]
    items = [ImageItem(f"f{i}", url=data_url(png_bytes((2, 2), c)) if i % 3 else media.url("/img.png"))
             for i, c in enumerate(colors)]
    out = asyncio.run(ChatInputs([], items).load_images_async(MediaConnector()))
    assert [im.getpixel((0, 0)) for im in out] == [c if i % 3 else (200, 30, 40) for i, c in enumerate(colors)]


def test_one_failure_cancels_the_other_loads(media):
    """Two images, one slow and one corrupt: the corrupt one's error comes at once and the slow fetch does not
    outlive the call."""
    from pagedllm.multimodal.content_parts import ChatInputs, ImageItem

    async def run():
        chat = ChatInputs([], [ImageItem("a", url=media.url("/slow")),
                               ImageItem("b", url=data_url(b"corrupt"))])
        t0 = time.monotonic()
        with pytest.raises(MediaError) as e:
            await chat.load_images_async(MediaConnector(fetch_timeout=20))
        assert e.value.field == "b" and time.monotonic() - t0 < 10
        assert asyncio.all_tasks() == {asyncio.current_task()}  # nothing left running

    asyncio.run(run())


# ---- file: URLs ---------------------------------------------------------------------------------------------------
def test_file_urls_only_under_the_allowed_folder(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png_bytes((3, 2), (9, 9, 9)))
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    os.mkfifo(inside / "fifo.png")
    conn = MediaConnector(allowed_local_media_path=str(inside))
    _same_pixels(conn.load_image(f"file://{inside}/a.png", F), (3, 2), (9, 9, 9))
    _same_pixels(_load(conn, f"file://{inside}/a.png"), (3, 2), (9, 9, 9))
    for url in (f"file://{tmp_path}/secret.png", f"file://{inside}/../secret.png", f"file://{inside}/link.png",
                "file:///etc/passwd", f"file://otherhost{inside}/a.png"):
        _refused("local_media_not_allowed", lambda: conn.load_image(url, F))
    _refused("local_media_not_found", lambda: conn.load_image(f"file://{inside}/missing.png", F))
    _refused("local_media_not_found", lambda: conn.load_image(f"file://{inside}/fifo.png", F))  # never blocks
    _refused("local_media_not_found", lambda: conn.load_image(f"file://{inside}", F))  # a folder
    _refused("local_media_not_allowed", lambda: MediaConnector().load_image(f"file://{inside}/a.png", F))
    _refused("media_too_large", lambda: MediaConnector(allowed_local_media_path=str(inside), max_bytes=10)
             .load_image(f"file://{inside}/a.png", F))
    with pytest.raises(ParamError) as e:
        MediaConnector(allowed_local_media_path=str(inside / "a.png"))  # not a folder: refused at start
    assert e.value.field == "allowed_local_media_path"


# ---- content parts ------------------------------------------------------------------------------------------------
IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _user(*parts) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": list(parts)}]


def test_text_only_models_keep_string_content():
    msgs = _user({"type": "text", "text": "Hello "}, {"type": "text", "text": "there"})
    out = parse_chat_messages(msgs)
    assert out.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]
    assert out.images == []


def test_image_parts_become_hf_entries_in_order():
    png = data_url(png_bytes())
    msgs = _user({"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": png}},
                 {"type": "input_image", "image_url": "http://h/x.png", "detail": "low"}, {"type": "text", "text": "?"})
    msgs.append({"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "name": "bot"})
    out = parse_chat_messages(msgs, frozenset({"image"}))
    assert out.messages[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"},
                                          {"type": "text", "text": "?"}]
    assert out.messages[2] == {"role": "assistant", "content": [{"type": "text", "text": "no"}], "name": "bot"}
    assert [(i.url, i.field, i.detail) for i in out.images] == [
        (png, "messages[1].content[1].image_url.url", None), ("http://h/x.png", "messages[1].content[2].image_url",
                                                              "low")]
    pil = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    out = parse_chat_messages(_user({"type": "image_pil", "image_pil": pil}), frozenset({"image"}))
    assert out.load_images(MediaConnector())[0].getpixel((0, 0)) == (255, 255, 255)


def test_part_refusals_name_the_part():
    def refused(code, field, msgs, modalities=frozenset({"image"}), limit=None):
        return _refused(code, lambda: parse_chat_messages(msgs, modalities, limit), field)

    refused("unsupported_modality", "messages[1].content[0]", _user(IMG), frozenset())
    for kind, extra in (("input_audio", {"input_audio": {"data": "AAAA", "format": "wav"}}),
                        ("audio_url", {"audio_url": {"url": "http://h/a.wav"}}),
                        ("video_url", {"video_url": {"url": "http://h/v.mp4"}}), ("input_file", {"file_id": "f"})):
        err = refused("unsupported_modality", "messages[1].content[1].type",
                      _user({"type": "text", "text": "x"}, {"type": kind, **extra}))
        assert kind in str(err)
    refused("invalid_content_part", "messages[1].content[0].type", _user({"type": "hologram"}))
    refused("invalid_content_part", "messages[1].content[0].type", _user({"text": "no type"}))
    refused("invalid_content_part", "messages[1].content[0]", _user("not a dict"))
    refused("invalid_content_part", "messages[1].content[0].image_url", _user({"type": "image_url"}))
    refused("invalid_content_part", "messages[1].content[0].image_url", _user({"type": "input_image"}))
    refused("invalid_content_part", "messages[1].content[0].file_id", _user({"type": "input_image", "file_id": "f"}))
    refused("invalid_content_part", "messages[1].content[0].text", _user({"type": "text", "text": 3}))
    refused("too_many_images", "messages[1].content[2]", _user(IMG, IMG, IMG), limit={"image": 2})
    refused("too_many_images", "messages[1].content[0]", _user(IMG), limit={"image": 0})
    refused("unsupported_modality", "input[3].content[0]", _user({**IMG, "_field": "input[3].content[0]"}),
            frozenset())
    assert len(parse_chat_messages(_user(IMG, IMG), frozenset({"image"}), {"image": 2}).images) == 2


def test_limit_mm_per_prompt_parsing():
    assert parse_limit_mm_per_prompt(None) == {} and DEFAULT_LIMIT_PER_PROMPT == 999  # vLLM's default
    assert parse_limit_mm_per_prompt('{"image": 3}') == {"image": 3} == parse_limit_mm_per_prompt({"image": 3})
    for bad in ('{"image": -1}', '{"image": true}', '{"smell": 1}', "[1]", "{bad json"):
        with pytest.raises(ParamError) as e:
            parse_limit_mm_per_prompt(bad)
        assert e.value.field == "limit_mm_per_prompt"


def test_engine_prompt_of_a_chat_with_images():
    """What the server and LLM.chat hand the engine (vLLM's prompt dict): the rendered ids, and the images in order
    under multi_modal_data only when there are some (a text chat's prompt is what it was)."""
    from pagedllm.entrypoints.chat_inputs import mm_prompt

    a, b = Image.new("RGB", (2, 2)), Image.new("RGB", (3, 3))
    assert mm_prompt((1, 2, 3), []) == {"prompt_token_ids": [1, 2, 3]}
    p = mm_prompt([5, 6], [a, b])
    assert p["prompt_token_ids"] == [5, 6] and p["multi_modal_data"]["image"] == [a, b]


def test_engine_flags():
    import argparse

    from pagedllm.commands.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "a.com",
                                      "b.org", "--allowed-local-media-path", "/srv/img"]))
    assert cfg.limit_mm_per_prompt == {"image": 2} and cfg.allowed_media_domains == ["a.com", "b.org"]
    assert cfg.allowed_local_media_path == "/srv/img"
    cfg = engine_config(p.parse_args([]))
    assert (cfg.limit_mm_per_prompt, cfg.allowed_media_domains, cfg.allowed_local_media_path) == ({}, None, None)


# ---- offline: LLM.chat ---------------------------------------------------------------------------------------------
def test_llm_chat_parts(tmp_path):
    """Text parts render as the same string content as before (same greedy output); an image sent to this
    text-only model is a ValueError naming the part, before anything is fetched."""
    from server_utils import tiny_chat_model

    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0)
    with LLM(tiny_chat_model(), device="cpu", max_model_len=256, limit_mm_per_prompt={"image": 1}) as llm:
        assert llm.llm_engine.config.limit_mm_per_prompt == {"image": 1}
        plain = llm.chat([{"role": "user", "content": "Hi there"}], sp, use_tqdm=False)[0]
        parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                       {"type": "text", "text": "there"}]}], sp, use_tqdm=False)[0]
        assert parts.prompt_token_ids == plain.prompt_token_ids
        assert parts.outputs[0].token_ids == plain.outputs[0].token_ids
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: this model takes text only"):
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                   {"type": "image_url", "image_url": {"url": "http://h/x.png"}}]}],
                     sp, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ParamError) as e:
        LLM(tiny_chat_model(), device="cpu", limit_mm_per_prompt={"image": "many"})
    assert e.value.field == "limit_mm_per_prompt"
