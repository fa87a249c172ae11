"""Image content parts on the server (issue 29), sent through the official ``openai`` client to real ``pagedllm
serve`` processes: every refusal is a 400 in OpenAI's shape naming the part, nothing stuck or leaked afterwards, and
an accepted image gives the text the offline API gives.

Two servers, started together by one fixture:

* ``text``: the tiny text model, as deployed. Before this issue it answered 200 and silently dropped an image part
  (even a corrupt one); now an image sent to it is refused before anything is fetched, as are audio/video and
  unknown part types.
* ``images``: the tiny random LLaVA (``tests/support/tiny_vlm.py``), with tight limits, so the refusals that need
  an image to be fetched or decoded (limits, timeouts, sizes, redirects, domains, ``file:`` paths, corrupt data)
  are reached, and images it accepts (a data URL, a URL served on 127.0.0.1) run through its vision tower.
"""

from __future__ import annotations

import io
import json
import threading
import time

import httpx
import openai
import psutil
import pytest
from media_server import MediaServer, data_url, huge_png_header, png_bytes
from server_utils import API_KEY, ServerProcess, tiny_chat_model, wait_idle
from tiny_vlm import tiny_llava_model

LIMIT = 2  # --limit-mm-per-prompt
TEXT = {"type": "text", "text": "What is in this image?"}


@pytest.fixture(scope="module")
def media():
    with MediaServer(big_bytes=300_000, slow_s=30.0) as srv:
        yield srv


