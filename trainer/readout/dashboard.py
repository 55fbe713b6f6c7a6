"""`python -m trainer dashboard`: a local web page of runs and Tinker-protocol service clients, updating while
they train.

    python -m trainer dashboard                          # runs/ (runs and service clients under it)
    python -m trainer dashboard runs/toy-1 runs/service --port 8800
    python -m trainer dashboard --host 0.0.0.0 --token "$(openssl rand -hex 16)"

It prints `dashboard: http://HOST:PORT/` once it listens (`--port 0`, the default, takes a free port). The page
polls GET /api/series every 2 s with the number of rows it already holds and gets only the rows after them, each
curve thinned to at most 2000 points; the charts are drawn by the page's own script (shipped with the package: no
CDN, nothing fetched from elsewhere). It binds 127.0.0.1 unless told otherwise; another host needs --token (16
characters or more), which the page and the API then require (`Authorization: Bearer T`, or `?token=T` in the
page's address). Folders are read as they are: a run being written, a half-written line or a missing file is shown
and said, never an error page.
"""

from __future__ import annotations

import argparse
import hmac
import socket
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from rlcommon.hosts import LOOPBACK_HOSTS
from trainer.readout.dashboard_data import Reader, Source, discover, facts, listing, resolve, series

MIN_TOKEN_CHARS = 16
STATIC = {  # the page's files, shipped as package data
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


def create_app(roots: list[Path], token: str | None = None, loopback_only: bool = True) -> FastAPI:
    """The dashboard over `roots`. With a token every page and API call must carry it; `loopback_only` (a server
    bound to a loopback address without a token) answers only requests addressed to a loopback name, so a web page
    elsewhere cannot read it through a DNS name that points at 127.0.0.1."""
    app = FastAPI(title="rl-lora dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    reader = Reader()
    static = resources.files("trainer.readout") / "dashboard_static"

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/static/"):  # the shipped script and style hold nothing of the runs
            return await call_next(request)
        if token is not None and not _authorized(request, token):
            return JSONResponse(
                {
                    "error": "this dashboard needs its token: Authorization: Bearer T, or ?token=T in the address"
                },
                status_code=401,
            )
        if token is None and loopback_only and _host_name(request) not in LOOPBACK_HOSTS:
            return JSONResponse(
                {
                    "error": f"host {request.headers.get('host')!r}: open the dashboard at http://127.0.0.1:PORT/"
                },
                status_code=403,
            )
        return await call_next(request)

    def source(source_id: str) -> Source:
        found = resolve(roots, source_id)
        if found is None:
            raise HTTPException(
                404, f"no run or service client {source_id!r} under {', '.join(map(str, roots))}"
            )
        return found

    @app.get("/")
    def index() -> Response:
        return Response((static / "index.html").read_text(), media_type="text/html; charset=utf-8")

    @app.get("/static/{name}")
    def static_file(name: str) -> Response:
        if name not in STATIC:
            raise HTTPException(404, f"no static file {name!r}")
        return Response((static / name).read_text(), media_type=STATIC[name])

    @app.get("/api/sources")
    def sources() -> dict[str, Any]:
        return {"roots": [str(r) for r in roots], "sources": listing(discover(roots))}

    @app.get("/api/facts")
    def source_facts(id: str) -> dict[str, Any]:
        return facts(source(id), reader)

    @app.get("/api/series")
    def source_series(id: str, since: int = 0, eval_since: int = 0, key: str = "") -> dict[str, Any]:
        return series(source(id), reader, max(since, 0), max(eval_since, 0), key)

    return app


def _authorized(request: Request, token: str) -> bool:
    given = request.headers.get("authorization", "")
    expected = f"Bearer {token}".encode()
    by_header = hmac.compare_digest(given.encode(), expected)
    by_query = hmac.compare_digest(request.query_params.get("token", "").encode(), token.encode())
    return by_header or by_query


def _host_name(request: Request) -> str:
    host = request.headers.get("host", "")
    if host.startswith("["):  # [::1]:8800
        return host[1 : host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def bind_error(host: str, token: str | None) -> str | None:
    """Why the dashboard may not serve there; None when it may. One reachable from other machines shows runs'
    configs and paths: only behind a token."""
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        return f"--token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 16`)"
    if host not in LOOPBACK_HOSTS and token is None:
        return (
            f"--host {host} exposes the dashboard beyond this machine: give --token T "
            f"({MIN_TOKEN_CHARS}+ characters), or keep the default --host 127.0.0.1"
        )
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer dashboard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "folders", nargs="*", default=["runs"], metavar="FOLDER", help="run folders or folders of them"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (another than loopback needs --token)"
    )
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 = a free one (printed)")
    p.add_argument("--token", help=f"required by the page and the API ({MIN_TOKEN_CHARS}+ characters)")
    p.add_argument(
        "--fd", type=int, help="serve on this inherited, already listening socket (the launcher's)"
    )
    return p


def main(argv: list[str]) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    if error := bind_error(args.host, args.token):
        print(f"error: {error}", file=sys.stderr)
        return 2
    roots = [Path(f) for f in args.folders]
    for root in roots:
        if not root.is_dir():  # said, not fatal: a run folder given before the launcher made it appears later
            print(f"dashboard: {root} is not a folder (yet); it is listed once it exists", file=sys.stderr)
    sock = open_socket(args.host, args.port, args.fd, args.token)
    if isinstance(sock, str):
        print(f"error: {sock}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    loopback = host in LOOPBACK_HOSTS or host.startswith("127.")
    app = create_app(roots, args.token, loopback_only=loopback)
    shown = f"[{host}]" if ":" in host else host
    print(f"dashboard: http://{shown}:{port}/", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
    return 0


def open_socket(host: str, port: int, fd: int | None, token: str | None) -> socket.socket | str:
    """The listening socket (inherited, or bound here), or why there is none."""
    if fd is None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            return f"cannot bind {host}:{port}: {exc}; choose another --port"
        sock.listen(64)
        return sock
    sock = socket.socket(fileno=fd)
    # The launcher's socket: the token rule holds for where it is bound, whatever --host says.
    if error := bind_error(sock.getsockname()[0], token):
        sock.close()
        return error
    return sock
