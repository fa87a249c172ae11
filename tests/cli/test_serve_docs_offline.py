"""``pagedllm serve --model X`` (vLLM's flag form) starts a server, and its ``/docs`` and ``/redoc`` pages load
every script, stylesheet and icon from the server itself: nothing from a CDN, so they work offline."""

from __future__ import annotations

import re

import httpx
import pytest

from server_utils import API_KEY, ServerProcess, tiny_chat_model


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(None, "--model", tiny_chat_model())  # the flag, not the positional form
    yield s
    s.stop()


def test_model_flag_loads_that_model(server):
    r = httpx.get(f"{server.url_v1}/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == server.served_name, r.text
    cmdline = " ".join(server.proc.args)
    assert f"--model {tiny_chat_model()}" in cmdline and "--model-impl" not in cmdline


@pytest.mark.parametrize("page,script,marker", [("/docs", "swagger-ui-bundle.js", "SwaggerUIBundle"),
                                                ("/redoc", "redoc.standalone.js", "Redoc")])
def test_docs_pages_load_only_local_assets(server, page, script, marker):
    keyed = {"Authorization": f"Bearer {API_KEY}"}  # with --api-key every route but /health needs it (issue 34)
    assert httpx.get(server.base_url + page, timeout=30).status_code == 401
    r = httpx.get(server.base_url + page, headers=keyed, timeout=30)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"], r.text[:500]
    assert "http://" not in r.text and "https://" not in r.text and "//cdn" not in r.text, r.text
    refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert any(ref.endswith(script) for ref in refs), refs
    for ref in refs:
        assert ref.startswith("/") and not ref.startswith("//"), ref
        asset = httpx.get(server.base_url + ref, headers=keyed, timeout=30)
        assert asset.status_code == 200 and len(asset.content) > 1000, (ref, asset.status_code)
        if ref.endswith(script):
            assert "javascript" in asset.headers["content-type"] and marker in asset.text
    spec = httpx.get(server.base_url + "/openapi.json", headers=keyed, timeout=30).json()
    assert "/v1/chat/completions" in spec["paths"] and page not in spec["paths"]
