"""Open pages in a real headless Chromium and report what a reader would meet: the standard library only.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ending in a NUL byte, commands on the browser's fd 3, replies and
events on its fd 4), so no websocket client or browser-automation package is needed.
Each page is opened in a fresh tab; :meth:`Chromium.visit` returns what the page
logged as errors (console errors, uncaught exceptions, resources that failed to
load), every URL it requested, the result of a JavaScript expression evaluated
after the ``load`` event, and optionally the fonts that drew one of its elements.

    with Chromium() as browser:
        visit = browser.visit(Path("build/site/index.html").resolve().as_uri(), "document.title")

The browser runs in its own process group with a temporary profile; leaving the
``with`` block closes it, kills the group if it lingers, and removes the profile.
Debian: ``apt-get install chromium`` (the test suite skips its browser test without one).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_QUIET_FLAGS = ("--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
                "--allow-file-access-from-files")


class BrowserError(RuntimeError):
    """Chromium could not be started, stopped answering, or refused a command."""


def find_chromium() -> str | None:
    """The Chromium to use: ``$CHROMIUM`` if set, else the first of :data:`EXECUTABLES` on the PATH."""
    chosen = os.environ.get("CHROMIUM")
    if chosen:
        return shutil.which(chosen) or (chosen if Path(chosen).is_file() else None)
    return next((path for path in map(shutil.which, EXECUTABLES) if path), None)


@dataclass
class Visit:
    """What one page did: ``errors`` (console errors, exceptions, failed loads), ``requests`` (URLs),
    ``value`` (the evaluated expression's JSON value), ``fonts`` (families that drew the probed element)."""

    url: str
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    value: object = None
    fonts: list[str] = field(default_factory=list)


class Chromium:
    """A headless Chromium on a DevTools pipe (see the module docstring)."""

    def __init__(self, executable: str | None = None, timeout: float = 30.0, window: tuple[int, int] = (1280, 900)):
        self.executable = executable or find_chromium()
        if not self.executable:
            raise BrowserError("no Chromium found: install Debian's 'chromium' package (apt-get install chromium) "
                               "or set CHROMIUM to a Chrome/Chromium executable")
        self.timeout, self.window = timeout, window
        self.process = None
        self._next_id, self._buffer, self._events = 0, b"", []

    # -- process ---------------------------------------------------------------------------

    def __enter__(self) -> "Chromium":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="course_chromium_")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        to_browser_r, from_browser_w = _above_four(to_browser_r), _above_four(from_browser_w)
        args = [self.executable, *_QUIET_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
                f"--window-size={self.window[0]},{self.window[1]}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        # bash puts the pipe ends on the fds 3 and 4 that --remote-debugging-pipe uses (any fd number works there)
        wiring = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self._stderr = open(Path(self.profile) / "stderr.log", "wb")
        try:
            self.process = subprocess.Popen(["bash", "-c", wiring, *args], pass_fds=(to_browser_r, from_browser_w),
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                            start_new_session=True)
        finally:
            os.close(to_browser_r)
            os.close(from_browser_w)
        self.call("Browser.getVersion")

    def close(self) -> None:
        """Ask the browser to quit, then make sure its whole process group is gone."""
        if self.process is None:
            return
        try:
            self.call("Browser.close", timeout=5)
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its renderers and helpers, if any outlived it
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        self._stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)
        self.process = None

    def _stderr_tail(self) -> str:
        try:
            lines = (Path(self.profile) / "stderr.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return (" (its last message: " + lines[-1][:300] + ")") if lines else ""

    # -- protocol --------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"Chromium did not answer within {self.timeout:g} s{self._stderr_tail()}")
            ready, _, _ = select.select([self._from_browser], [], [], remaining)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed its DevTools pipe (it exited){self._stderr_tail()}")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float | None = None) -> dict:
        """Send one DevTools command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to_browser, data):]
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def _wait_for(self, method: str, session: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not any(e["method"] == method and e.get("sessionId") == session for e in self._events):
            self._events.append(self._read_message(deadline))

    def _session_events(self, session: str) -> list[dict]:
        mine = [e for e in self._events if e.get("sessionId") == session]
        self._events = [e for e in self._events if e.get("sessionId") != session]
        return mine

    # -- pages -----------------------------------------------------------------------------

    def _fonts_of(self, session: str, selector: str) -> list[str]:
        root = self.call("DOM.getDocument", session=session)["root"]["nodeId"]
        node = self.call("DOM.querySelector", {"nodeId": root, "selector": selector}, session)["nodeId"]
        if not node:
            return []
        fonts = self.call("CSS.getPlatformFontsForNode", {"nodeId": node}, session)["fonts"]
        return [font["familyName"] for font in fonts if font.get("glyphCount", 0) > 0]

    def visit(self, url: str, expression: str = "null", font_probe: str | None = None) -> Visit:
        """Open ``url`` in a new tab, wait for its ``load`` event, evaluate ``expression``, close the tab.

        ``font_probe``: a CSS selector; the families Chromium used to draw that element's text
        (evaluated after ``expression``, which may create the element) go to ``Visit.fonts``.
        """
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        visit = Visit(url)
        try:
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.call(f"{domain}.enable", session=session)
            navigation = self.call("Page.navigate", {"url": url}, session)
            if navigation.get("errorText"):
                visit.errors.append(f"navigation failed: {navigation['errorText']}")
            else:
                self._wait_for("Page.loadEventFired", session)
            result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                    "awaitPromise": True}, session)
            if "exceptionDetails" in result:
                visit.errors.append(f"check script failed: {result['exceptionDetails'].get('text')}")
            visit.value = result.get("result", {}).get("value")
            if font_probe:
                self.call("DOM.enable", session=session)
                self.call("CSS.enable", session=session)
                visit.fonts = self._fonts_of(session, font_probe)
        finally:
            self.call("Target.closeTarget", {"targetId": target})
        for event in self._session_events(session):
            _record(visit, event)
        return visit

    def screenshot(self, url: str, path: Path, full_page: bool = False, scroll_to: str | None = None) -> Path:
        """Save a PNG of ``url`` as the window shows it (or the whole page), for a person to look at;
        ``scroll_to``: a CSS selector of the element to bring to the top of the window first."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            self.call("Page.enable", session=session)
            self.call("Page.navigate", {"url": url}, session)
            self._wait_for("Page.loadEventFired", session)
            if scroll_to:
                self.call("Runtime.evaluate", {"expression": f"document.querySelector({json.dumps(scroll_to)})"
                                                             f".scrollIntoView()"}, session)
            shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": full_page}, session)
        finally:
            self.call("Target.closeTarget", {"targetId": target})
            self._session_events(session)
        Path(path).write_bytes(base64.b64decode(shot["data"]))
        return Path(path)


def _above_four(fd: int) -> int:
    """``fd`` moved to a number of 10 or more, so wiring it onto fds 3 and 4 cannot clobber the other end."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def _record(visit: Visit, event: dict) -> None:
    """File one DevTools event of the page under errors or requests."""
    method, params = event["method"], event.get("params", {})
    if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
        visit.errors.append(f"console.{params['type']}: {text}")
    elif method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        visit.errors.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
    elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        entry = params["entry"]
        visit.errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
    elif method == "Network.requestWillBeSent":
        visit.requests.append(params.get("request", {}).get("url", ""))
