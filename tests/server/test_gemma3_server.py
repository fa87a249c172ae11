"""Gemma 3 with vision on the server: the official ``openai`` client sends ``image_url`` parts (a data URL, and a URL
served on 127.0.0.1) to a real ``pagedllm serve`` process of the tiny random Gemma 3 (``tests/support/
tiny_gemma3_vlm.py``), and gets the text ``LLM.chat`` gives offline on the same pictures (one image, and two of
different sizes: each image's tokens attend to each other bidirectionally)."""

from __future__ import annotations

import io

import openai
import pytest
from media_server import MediaServer, data_url, png_bytes
from server_utils import API_KEY, ServerProcess
from tiny_gemma3_vlm import tiny_gemma3_vlm_model

pytestmark = pytest.mark.slow

TEXT = {"type": "text", "text": "What is in this image?"}


@pytest.fixture(scope="module")
def server():
    with MediaServer() as media:
        srv = ServerProcess(tiny_gemma3_vlm_model(), "--max-model-len", "512", "--render-workers", "1",
                            "--allowed-media-domains", "127.0.0.1")
        srv.media = media
        yield srv
        out = srv.output()
        srv.stop()
        assert "Traceback" not in out, out


def test_image_url_parts_give_the_offline_text(server):
    from PIL import Image

    from pagedllm import LLM, SamplingParams

    red, blue = png_bytes(), png_bytes((60, 90), color=(10, 40, 220))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in (red, blue)]
    with LLM(tiny_gemma3_vlm_model(), device="cpu", dtype="float32", max_model_len=512) as llm:
        def offline(images: list) -> str:
            parts = [{"type": "image_pil", "image_pil": im} for im in images] + [TEXT]
            return llm.chat([{"role": "user", "content": parts}], SamplingParams(max_tokens=8, temperature=0),
                            use_tqdm=False)[0].outputs[0].text
        one, two = offline(pil[:1]), offline(pil)
    client = openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=60)

    def served(*urls: str) -> str:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [TEXT]
        return client.chat.completions.create(model="test-model", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": parts}]).choices[0].message.content

    assert one and one != two
    assert served(data_url(red)) == one
    assert served(server.media.url("/img.png")) == one  # /img.png serves png_bytes(): the red picture
    assert served(data_url(red), data_url(blue)) == two
