"""Images of served requests are decoded and processed in the render workers, not on the engine loop (issue 29).

One real ``pagedllm serve`` of the tiny random LLaVA, driven by the official ``openai`` client. The engine counts
the images it ran through its own processor (``pagedllm:mm_items_processed``) and those it received processed
(``pagedllm:mm_items_preprocessed``) on /metrics: served requests must only add to the second, with the text the
offline ``LLM.chat`` (which processes in-process) gives. The tensors travel in shared memory; after every request,
accepted or refused, no segment is left under /dev/shm. A large (allowed) image takes seconds to decode and
process on this machine: meanwhile another request's tokens keep streaming.
"""

from __future__ import annotations

import glob
import io
import threading
import time

import openai
import pytest
from media_server import data_url, png_bytes
from server_utils import API_KEY, ServerProcess, metrics, wait_idle
from tiny_vlm import tiny_llava_model

TEXT = {"type": "text", "text": "What is in this image?"}
MAX_PIXELS = 4_000_000


def _segments() -> list[str]:
    """Segments still there after up to 5 s (another server's request in flight holds one for milliseconds; a leak
    stays)."""
    deadline = time.monotonic() + 5
    while (left := glob.glob("/dev/shm/pagedllm_mm_*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(tiny_llava_model(), "--max-model-len", "512", "--render-workers", "2",
                        "--max-image-pixels", str(MAX_PIXELS), "--max-media-bytes", str(30 << 20))
    yield srv
    out = srv.output()
    srv.stop()
    assert "Traceback" not in out, out


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url_v1, api_key=API_KEY, max_retries=0, timeout=120)


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _counts(srv) -> tuple[float, float]:
    m = metrics(srv.base_url)
    return m["pagedllm:mm_items_processed_total"], m["pagedllm:mm_items_preprocessed_total"]


def _offline_text(images: list, prompt: str) -> str:
    from pagedllm import LLM, SamplingParams

    with LLM(tiny_llava_model(), device="cpu", dtype="float32", max_model_len=512) as llm:
        parts = [{"type": "image_pil", "image_pil": im} for im in images] + [{"type": "text", "text": prompt}]
        out = llm.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=8, temperature=0))
        assert llm.llm_engine.get_stats().mm_items_processed == len(images)  # offline: processed in-process
    return out[0].outputs[0].text


def test_served_images_skip_the_engine_processor(server):
    from PIL import Image

    red, blue = png_bytes((40, 30)), png_bytes((20, 12), color=(10, 40, 220))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in (red, blue)]
    one, two = _offline_text(pil[:1], TEXT["text"]), _offline_text(pil, TEXT["text"])
    c = _client(server)
    kw = dict(model="test-model", max_tokens=8, temperature=0)
    before = _counts(server)

    def served(*parts) -> str:
        return c.chat.completions.create(messages=[{"role": "user", "content": [*parts, TEXT]}],
                                         **kw).choices[0].message.content

    assert served(_image(data_url(red))) == one
    assert served(_image(data_url(red)), _image(data_url(blue))) == two
    r = c.responses.create(model="test-model", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(red)},
                                     {"type": "input_text", "text": TEXT["text"]}]}])
    assert r.output_text == one
    processed, preprocessed = _counts(server)
    assert processed == before[0] == 0  # the engine's own processor never ran for a served request
    assert preprocessed - before[1] == 4
    assert not _segments()


def test_refusals_after_processing_release_the_tensors(server):
    """The expanded prompt (two images: 72 placeholder tokens) is what the length check sees; the refused
    request's shared tensors are unlinked. A corrupt image is refused by the worker naming its field."""
    c = _client(server)
    red = data_url(png_bytes())
    text_only = c.chat.completions.create(model="test-model", max_tokens=1, messages=[
        {"role": "user", "content": TEXT["text"]}]).usage.prompt_tokens
    expanded = text_only + 2 * 37  # each image: 36 tokens and the template's newline
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="test-model", max_tokens=512 - expanded + 1, messages=[
            {"role": "user", "content": [_image(red), _image(red), TEXT]}])
    assert e.value.body["param"] == "max_tokens", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="test-model", max_tokens=2, messages=[
            {"role": "user", "content": [TEXT, _image(data_url(png_bytes()[:40]))]}])
    assert (e.value.body["param"], e.value.body["code"]) == ("messages[0].content[1].image_url.url",
                                                             "invalid_image"), e.value.body
    m = wait_idle(server.base_url)
    assert m["pagedllm:kv_cache_used_blocks"] == 0
    assert m["pagedllm:mm_items_processed_total"] == 0
    assert not _segments()


