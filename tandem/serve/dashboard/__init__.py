"""`GET /dashboard`: one static page (no build step, no CDN; uPlot vendored from npm) that polls
`GET /v1/cluster` and draws the deployment. The page holds no data of its own, so it is served to
anyone; the JSON it reads is behind the API key like the rest of /v1, and the page asks for the
key when it gets a 401."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent


def mount_dashboard(app: FastAPI) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