@pytest.fixture(scope="module")
def servers(media, tmp_path_factory):
    model, vlm = tiny_chat_model(), tiny_llava_model()
    folder = tmp_path_factory.mktemp("media")
    (folder / "ok.png").write_bytes(png_bytes())
    (folder.parent / "outside.png").write_bytes(png_bytes())
    common = ("--max-model-len", "512", "--max-num-queued-reqs", "2", "--render-workers", "1")
    image_args = (*common, "--limit-mm-per-prompt", json.dumps({"image": LIMIT}), "--media-fetch-timeout", "3",
                  "--max-media-bytes", "100000", "--media-max-redirects", "2", "--max-image-pixels", "1000000",
                  "--allowed-local-media-path", str(folder), "--allowed-media-domains", "127.0.0.1")
    started: dict = {}

    def start(name, path, *args):
        try:
            started[name] = ServerProcess(path, *args)
        except BaseException as e:  # noqa: BLE001 - raised below, after both tried
            started[name] = e

    threads = [threading.Thread(target=start, args=("text", model, *common)),
               threading.Thread(target=start, args=("images", vlm, *image_args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [s for s in started.values() if isinstance(s, BaseException)]
    if errors:
        for s in started.values():
            if isinstance(s, ServerProcess):
                s.stop()
        raise errors[0]
    started["images"].folder = folder
    yield started
    for srv in started.values():
        out = srv.output()
        srv.stop()
        assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def text(servers):
    return servers["text"]


@pytest.fixture(scope="module")
def images(servers):
    return servers["images"]


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url_v1, api_key=API_KEY, max_retries=0, timeout=60)


def _refused(srv, content, param: str, code: str, stream: bool = False, role: str = "user") -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        _client(srv).chat.completions.create(model="test-model", max_tokens=2, stream=stream,
                                             messages=[{"role": role, "content": content}])
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error", err
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"].startswith(f"{param}: "), err
    return err


def _image(url: str, kind: str = "image_url") -> dict:
    return {"type": "image_url", "image_url": {"url": url}} if kind == "image_url" else {"type": kind,
                                                                                          "image_url": url}


P1 = "messages[0].content[1]"
URL1 = f"{P1}.image_url.url"


# ---- the text-only model -------------------------------------------------------------------------------------------
def test_images_are_refused_by_a_text_only_model(text, media):
    before = sum(media.hits.values())
    good = data_url(png_bytes())
    for part in (_image(good), _image(media.url("/img.png")), _image(good, "input_image"),
                 _image(data_url(b"corrupt bytes"))):  # the issue: a corrupt image used to be a 200
        err = _refused(text, [TEXT, part], P1, "unsupported_modality")
        assert "text only" in err["message"]
    _refused(text, [TEXT, _image(good)], P1, "unsupported_modality", stream=True)  # before any SSE byte
    assert sum(media.hits.values()) == before  # nothing fetched for a model that cannot use it
    r = httpx.post(f"{text.base_url}/tokenize", headers=text.headers(), timeout=30,
                   json={"messages": [{"role": "user", "content": [TEXT, _image(good)]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == P1, r.text
    with pytest.raises(openai.BadRequestError) as e:  # /v1/responses: param "input", the part's path in the message
        _client(text).responses.create(model="test-model", max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                         {"type": "input_image", "image_url": good}]}])
    assert e.value.body["param"] == "input" and e.value.body["message"].startswith("input[0].content[1]: ")


@pytest.mark.parametrize("srv", ["text", "images"])
def test_unsupported_modalities_and_unknown_parts(servers, srv):
    s = servers[srv]
    for part in ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                 {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1/a.wav"}},
                 {"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}}):
        err = _refused(s, [TEXT, part], f"{P1}.type", "unsupported_modality")
        assert part["type"] in err["message"]
    _refused(s, [TEXT, {"type": "hologram", "text": "x"}], f"{P1}.type", "invalid_content_part")


def test_text_parts_render_as_before(text):
    """A content list of text parts is the string it joins to: same prompt, same greedy output."""
    c = _client(text)
    kw = dict(model="test-model", max_tokens=8, temperature=0)
    plain = c.chat.completions.create(messages=[{"role": "user", "content": "Hello there"}], **kw)
    parts = c.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}], **kw)
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content


# ---- a model that takes images: limits, sources, decoding -----------------------------------------------------------
def test_more_images_than_the_limit(images, media):
    before = sum(media.hits.values())
    url = media.url("/img.png")
    _refused(images, [TEXT] + [_image(url)] * (LIMIT + 1), f"messages[0].content[{LIMIT + 1}]", "too_many_images")
    assert sum(media.hits.values()) == before  # counted before anything is fetched


def test_corrupt_truncated_and_huge_images(images, media):
    png = png_bytes((32, 32))
    _refused(images, [TEXT, _image(data_url(b"\x89PNG but not really"))], URL1, "invalid_image")
    _refused(images, [TEXT, _image(data_url(png[: len(png) // 2]))], URL1, "invalid_image")
    _refused(images, [TEXT, _image(media.url("/corrupt.png"))], URL1, "invalid_image")
    _refused(images, [TEXT, _image(data_url(b"x", "text/plain"))], URL1, "unsupported_media_type")
    err = _refused(images, [TEXT, _image(data_url(huge_png_header(10_000, 10_000)))], URL1, "image_too_large")
    assert "100000000 pixels" in err["message"]  # 100 MP, from its header only
    _refused(images, [TEXT, _image(data_url(huge_png_header(1001, 1000)), "input_image")], f"{P1}.image_url",
             "image_too_large")


def test_a_hanging_fetch_times_out_without_blocking_others(images, media):
    """/slow never answers within --media-fetch-timeout (3 s): 400. While it hangs, other requests are served."""
    before = media.hits["/slow"]
    result: dict = {}

    def hang():
        t0 = time.monotonic()
        try:
            _refused(images, [TEXT, _image(media.url("/slow"))], URL1, "media_fetch_timeout")
            result["ok"] = time.monotonic() - t0
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=hang)
    t.start()
    deadline = time.monotonic() + 10
    while media.hits["/slow"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert media.hits["/slow"] > before
    assert httpx.get(f"{images.base_url}/health", timeout=5).status_code == 200
    assert t.is_alive()  # answered while the fetch hangs
    r = _client(images).chat.completions.create(model="test-model", max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content is not None
    t.join(30)
    assert "error" not in result, result
    assert result["ok"] < 10  # cut at the timeout, not the endpoint's 30 s


def test_fetch_limits(images, media):
    _refused(images, [TEXT, _image(media.url("/big"))], URL1, "media_too_large")
    _refused(images, [TEXT, _image(media.url("/big-chunked"))], URL1, "media_too_large")
    _refused(images, [TEXT, _image(media.url("/loop"))], URL1, "media_too_many_redirects")
    _refused(images, [TEXT, _image(media.url("/hops/3"))], URL1, "media_too_many_redirects")
    _refused(images, [TEXT, _image(media.url("/missing"))], URL1, "media_fetch_failed")


def test_hosts_outside_the_allowed_domains(images, media):
    before = media.hits["/img.png"]
    _refused(images, [TEXT, _image(media.url("/img.png", host="localhost"))], URL1, "media_domain_not_allowed")
    _refused(images, [TEXT, _image(media.url("/away"))], URL1, "media_domain_not_allowed")  # a redirect to it
    _refused(images, [TEXT, _image("http://169.254.169.254/latest/meta-data/")], URL1, "media_domain_not_allowed")
    assert media.hits["/img.png"] == before


def test_file_urls(images):
    folder = images.folder
    _refused(images, [TEXT, _image(f"file://{folder.parent}/outside.png")], URL1, "local_media_not_allowed")
    _refused(images, [TEXT, _image(f"file://{folder}/../outside.png")], URL1, "local_media_not_allowed")
    _refused(images, [TEXT, _image(f"file://{folder}/missing.png")], URL1, "local_media_not_found")
    _refused(images, [TEXT, _image("ftp://127.0.0.1/x.png")], URL1, "invalid_media_url")


def test_responses_input_image(images, media):
    with pytest.raises(openai.BadRequestError) as e:
        _client(images).responses.create(model="test-model", max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                         {"type": "input_image", "image_url": media.url("/corrupt.png")}]}])
    body = e.value.body
    assert (body["param"], body["code"]) == ("input", "invalid_image")
    assert body["message"].startswith("input[0].content[1].image_url: "), body


def _offline_text(images_: list, prompt: str) -> str:
    """``LLM.chat``'s greedy text for one user message of ``images_`` then ``prompt`` (the offline API)."""
    from pagedllm import LLM, SamplingParams

    with LLM(tiny_llava_model(), device="cpu", dtype="float32", max_model_len=512) as llm:
        parts = [{"type": "image_pil", "image_pil": im} for im in images_] + [{"type": "text", "text": prompt}]
        out = llm.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=8, temperature=0))
    return out[0].outputs[0].text


def test_accepted_images_give_the_offline_text(images, media):
    """One image as a data URL and as a URL served on 127.0.0.1, and two images in one message: the server's greedy
    text equals ``LLM.chat``'s on the same pictures."""
    from PIL import Image

    red, blue = png_bytes(), png_bytes((20, 12), color=(10, 40, 220))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in (red, blue)]
    c = _client(images)
    kw = dict(model="test-model", max_tokens=8, temperature=0)

    def served(*parts) -> str:
        return c.chat.completions.create(messages=[{"role": "user", "content": [*parts, TEXT]}],
                                         **kw).choices[0].message.content

    one, two = _offline_text(pil[:1], TEXT["text"]), _offline_text(pil, TEXT["text"])
    assert served(_image(data_url(red))) == one
    assert served(_image(media.url("/img.png"))) == one  # /img.png serves png_bytes(): the red picture
    assert served(_image(data_url(red)), _image(data_url(blue))) == two


# ---- afterwards ---------------------------------------------------------------------------------------------------
def test_nothing_stuck_or_leaked(servers, media):
    """After every refusal above: no request running or waiting, no KV block held, no admission slot kept (the
    servers admit 2 in flight; dozens were refused), no connection to the media server left open."""
    for name, srv in servers.items():
        m = wait_idle(srv.base_url)
        assert m["pagedllm:num_requests_running"] == m["pagedllm:num_requests_waiting"] == 0, name
        assert m["pagedllm:kv_cache_used_blocks"] == 0, name
        c = _client(srv)
        for _ in range(3):  # a leaked admission slot would make these 429s
            assert c.chat.completions.create(model="test-model", max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}]).choices
        deadline = time.monotonic() + 10
        while True:
            open_ = [c for c in psutil.Process(srv.proc.pid).net_connections(kind="tcp")
                     if c.raddr and c.raddr.port == media.port]
            if not open_ or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not open_, (name, open_)
