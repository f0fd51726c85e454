"""The ASGI app ``pipeline serve`` runs: MLflow's scoring server for one model, whose answers to bad input
are cut to one line.

MLflow's server answers an exception of the model with HTTP 400 and a message that repeats the whole
request ("Failed to predict data '<every base64 image>'. Error: ...") plus a stack trace. For the image
classifier's own refusals (``pipeline.serving.model.BadInput``) this keeps the line that says what was
wrong. Everything else is MLflow's scoring server as ``mlflow models serve`` runs it.

The limits (``pipeline.config.serve.ServeConfig``) are held in two places. The classifier counts a request's
images and reads each image's size from its header before decoding it (HTTP 400). The body cap is this app's
(``BodyLimit``), because MLflow's server reads the whole body (``await request.body()``) and uvicorn has no
cap: a body is counted as it arrives (a chunked one declares no length) and no byte past the cap is kept;
over it, the answer is HTTP 413. What it cannot stop: a body declared over ``BodyLimit.DRAIN`` times the cap
is answered before it is read, and a client that sends it anyway (urllib does; curl waits for large bodies,
``Expect: 100-continue``) sees the connection closed instead of the answer; a body up to that size still
crosses the network; and a slow client holds a connection for as long as it trickles bytes (MLflow's
request timeout starts after the body is read).
"""

from __future__ import annotations

import json
import os

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from mlflow.pyfunc import scoring_server

from pipeline.config.serve import ServeConfig
from pipeline.serving.model import BAD_INPUT

MODEL_ENV = "PIPELINE_SERVE_MODEL"  # the local folder of the model this app serves
LIMITS_ENV = "PIPELINE_SERVE_LIMITS"  # its limits, ServeConfig as JSON (the defaults when unset)


def one_line(message: str) -> str:
    """The classifier's own words from MLflow's message (``BAD_INPUT`` ...), else the message's first line."""
    if BAD_INPUT in message:
        return message[message.index(BAD_INPUT) + len(BAD_INPUT):].splitlines()[0]
    return message.strip().splitlines()[0] if message.strip() else message


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets HTTP 413 and one line, and is never held past
    the cap. Bodies up to ``DRAIN`` times the cap are read to their end and dropped before the answer, since most
    clients (urllib, requests) send the whole body before they read one; larger ones are answered at once."""

    DRAIN = 4

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes * self.DRAIN:
            return await self._refuse(send, f"{int(declared):,} bytes")
        # Read the body here, counting (a chunked one declares no length); the app then gets it in one piece.
        body, size, more = bytearray(), 0, True
        while more and size <= self.max_bytes * self.DRAIN:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size <= self.max_bytes:
                body += chunk
        if size > self.max_bytes:
            return await self._refuse(send, f"{'over ' if more else ''}{size:,} bytes")
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        mib = self.max_bytes / 2**20
        message = (f"a request body of {size}, over this server's cap of {mib:g} MiB; send fewer or smaller images "
                   "per request (`pipeline serve --max-body-mb` sets the cap)")
        content = json.dumps({"error_code": "RESOURCE_EXHAUSTED", "message": message}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})


def build(model_path: str, limits: ServeConfig | None = None):
    limits = limits or ServeConfig()
    model = scoring_server.load_model_with_mlflow_config(model_path)
    model.unwrap_python_model().set_limits(limits)
    app = scoring_server.init(model)

    @app.middleware("http")
    async def errors_in_one_line(request: Request, call_next) -> Response:
        response = await call_next(request)
        if response.status_code != 400 or not response.headers.get("content-type", "").startswith("application/json"):
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])
        try:
            answer = json.loads(body)
        except ValueError:
            return Response(body, status_code=400, media_type=response.media_type)
        return JSONResponse({"error_code": answer.get("error_code", "BAD_REQUEST"),
                             "message": one_line(str(answer.get("message", "")))}, status_code=400)

    return BodyLimit(app, limits.max_body_bytes)


app = build(os.environ[MODEL_ENV], ServeConfig.model_validate_json(os.environ.get(LIMITS_ENV, "{}"))) \
    if MODEL_ENV in os.environ else None
