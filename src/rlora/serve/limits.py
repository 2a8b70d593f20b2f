"""The API key and the request size, checked before a request reaches a route (an ASGI middleware).

The size limit holds for every body, however it is sent: a declared Content-Length over it is refused before
anything is read, and a body without one (chunked) is read up to the limit and refused as soon as it passes
it, before the route sees any of it. A body within the limit is handed on as the chunks it arrived in.
"""

from __future__ import annotations

import hmac
from collections import deque

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class Limits:
    def __init__(self, app: ASGIApp, max_body: int, api_key: str | None, open_paths: tuple[str, ...] = ()):
        self.app, self.max_body, self.api_key, self.open_paths = app, max_body, api_key, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (self.api_key is not None and scope["path"] not in self.open_paths
                and not hmac.compare_digest(headers.get("x-api-key", "").encode(), self.api_key.encode())):
            await _refuse(401, "missing or wrong API key (X-API-Key)", scope, receive, send)
            return
        length = headers.get("content-length")
        too_big = f"request body over {self.max_body} bytes"
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _refuse(413, too_big, scope, receive, send)
            return
        messages: deque[Message] = deque()
        size = 0
        while True:  # the whole body, counted as it comes (it would be read whole by the route anyway)
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the route learns it from the replay
            size += len(message.get("body", b""))
            if size > self.max_body:
                await _refuse(413, too_big, scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.popleft() if messages else await receive()

        await self.app(scope, replay, send)


async def _refuse(status: int, message: str, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse({"detail": message}, status_code=status, headers={"x-should-retry": "false"})(scope, receive, send)
