"""The ASGI app ``pipeline serve`` runs: MLflow's scoring server for one model, whose answers to bad input
are cut to one line.

MLflow's server answers an exception of the model with HTTP 400 and a message that repeats the whole
request ("Failed to predict data '<every base64 image>'. Error: ...") plus a stack trace. For the image
classifier's own refusals (``pipeline.serving.model.BadInput``) this keeps the line that says what was
wrong. Everything else is MLflow's scoring server as ``mlflow models serve`` runs it.
"""

from __future__ import annotations

import json
import os

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from mlflow.pyfunc import scoring_server

from pipeline.serving.model import BAD_INPUT

MODEL_ENV = "PIPELINE_SERVE_MODEL"  # the local folder of the model this app serves


def one_line(message: str) -> str:
    """The classifier's own words from MLflow's message (``BAD_INPUT`` ...), else the message's first line."""
    if BAD_INPUT in message:
        return message[message.index(BAD_INPUT) + len(BAD_INPUT):].splitlines()[0]
    return message.strip().splitlines()[0] if message.strip() else message


def build(model_path: str):
    app = scoring_server.init(scoring_server.load_model_with_mlflow_config(model_path))

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

    return app


app = build(os.environ[MODEL_ENV]) if MODEL_ENV in os.environ else None
