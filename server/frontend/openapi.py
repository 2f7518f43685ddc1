"""The OpenAPI 3 description of the HTTP API, served at ``GET /v2/openapi.json``.

Written by hand from the routes in ``app.py`` (KServe v2 plus the Triton extensions shmserve
serves); precise enough for a schema fuzzer (tests/test_openapi.py runs schemathesis against it).
Every error answer is ``{"error": "<message>"}``.
"""
from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from shmserve.server import __version__

from shmserve.server.edge.requests import UINT64_MAX

JSON = "application/json"
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "the request is invalid (the message says why)", 403: "refused to this client",
            404: "no such endpoint or action", 405: "method not allowed on this endpoint",
            500: "Triton's status for a failure it calls internal: a load of a name no repository holds, a "
                 "region whose key opens nothing or that is registered already",
            501: "not supported: Triton's refusal, in its words",
            503: "overloaded or not available right now (retry later)"}
    return {str(c): _json(_ref("Error"), text[c]) for c in codes}


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string", "minLength": 1}}


MODEL = _path_param("model", "model name")
VERSION = _path_param("version", "model version: digits only, as Triton's routes take it (any other path "
                                 "segment is no route: 404)")
VERSION["schema"]["pattern"] = "^[0-9]+$"
REGION = _path_param("name", "shared-memory region name")
REPOSITORY = _path_param("repository", "a repository's name")
COMMON_ERRORS = (400, 404, 405, 503)


def _op(summary: str, responses: dict[str, Any], body: dict[str, Any] | None = None, required: bool = True,
        errors: tuple[int, ...] = COMMON_ERRORS, op_id: str = "") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {**responses, **_errors(*errors)}}
    if op_id:
        op["operationId"] = op_id
    if body is not None:
        op["requestBody"] = {"required": required, "content": {JSON: {"schema": body}}}
    return op


def _empty(description: str) -> dict[str, Any]:
    return {"description": description}


