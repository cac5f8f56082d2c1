"""A plain blocking GET for the bench's control calls (health, /nodes, /metrics, /v1/models): the standard library
only, so the bench needs no HTTP client beyond the aiohttp its requests go out on. Proxies in the environment are not
used: these are calls to the servers under test, as the requests are."""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Optional

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float, headers: Optional[dict] = None) -> tuple[int, bytes]:
    """(status, body) of GET `url`, whatever the status; OSError when no answer came (refused, reset, timed out,
    not HTTP)."""
    try:
        with _OPENER.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:  # an answer, with a status >= 400
        with e:
            return e.code, e.read()
    except http.client.HTTPException as e:  # a broken answer
        raise OSError(f"{url}: {type(e).__name__}: {e}") from e


def get_json(url: str, timeout: float, headers: Optional[dict] = None):
    """The JSON body of a 200 answer; OSError for no answer, ValueError for any other status or a body not JSON."""
    status, body = http_get(url, timeout, headers)
    if status != 200:
        raise ValueError(f"{url} answered {status}")
    return json.loads(body)
