"""Asking a live run's processes how they are: a local process id, a generation server's /health
and the weight version it serves. Each answers in a bounded time; nothing here changes the run."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@dataclass
class ServerHealth:
    health: str  # "ok", "HTTP <code>" or "no answer (<why>)"
    weight_version: str | None = None  # what /get_weight_version says it serves; None: not known


def _get(url: str, timeout: float, api_key: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def server_health(url: str, timeout: float = 0.5, api_key: str | None = None) -> ServerHealth:
    """GET `url`/health (200: ok), then the weight version it serves."""
    try:
        code, _ = _get(f"{url}/health", timeout, api_key)
    except (OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        return ServerHealth(f"no answer ({why})")
    if code != 200:
        return ServerHealth(f"HTTP {code}")
    version = None
    try:
        code, body = _get(f"{url}/get_weight_version", timeout, api_key)
        if code == 200:
            label = json.loads(body).get("weight_version")
            version = None if label is None else str(label)
    except (OSError, ValueError, AttributeError):
        pass
    return ServerHealth("ok", version)


def servers_health(urls: dict[str, str], timeout: float = 0.5, api_key: str | None = None) -> dict[str, ServerHealth]:
    """name -> its health, every server asked at once."""
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        futures = {name: pool.submit(server_health, url, timeout, api_key) for name, url in urls.items()}
        return {name: f.result() for name, f in futures.items()}