def _schemas() -> dict[str, Any]:
    u64 = {"type": "integer", "minimum": 0, "maximum": UINT64_MAX}
    params = {"type": "object", "additionalProperties": {"oneOf": [{"type": "boolean"}, {"type": "number"},
                                                                   {"type": "string"}]}}
    tensor_meta = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
        "name": {"type": "string"}, "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}}}}
    io_params = {"type": "object", "properties": {
        "binary_data_size": {"type": "integer", "minimum": 0},
        "binary_data": {"type": "boolean"},
        "shared_memory_region": {"type": "string", "minLength": 1},
        "shared_memory_offset": {"type": "integer", "minimum": 0},
        "shared_memory_byte_size": {"type": "integer", "minimum": 0}},
        "additionalProperties": True}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
        "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": "string", "nullable": True},
                           "code": {"type": "string", "nullable": True}}}}},
        "ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"], "properties": {
            "name": {"type": "string"}, "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}}}},
        "ModelMetadata": {"type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"],
                          "properties": {"name": {"type": "string"},
                                         "versions": {"type": "array", "items": {"type": "string"}},
                                         "platform": {"type": "string"},
                                         "inputs": {"type": "array", "items": tensor_meta},
                                         "outputs": {"type": "array", "items": tensor_meta}}},
        "ModelConfig": {"type": "object", "description": "Triton's ModelConfig as JSON, defaults included"},
        "Parameters": params,
        "InferInput": {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 64},
            "datatype": {"type": "string", "enum": DATATYPES},
            "parameters": io_params,
            "data": {"description": "the tensor's elements, flat or nested row-major (strings for BYTES)"}}},
        "InferRequestedOutput": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "parameters": io_params}},
        "InferRequest": {"type": "object", "required": ["inputs"], "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object", "properties": {
                "sequence_id": {"oneOf": [u64, {"type": "string"}]},
                "sequence_start": {"type": "boolean"}, "sequence_end": {"type": "boolean"},
                "priority": u64, "timeout": u64, "binary_data_output": {"type": "boolean"}},
                "additionalProperties": {"oneOf": [{"type": "boolean"}, {"type": "number"}, {"type": "string"}]}},
            "inputs": {"type": "array", "items": _ref("InferInput")},
            "outputs": {"type": "array", "items": _ref("InferRequestedOutput")}}},
        "InferResponse": {"type": "object", "required": ["model_name", "outputs"], "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
            "parameters": {"type": "object"},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name", "datatype", "shape"],
                                                   "properties": {"name": {"type": "string"},
                                                                  "datatype": {"type": "string"},
                                                                  "shape": {"type": "array",
                                                                            "items": {"type": "integer"}},
                                                                  "parameters": {"type": "object"},
                                                                  "data": {"type": "array"}}}}}},
        "GenerateRequest": {"type": "object", "description": "model inputs by name (a scalar or a flat list), "
                            "'id', 'parameters', and other keys as request parameters",
                            "properties": {"id": {"type": "string"}, "parameters": params},
                            "additionalProperties": True},
        "GenerateResponse": {"type": "object", "required": ["model_name", "model_version"], "properties": {
            "id": {"type": "string"}, "model_name": {"type": "string"}, "model_version": {"type": "string"}},
            "additionalProperties": True},
        "RepositoryIndexRequest": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
        "RepositoryIndex": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "version": {"type": "string"}, "state": {"type": "string"},
            "reason": {"type": "string"}}}},
        "RepositoryRequest": {"type": "object", "properties": {"parameters": {
            "type": "object", "description": "load: 'config' (a JSON string) and 'file:<path>' (base64 "
                                             "content); unload: 'unload_dependents'",
            "properties": {"config": {"type": "string"}, "unload_dependents": {"type": "boolean"}},
            "additionalProperties": True}}},
        "ModelStats": {"type": "object", "required": ["model_stats"], "properties": {
            "model_stats": {"type": "array", "items": {"type": "object", "required": ["name", "version"],
                                                       "properties": {"name": {"type": "string"},
                                                                      "version": {"type": "string"}}}}}},
        "LogSettings": {"type": "object", "properties": {
            "log_file": {"type": "string"}, "log_info": {"type": "boolean"}, "log_warning": {"type": "boolean"},
            "log_error": {"type": "boolean"}, "log_verbose_level": {"type": "integer", "minimum": 0},
            "log_format": {"type": "string", "enum": ["default", "ISO8601"]}}},
        "TraceSettings": {"type": "object", "description": "Triton's trace settings (values are strings or "
                          "lists of strings; null in an update clears a model's own value)",
                          "additionalProperties": True},
        "CanaryStatus": {"type": "object", "additionalProperties": True},
        "CanarySettings": {"type": "object", "additionalProperties": True},
        "SystemShmRegister": {"type": "object", "required": ["key", "byte_size"], "properties": {
            "key": {"type": "string", "description": "a POSIX shared-memory name such as '/my_region'"},
            "offset": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 0}}},
        "CudaShmRegister": {"type": "object", "required": ["raw_handle", "device_id", "byte_size"], "properties": {
            "raw_handle": {"type": "object", "required": ["b64"], "properties": {"b64": {"type": "string"}}},
            "device_id": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 0}}},
        "SystemShmStatus": {"type": "array", "items": {"type": "object", "required": ["name", "key", "offset",
                                                                                      "byte_size"],
                                                       "properties": {"name": {"type": "string"},
                                                                      "key": {"type": "string"},
                                                                      "offset": {"type": "integer"},
                                                                      "byte_size": {"type": "integer"}}}},
        "CudaShmStatus": {"type": "array", "items": {"type": "object", "required": ["name", "device_id",
                                                                                    "byte_size"],
                                                     "properties": {"name": {"type": "string"},
                                                                    "device_id": {"type": "integer"},
                                                                    "byte_size": {"type": "integer"}}}},
    }


