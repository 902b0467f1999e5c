"""Look at the documentation as a reader does: build the site, render the README as a forge
would, and screenshot pages with headless Chromium into screenshots/ (kept out of git).

    python docs/screenshot.py                     # README and a few pages
    python docs/screenshot.py checkpoints api     # README and these pages (names under docs/)
    python docs/screenshot.py --whole slurm       # all of a page, as 1280x1700 views: slurm-0.png, ...

Needs the docs extra (`pip install -e ".[docs]"`) and Debian's Chromium (`apt-get install -y
chromium`). The site is served on a loopback port of the OS's choosing for the time of the
screenshots; nothing else is reached (Chromium runs with background networking off).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import markdown

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "screenshots"
DEFAULT_PAGES = ["index", "getting-started", "checkpoints", "torchrun", "api"]
WINDOW = "1600,2400"
TALL = {"README": "1280,5600"}  # the whole front page in one picture
README_STYLE = """
body { max-width: 880px; margin: 32px auto; font: 16px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       color: #1f2328; padding: 0 24px; }
h1, h2 { border-bottom: 1px solid #d1d9e0; padding-bottom: .3em; }
code { background: #eff1f3; padding: .2em .4em; border-radius: 6px; font-size: 85%; }
pre { background: #f6f8fa; padding: 16px; border-radius: 6px; overflow: auto; }
pre code { background: none; padding: 0; font-size: 85%; }
table { border-collapse: collapse; } td, th { border: 1px solid #d1d9e0; padding: 6px 13px; }
a { color: #0969da; }
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    sys.exit("docs/screenshot.py: no Chromium on PATH; install it with: apt-get install -y chromium")


def build_site(site: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


def render_readme(site: Path) -> None:
    """README.md as HTML, as GitHub shows it (fenced code, tables, HTML comments hidden)."""
    body = markdown.markdown((REPO / "README.md").read_text(), extensions=["fenced_code", "tables"])
    html = f"<!doctype html><meta charset=utf-8><title>README</title><style>{README_STYLE}</style>{body}"
    (site / "README.html").write_text(html)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def screenshot(browser: str, url: str, target: Path, profile: Path, size: tuple[int, int] | None = None) -> None:
    window = f"{size[0]},{size[1]}" if size else TALL.get(target.stem, WINDOW)
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", f"--user-data-dir={profile}", "--hide-scrollbars", f"--window-size={window}",
         f"--screenshot={target}", url],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    print(target.relative_to(REPO))


SLICE = (1280, 1700)  # a laptop's screen: what a reader sees of a page at once
WHOLE_HEIGHT = 16000  # pixels of a page taken for --whole; a longer page is cut there


def whole_page(browser: str, site: Path, port: int, page: str, profile: Path) -> None:
    """All of a page in screen-sized views. Headless Chromium neither scrolls nor crops, so the
    page is taken once, tall, and each view is a screenshot of a small HTML page that shows one
    slice of that picture (no image library needed)."""
    width, height = SLICE
    tall = site / f"{page}-whole.png"
    path = "" if page == "index" else f"{page}/"
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", f"--user-data-dir={profile}", "--hide-scrollbars",
         f"--window-size={width},{WHOLE_HEIGHT}", f"--screenshot={tall}", f"http://127.0.0.1:{port}/{path}"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    for i in range(WHOLE_HEIGHT // height):
        view = site / f"{page}-{i}.html"
        view.write_text(
            f'<body style="margin:0"><div style="height:{height}px;overflow:hidden">'
            f'<img src="{tall.name}" style="margin-top:-{i * height}px"></div></body>'
        )
        screenshot(browser, f"http://127.0.0.1:{port}/{view.name}", OUT / f"{page}-{i}.png", profile, SLICE)


def main(args: list[str]) -> None:
    whole = "--whole" in args
    pages = [a for a in args if a != "--whole"]
    browser = chromium()
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rally-docs-") as tmp:
        site, profile = Path(tmp) / "site", Path(tmp) / "profile"
        build_site(site)
        render_readme(site)
        server, port = serve(site)
        try:
            screenshot(browser, f"http://127.0.0.1:{port}/README.html", OUT / "README.png", profile)
            for page in pages or DEFAULT_PAGES:
                if whole:
                    whole_page(browser, site, port, page, profile)
                    continue
                path = "" if page == "index" else f"{page}/"
                screenshot(browser, f"http://127.0.0.1:{port}/{path}", OUT / f"{page}.png", profile)
        finally:
            server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
