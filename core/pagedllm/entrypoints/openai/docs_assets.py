"""``/docs`` (Swagger UI) and ``/redoc`` served from the installed package, so they work with no network.

FastAPI's default pages load their JavaScript and CSS from a CDN, which an offline or air-gapped server cannot reach
(the page stays blank). The ``fastapi-offline`` package (MIT) ships those files (Swagger UI:
Apache-2.0, ReDoc: MIT); they are mounted under :data:`STATIC_URL` and the pages point at them.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

STATIC_URL = "/static-offline-docs"


def assets_dir() -> Path:
    """The folder of the Swagger UI / ReDoc files shipped by ``fastapi-offline``."""
    import fastapi_offline  # the serve extra's dependency; only its static files are used

    return Path(fastapi_offline.__file__).parent / "static"


def add_offline_docs(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve the interactive API pages from local files (create ``app`` with ``docs_url=None, redoc_url=None``)."""
    app.mount(STATIC_URL, StaticFiles(directory=assets_dir()), name="offline-docs")
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=f"{root}{openapi_url}", title=f"{app.title} - Swagger UI",
                                   oauth2_redirect_url=f"{root}{oauth2_url}",
                                   swagger_js_url=f"{root}{STATIC_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{STATIC_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{STATIC_URL}/favicon.png",
                                   swagger_ui_parameters=app.swagger_ui_parameters)

    @app.get(oauth2_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(redoc_url, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{STATIC_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{STATIC_URL}/favicon.png", with_google_fonts=False)