def _paths() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v2/health/live": {"get": _op("Liveness", {"200": _empty("the server is live")}, errors=())},
        "/v2/health/ready": {"get": _op("Readiness", {"200": _empty("ready"), "400": _empty("not ready"),
                                                       "503": _empty("the broker is not available")}, errors=())},
        "/v2": {"get": _op("Server metadata", {"200": _json(_ref("ServerMetadata"), "server metadata")}, errors=())},
        "/v2/openapi.json": {"get": _op("This description", {"200": _json({"type": "object"}, "OpenAPI 3")},
                                        errors=())},
        "/v2/logging": {
            "get": _op("Log settings", {"200": _json(_ref("LogSettings"), "current settings")}),
            "post": _op("Change log settings (501: a change of log_file, Triton's refusal)",
                        {"200": _json(_ref("LogSettings"), "the new settings")}, _ref("LogSettings"), required=False,
                        errors=(*COMMON_ERRORS, 501))},
        "/v2/trace/setting": {
            "get": _op("Global trace settings", {"200": _json(_ref("TraceSettings"), "current settings")}),
            "post": _op("Change global trace settings", {"200": _json(_ref("TraceSettings"), "new settings")},
                        _ref("TraceSettings"), required=False)},
        "/v2/models/stats": {"get": _op("Statistics of every model", {"200": _json(_ref("ModelStats"), "stats")})},
        "/v2/repository/index": {"post": _op("Repository index", {"200": _json(_ref("RepositoryIndex"), "index")},
                                             _ref("RepositoryIndexRequest"), required=False)},
        "/v2/repository/models/{model}/load": {"post": {
            **_op("Load or reload a model (403: 'file:' contents without --allow-model-file-uploads)",
                  {"200": _empty("loaded")}, _ref("RepositoryRequest"), required=False,
                  errors=tuple(sorted({*COMMON_ERRORS, 403, 500}))),
            "parameters": [MODEL]}},
        "/v2/repository/models/{model}/unload": {"post": {
            **_op("Unload a model", {"200": _empty("unloaded")}, _ref("RepositoryRequest"), required=False),
            "parameters": [MODEL]}},
        "/v2/repository/{repository}/index": {"post": {
            **_op("Repository index (the repository's name is ignored, as Triton ignores it)",
                  {"200": _json(_ref("RepositoryIndex"), "index")}, _ref("RepositoryIndexRequest"), required=False),
            "parameters": [REPOSITORY]}},
        "/v2/repository/{repository}/models/{model}/load": {"post": {
            **_op("Refused as Triton refuses it: the repositories are served as one", {},
                  errors=(*COMMON_ERRORS, 501)), "parameters": [REPOSITORY, MODEL]}},
        "/v2/repository/{repository}/models/{model}/unload": {"post": {
            **_op("Refused as Triton refuses it: the repositories are served as one", {},
                  errors=(*COMMON_ERRORS, 501)), "parameters": [REPOSITORY, MODEL]}},
        "/v2/repository/models/{model}/canary": {
            "parameters": [MODEL],
            "get": _op("Canary status", {"200": _json(_ref("CanaryStatus"), "policy, split and decisions")}),
            "post": _op("Change the canary policy", {"200": _json(_ref("CanaryStatus"), "the new status")},
                        _ref("CanarySettings"), required=False)},
        "/v2/repository/models/{model}/canary/{action}": {
            "parameters": [MODEL, {"name": "action", "in": "path", "required": True,
                                   "schema": {"type": "string", "enum": ["promote", "rollback"]}}],
            "post": _op("Promote or roll back the canary", {"200": _json(_ref("CanaryStatus"), "the new status")})},
        "/v2/systemsharedmemory/status": {"get": _op("System shm regions", {
            "200": _json(_ref("SystemShmStatus"), "registered regions")})},
        "/v2/systemsharedmemory/unregister": {"post": _op("Unregister every system shm region",
                                                          {"200": _empty("done")})},
        "/v2/systemsharedmemory/region/{name}/status": {"parameters": [REGION], "get": _op(
            "One system shm region", {"200": _json(_ref("SystemShmStatus"), "the region")})},
        "/v2/systemsharedmemory/region/{name}/register": {"parameters": [REGION], "post": _op(
            "Register a system shm region", {"200": _empty("registered")},
            _ref("SystemShmRegister"), errors=(400, 403, 404, 405, 500, 503))},
        "/v2/systemsharedmemory/region/{name}/unregister": {"parameters": [REGION], "post": _op(
            "Unregister a system shm region", {"200": _empty("done")})},
        "/v2/cudasharedmemory/status": {"get": _op("CUDA shm regions", {
            "200": _json(_ref("CudaShmStatus"), "registered regions")})},
        "/v2/cudasharedmemory/unregister": {"post": _op("Unregister every CUDA shm region",
                                                        {"200": _empty("done")})},
        "/v2/cudasharedmemory/region/{name}/status": {"parameters": [REGION], "get": _op(
            "One CUDA shm region", {"200": _json(_ref("CudaShmStatus"), "the region")})},
        "/v2/cudasharedmemory/region/{name}/register": {"parameters": [REGION], "post": _op(
            "Register a CUDA shm region", {"200": _empty("registered")},
            _ref("CudaShmRegister"), errors=(400, 403, 404, 405, 503))},
        "/v2/cudasharedmemory/region/{name}/unregister": {"parameters": [REGION], "post": _op(
            "Unregister a CUDA shm region", {"200": _empty("done")})},
    }
    for prefix, params in (("/v2/models/{model}", [MODEL]), ("/v2/models/{model}/versions/{version}",
                                                               [MODEL, VERSION])):
        infer = _op("Inference (KServe v2; with the binary tensor extension the JSON header is followed by "
                    "tensor bytes and its length is in Inference-Header-Content-Length; with a length of 0 the body is "
                    "one input's bytes alone, a raw binary request)",
                    {"200": {"description": "the outputs", "content": {
                        JSON: {"schema": _ref("InferResponse")},
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
                    _ref("InferRequest"))
        infer["parameters"] = [{"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                                "schema": {"type": "integer", "minimum": 0}}]
        paths.update({
            prefix: {"parameters": params, "get": _op("Model metadata", {
                "200": _json(_ref("ModelMetadata"), "metadata")})},
            prefix + "/ready": {"parameters": params, "get": _op("Model readiness", {
                "200": _empty("ready"), "400": _empty("not ready or unknown")}, errors=(404, 405, 503))},
            prefix + "/config": {"parameters": params, "get": _op("Model configuration", {
                "200": _json(_ref("ModelConfig"), "the configuration")})},
            prefix + "/stats": {"parameters": params, "get": _op("Model statistics", {
                "200": _json(_ref("ModelStats"), "stats")})},
            prefix + "/infer": {"parameters": params, "post": infer},
            prefix + "/generate": {"parameters": params, "post": _op(
                "Generate (one response)", {"200": _json(_ref("GenerateResponse"), "the response")},
                _ref("GenerateRequest"))},
            prefix + "/generate_stream": {"parameters": params, "post": _op(
                "Generate (server-sent events)", {"200": {"description": "one 'data: <JSON>' event per response",
                                                          "content": {"text/event-stream": {
                                                              "schema": {"type": "string"}}}}},
                _ref("GenerateRequest"))},
        })
    paths["/v2/models/{model}/trace/setting"] = {
        "parameters": [MODEL],
        "get": _op("A model's trace settings", {"200": _json(_ref("TraceSettings"), "current settings")}),
        "post": _op("Change a model's trace settings", {"200": _json(_ref("TraceSettings"), "new settings")},
                    _ref("TraceSettings"), required=False)}
    paths.update(_openai_paths())
    return paths


def _openai_paths() -> dict[str, Any]:
    """The OpenAI-compatible routes (openai.py): errors in OpenAI's form, bodies as OpenAI's API."""
    def op(summary: str, ok: dict[str, Any], body: bool = True) -> dict[str, Any]:
        responses = {"200": ok, "405": _json(_ref("Error"), "method not allowed on this endpoint")}
        responses.update({str(c): _json(_ref("OpenAIError"), "the error, in OpenAI's form") for c in (400, 404, 503)})
        out: dict[str, Any] = {"summary": summary, "responses": responses}
        if body:
            out["requestBody"] = {"required": True, "content": {JSON: {"schema": {
                "type": "object", "required": ["model"], "properties": {"model": {"type": "string"}}}}}}
        return out

    answer = {"type": "object", "required": ["object"], "properties": {"object": {"type": "string"}}}
    generated = {"description": "the answer, or with 'stream': true server-sent events ('data: [DONE]' last)",
                 "content": {JSON: {"schema": answer}, "text/event-stream": {"schema": {"type": "string"}}}}
    return {
        "/v1/models": {"get": op("OpenAI: the ready models", _json(answer, "a list of models"), body=False)},
        "/v1/models/{model}": {"parameters": [MODEL],
                               "get": op("OpenAI: one ready model", _json(answer, "the model"), body=False)},
        "/v1/completions": {"post": op("OpenAI: text completion", generated)},
        "/v1/chat/completions": {"post": op("OpenAI: chat completion", generated)},
        "/v1/embeddings": {"post": op("OpenAI: embeddings", _json(answer, "one vector per input"))},
    }


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "shmserve", "version": __version__,
                 "description": "KServe v2 inference protocol with Triton's HTTP extensions. Errors are "
                                "{\"error\": \"<message>\"}; 503 means overloaded or unavailable (retry)."},
        "paths": _paths(),
        "components": {"schemas": _schemas()},
    }


_DOCUMENT = orjson.dumps(openapi_document())


async def openapi_endpoint(request: Request) -> Response:
    return Response(_DOCUMENT, media_type=JSON)
