"""The browser pages: a chat page at `/`, the live engine at `/dashboard`.

    GET /                  the chat page (frontend/static/chat.html inside page.html)
    GET /dashboard         the dashboard page (frontend/static/dashboard.html inside page.html)
    GET /dashboard/events  its SSE feed (frontend.dashboard_feed); wants the API key when one is set
    GET /static/...        the pages' CSS and JS, shipped in the package (no CDN, no build step)

The pages themselves carry no data and are served without the key, so that they can
ask for it: each page learns from its <body data-needs-key> whether the server wants
one, keeps it in the browser's localStorage and sends it as `Authorization: Bearer`
on every call it makes, the same calls any API client makes. Both pages share one shell,
`static/page.html` (the <head>, the header with its key button, the key form); a page's
own file holds what comes below the header.
"""

from __future__ import annotations

import html
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from frontend.admission import Admission
from frontend.dashboard_feed import DashboardFeed
from frontend.engine_client import AsyncEngineClient

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
# Shown as is: the pages are small, and a stale cached script beside a new server is worse.
NO_CACHE = {"Cache-Control": "no-cache"}


# A page's title (after "tokenloom ") and what its header shows after the links.
PAGES = {
    "chat.html": ("chat", ""),
    "dashboard.html": ("dashboard", '\n    <span id="feed-status" class="feed-status">connecting…</span>'),
}


def render_page(name: str, model_name: str, needs_key: bool) -> str:
    """A page's HTML: its file inside the shell, the server's facts filled into the <body> attributes."""
    title, header = PAGES[name]
    text = (STATIC_DIR / "page.html").read_text(encoding="utf-8")
    text = text.replace("__TITLE__", title).replace("__HEADER__", header)
    text = text.replace("__MAIN__", (STATIC_DIR / name).read_text(encoding="utf-8"))
    text = text.replace("__NEEDS_KEY__", "true" if needs_key else "false")
    return text.replace("__MODEL__", html.escape(model_name, quote=True))


def add_web_routes(app: FastAPI, client: AsyncEngineClient, admission: Admission) -> None:
    needs_key = admission.config.api_key is not None
    pages = {name: render_page(name, client.model_name, needs_key) for name in PAGES}

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return HTMLResponse(pages["chat.html"], headers=NO_CACHE)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return HTMLResponse(pages["dashboard.html"], headers=NO_CACHE)

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(raw_request: Request) -> Response:
        admission.check_key(dict(raw_request.scope["headers"]))  # 401, as on the API
        admission.check_open()
        feed = DashboardFeed(client)
        logger.debug("dashboard feed opened by %s", raw_request.client)
        # Starlette cancels the generator when the browser goes away.
        return StreamingResponse(feed.events(lambda: admission.is_draining), media_type="text/event-stream",
                                 headers={**NO_CACHE, "X-Accel-Buffering": "no"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