def _large_png(width: int, height: int) -> bytes:
    import numpy as np
    from PIL import Image

    x = np.add.outer(np.arange(height) % 251, np.arange(width) % 241).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.stack([x, x[::-1], x[:, ::-1]], -1)).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


@pytest.mark.slow
def test_a_large_image_does_not_stall_other_streams(server):
    """A 2000x1500 image (allowed) takes seconds to decode and resize here. While a render worker does that, a
    text request already decoding keeps receiving tokens: its longest silence inside the image's window stays well
    under the window (were the image processed on the engine loop, the stream would stop for all of it)."""
    big = data_url(_large_png(2000, 1500))
    c = _client(server)
    times: list[float] = []
    window: dict = {}

    def image_request() -> None:
        window["start"] = time.monotonic()
        try:
            window["text"] = c.chat.completions.create(model="test-model", max_tokens=1, messages=[
                {"role": "user", "content": [_image(big), TEXT]}]).choices[0].message.content
        except BaseException as e:  # noqa: BLE001 - reported below
            window["error"] = e
        window["end"] = time.monotonic()

    stream = c.chat.completions.create(model="test-model", max_tokens=440, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True},
                                       messages=[{"role": "user", "content": "Count to a thousand."}])
    t = None
    for chunk in stream:
        times.append(time.monotonic())
        if t is None and len(times) == 5:
            t = threading.Thread(target=image_request)
            t.start()
        if "end" in window:
            break
    stream.close()
    t.join(120)
    assert "error" not in window, window
    start, end = window["start"], window["end"]
    inside = [x for x in times if start <= x <= end]
    assert times[-1] >= end, "the text stream ended before the image request; raise its max_tokens"
    span = end - start
    gaps = [b - a for a, b in zip([start] + inside, inside + [end])]
    print(f"image window {span:.2f} s, {len(inside)} text chunks in it, longest silence {max(gaps):.3f} s")
    assert inside, span  # tokens arrived while the image was processed (0.7-3 s here, 115 chunks at 0.7 s)
    assert max(gaps) < max(0.5 * span, 0.3), (span, max(gaps), len(inside))
    assert _counts(server)[0] == 0
    assert not _segments()


def test_shared_tensors_are_read_once_and_unlinked():
    """The hand-off itself: a tensor written by ``share`` reads back equal (dtype, shape, bytes) and its segment is
    gone after ``load``; releasing twice is harmless; a released segment cannot be loaded (the request was
    cancelled: a ParamError, not a crash)."""
    import torch
    from pagedllm.errors import ParamError
    from pagedllm.multimodal.shared_tensors import new_tag, share

    tag = new_tag()
    mine = lambda: glob.glob(f"/dev/shm/pagedllm_mm_{tag}_*")  # noqa: E731 - other tests' segments are not ours
    for t in (torch.randn(2, 3, 5), torch.arange(7, dtype=torch.int64), torch.zeros(0, 4), torch.randn(4, 6)[:, ::2]):
        h = share(t, tag)
        assert len(mine()) == 1 and h.shape == tuple(t.shape) and h.dtype == t.dtype
        back = h.load()
        assert torch.equal(back, t) and back.dtype == t.dtype and not mine()
        h.release()
    h = share(torch.ones(3), tag)
    h.release()
    h.release()
    assert not mine()
    with pytest.raises(ParamError) as e:
        h.load()
    assert e.value.field == "multi_modal_data"
