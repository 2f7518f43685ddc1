"""The HTTP/REST frontend: KServe v2 as Triton serves it, translated onto the broker channel.

``Frontend`` holds the routes' handlers (Starlette); ``build_app`` puts them behind asgi.py's
``FrontendApp``, which takes POST .../infer itself. The frontend keeps no model state: every
answer comes from the broker, so any number of frontend processes can serve one port.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import time
from typing import Any, AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shmserve.server import __version__
from shmserve.server.edge.header_forward import add_to_request
from shmserve.server.edge.link import DEFAULT_SLOTS, BrokerError, BrokerLink
from shmserve.server.edge.metadata import EXTENSIONS, NAMED_REPOSITORY
from shmserve.server.edge.requests import (MAX_TENSOR_ELEMENTS, NOT_BOOL, NOT_OBJECT, NOT_STRING, NOT_UINT, BadRequest,
                                          JsonTypeError, is_uint, not_member, parse_json)
from shmserve.server.edge.shm_callers import ShmRefused, registering_caller, unregistering_caller
from shmserve.server.edge.tracing import RECEIVED, RECV_END, RECV_START, Trace, Tracer
from shmserve.server.shm_caller import ADMIN_GROUP
from shmserve.shm import control_messages as control
from shmserve.shm.completion import Completion
from shmserve.shm.descriptor import InferRequest
from shmserve.shm.streams import StreamEvents

from .asgi import FrontendApp
from .disconnect import ClientGone, unless_gone
from .error_status import generate_error_status
from .generate import EventStream, build_generate_request, generate_response, parse_generate_body, traced
from .inference import RETRY_AFTER_S, Headers, Inference
from .limits import descriptors_problem
from .openai import OpenAIFront
from .openai_errors import OpenAIError, is_openai_path
from .openai_errors import error_response as openai_error_response
from .openapi import openapi_endpoint
from .restricted import passed_group
from .settings import logging_endpoint, trace_endpoint
from .version_path import DIGITS  # noqa: F401 - registers the {version:digits} path convertor

log = logging.getLogger("shmserve.frontend")
JSON = "application/json"
# How long readiness waits for the broker's answer before it says 503 (a wedged broker must not hang probes).
READY_WAIT_S = 3.0


def json_response(doc: Any, status: int = 200, retry: bool = True) -> Response:
    """``doc`` as JSON; a 503 says when to try again (the broker's 503s too) unless ``retry`` is
    False: a refusal no retry changes."""
    headers = {"retry-after": str(RETRY_AFTER_S)} if status == 503 and retry else None
    return Response(orjson.dumps(doc), status_code=status, media_type=JSON, headers=headers)


def _refused(completion: Completion) -> bool:
    """Whether an error answer is a refusal from before its model ran (shm.answer.refusal)."""
    return completion.answer.refused


def _without_body(response: Response) -> Response:
    """A call that returns nothing succeeded: Triton answers it with an empty body (which it labels
    JSON; an empty body is not JSON, so it goes without a type here)."""
    return Response(status_code=200) if response.status_code == 200 else response


def error_response(status: int, message: str) -> Response:
    headers = {"retry-after": str(RETRY_AFTER_S)} if status == 503 else None
    return Response(orjson.dumps({"error": message}), status_code=status, media_type=JSON, headers=headers)


class Frontend:
    def __init__(self, server_id: str, arena_bytes: int = 256 << 20, max_input_bytes: int = 1 << 31,
                 max_tensor_elements: int = MAX_TENSOR_ELEMENTS, max_inflight: int = DEFAULT_SLOTS,
                 poll_us: int = 0, header_forward: re.Pattern[str] | None = None) -> None:
        self.server_id = server_id  # what /v2 reports as the server's name, as Triton reports its --id
        self.link = BrokerLink(server_id, arena_bytes, max_inflight, poll_us)
        self.tracer = Tracer(server_id)  # trace extension (server/edge/tracing.py)
        self.inference = Inference(self.link, max_input_bytes, max_tensor_elements, arena_bytes, header_forward)
        self.openai = OpenAIFront(self.link)

    async def _control(self, message: control.ControlMessage) -> tuple[int, Any]:
        return await self.link.control(message)

    async def _answer(self, message: control.ControlMessage) -> Response:
        try:
            status, answer = await self._control(message)
        except BrokerError as e:
            return error_response(e.status, str(e))
        return json_response(answer, status)

    async def _register(self, message: control.ControlMessage) -> Response:
        """``_answer`` of a region registration: a name registered already (409, gRPC's
        ALREADY_EXISTS) is a 400 over HTTP, as Triton's HTTP answers it."""
        response = await self._answer(message)
        if response.status_code == 409:
            response.status_code = 400
        return _without_body(response)

    # -- health and metadata --------------------------------------------------------------------
    async def live(self, request: Request) -> Response:
        """200 while this frontend can serve; 503 naming why not: it cannot open a descriptor, or
        its broker checks stopped succeeding (a broker that is down is readiness's matter)."""
        problem = descriptors_problem() or self.link.problem()
        return Response(status_code=200) if problem is None else error_response(503, problem)

    async def ready(self, request: Request) -> Response:
        """The broker's answer; 503 at once without a broker, and within READY_WAIT_S if it does not answer."""
        try:
            _, answer = await asyncio.wait_for(self._control(control.ServerReady()), READY_WAIT_S)
        except (BrokerError, asyncio.TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200 if answer.get("ready") else 400)

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": self.server_id, "version": __version__, "extensions": EXTENSIONS})

    @staticmethod
    def _model(request: Request) -> tuple[str, str]:
        p = request.path_params
        return p["model"], p.get("version", "")

    async def model_metadata(self, request: Request) -> Response:
        return await self._answer(control.ModelMetadata(*self._model(request)))

    async def model_config(self, request: Request) -> Response:
        return await self._answer(control.ModelConfig(*self._model(request)))

    async def canary(self, request: Request) -> Response:
        """GET: the canary's policy, split and decisions; POST: change its policy."""
        model = request.path_params["model"]
        if request.method == "GET":
            return await self._answer(control.CanaryStatus(model))
        try:
            settings = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as e:
            return error_response(400, f"malformed canary settings: {e}")
        if not isinstance(settings, dict):
            return error_response(400, "the canary settings must be a JSON object")
        return await self._answer(control.SetCanary(model, settings))

    async def canary_decision(self, request: Request) -> Response:
        model, action = request.path_params["model"], request.path_params["action"]
        if action not in ("promote", "rollback"):
            return error_response(404, f"unknown canary action '{action}' (promote or rollback)")
        return await self._answer(control.PromoteCanary(model) if action == "promote" else control.RollBackCanary(model))

    async def model_stats(self, request: Request) -> Response:
        p = request.path_params
        return await self._answer(control.ModelStatistics(p.get("model", ""), p.get("version", "")))

    async def infer_route(self, request: Request) -> Response:
        """Inference through Starlette: only for what FrontendApp did not take (it takes every
        POST to an infer path); this route makes other methods a 405 instead of a 404."""
        p = request.path_params
        status, out, headers = await self.infer(p["model"], p.get("version", ""), dict(request.headers.raw),
                                                await request.body())
        return Response(bytes(out), status_code=status, headers={k.decode(): v.decode() for k, v in headers})

    async def model_ready(self, request: Request) -> Response:
        try:
            _, answer = await self._control(control.ModelReady(*self._model(request)))
        except BrokerError as e:
            return error_response(e.status, str(e))
        if answer.get("ready"):
            return Response(status_code=200)
        return error_response(400, "Model version not ready")  # Triton's body for a model that is not ready

    async def repository_index(self, request: Request) -> Response:
        body = await request.body()
        try:
            opts = parse_json(body) if body else {}
            if not isinstance(opts, dict):
                raise BadRequest("the repository index request must be a JSON object whose 'ready' is a boolean")
            if not isinstance(opts.get("ready", False), bool):
                raise JsonTypeError(NOT_BOOL)  # (TritonJson's words, as a 400: docs/compatibility.md)
        except BadRequest as e:
            return error_response(400, str(e))
        return await self._answer(control.RepositoryIndex(opts.get("ready", False)))

    # -- repository API -------------------------------------------------------------------------
    async def _repository_call(self, request: Request, load: bool) -> Response:
        body = await request.body()
        try:
            doc = orjson.loads(body) if body else {}
            if not isinstance(doc, dict):
                raise BadRequest("the request must be a JSON object whose 'parameters' is an object")
            if not isinstance(doc.get("parameters", {}), dict):
                if load:  # (TritonJson's words, as a 400; an unload says so as above: docs/compatibility.md)
                    return error_response(400, NOT_OBJECT)
                raise BadRequest("the request must be a JSON object whose 'parameters' is an object")
        except (orjson.JSONDecodeError, BadRequest) as e:
            return error_response(400, f"failed to parse the request JSON buffer: {e}")
        model, parameters = request.path_params["model"], doc.get("parameters") or {}
        # (a load says whether it may carry 'file:' contents: server/broker/control.py)
        call = control.LoadModel(model, parameters, "key" if passed_group(request.scope) == "model-repository"
                                 else "open") if load else control.UnloadModel(model, parameters)
        try:
            status, answer = await self._control(call)
        except BrokerError as e:
            return error_response(e.status, str(e))
        if status != 200:  # (its 503: the model control mode takes no load or unload, whenever asked)
            return json_response(answer, status, retry=False)
        return Response(status_code=200)

    async def repository_load(self, request: Request) -> Response:
        return await self._repository_call(request, load=True)

    async def repository_unload(self, request: Request) -> Response:
        return await self._repository_call(request, load=False)

    async def named_repository_call(self, request: Request) -> Response:
        """A load or unload naming its repository: Triton's refusal (it serves its repositories as one)."""
        return error_response(501, NAMED_REPOSITORY)

    # -- inference ------------------------------------------------------------------------------
    async def infer(self, model: str, version: str, headers: dict[bytes, bytes], body: bytes
                    ) -> tuple[int, bytes | memoryview, Headers]:
        """``Inference.start_when_room`` as a coroutine."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def reply(status: int, out: bytes | memoryview, out_headers: Headers) -> None:
            if not fut.done():
                fut.set_result((status, out, out_headers))

        await self.inference.start_when_room(model, version, headers, body, reply)
        return await fut

    # -- generate extension ---------------------------------------------------------------------
    async def _generate_events(self, request: Request) -> tuple[StreamEvents, Trace | None, str] | Response:
        """The submitted request's events, its trace (None: not traced) and its id, or the answer
        of a request refused before it was submitted (never traced, as a gRPC stream's; see
        ``_sample``). Triton's order: the model, the body's encoding, then the body."""
        p = request.path_params
        model, version = p["model"], p.get("version", "")
        try:
            status, config = await self._control(control.ModelConfig(model, version))
            if status != 200:
                return error_response(status, config.get("error", "unknown model"))
            if request.headers.get("content-encoding", "identity") != "identity":
                raise BadRequest("Unsupported content-encoding, only 'identity' is supported.")
            body = parse_generate_body(await request.body())
            req, chunks = build_generate_request(model, version, body, config)
            add_to_request(req, self.inference.header_params(request.scope))
        except BadRequest as e:
            return error_response(e.status, str(e))
        except BrokerError as e:
            return error_response(e.status, str(e))
        trace = self._sample(request, model, req) if self.tracer.on else None
        try:
            return self.link.stream(req, chunks), trace, req.id
        except BrokerError as e:
            return traced(error_response(e.status, str(e)), trace, self.tracer)

    def _sample(self, request: Request, model: str, req: InferRequest) -> Trace | None:
        """A generate request's trace, if it is sampled: HTTP_RECV_* as asgi.py took them, and its
        other stamps as an infer request's (each response of generate_stream its own HTTP_SEND
        pair, as Triton's generate handler records)."""
        trace = self.tracer.sample(model)
        if trace is not None:
            req.sent_ns = time.monotonic_ns()
            trace.ns[RECV_START], trace.ns[RECV_END] = request.scope.get(RECEIVED) or (req.sent_ns, req.sent_ns)
            trace.mark(req)
        return trace

    async def generate(self, request: Request) -> Response:
        started = await self._generate_events(request)
        if isinstance(started, Response):
            return started
        events, trace, request_id = started
        try:
            answers, error = await unless_gone(
                self._generate_answers(request.path_params["model"], events, trace, request_id), request.receive)
        except BaseException as e:
            if trace is not None:
                self.tracer.finish(trace)  # cancelled (the client went away): what was timed
            if isinstance(e, ClientGone):
                return Response(status_code=499)  # nobody reads it
            raise
        if len(answers) + (error is not None) != 1:  # (as Triton: counted before what they say)
            # Triton's text (Triton sends it with a 200, having started the answer already).
            return traced(error_response(400, "generate expects model to produce exactly 1 response, use generate "
                                              "stream for model that generates various number of responses"),
                          trace, self.tracer)
        if error:
            return traced(error_response(*error), trace, self.tracer)
        return traced(Response(answers[0], media_type=JSON), trace, self.tracer)

    @staticmethod
    async def _generate_answers(model: str, events: StreamEvents, trace: Trace | None, request_id: str
                                ) -> tuple[list[bytes], tuple[int, str] | None]:
        """Every response of a generate request (its JSON), and its first error."""
        answers: list[bytes] = []
        error: tuple[int, str] | None = None
        try:
            while True:
                final, completion, _ = await events.next()
                try:
                    answer = completion.answer
                    if trace is not None:
                        trace.collect(answer)  # the version served; the final one ends the request
                    if completion.status != 200:
                        error = error or (generate_error_status(completion), answer.error or "inference failed")
                    elif not final:
                        answers.append(generate_response(model, answer, completion.tensor, request_id))
                finally:
                    completion.release()
                if final:
                    return answers, error
        finally:
            events.close()  # a failure or a cancelled wait before the end: free the rest as it comes

    async def generate_stream(self, request: Request) -> Response:
        started = await self._generate_events(request)
        if isinstance(started, Response):
            return started
        events, trace, request_id = started
        try:  # nothing is sent before the first event: a request refused before its model ran is a
            # plain error, as Triton's InferAsync failing; a model's error is an event of the stream
            first = await unless_gone(events.next(), request.receive)
        except BaseException as e:
            events.close()
            if trace is not None:
                self.tracer.finish(trace)
            if isinstance(e, ClientGone):
                return Response(status_code=499)  # nobody reads it
            raise
        final, completion, _ = first
        if final and completion.status != 200 and _refused(completion):
            try:
                message = completion.answer.error or "inference failed"
            finally:
                completion.release()
                events.close()
            return traced(error_response(completion.status, message), trace, self.tracer)
        # As Triton: a stream whose first event is an error (the model's, its only one or not) is a 400.
        status = generate_error_status(completion) if completion.status != 200 else 200
        return EventStream(request.path_params["model"], events, trace, self.tracer, request_id, first, status)

    # -- system shared memory -------------------------------------------------------------------
    @staticmethod
    def _peer(request: Request) -> tuple[str, int | None, tuple[str, int] | None]:
        """(peer host, peer port, our end) of the request's connection."""
        host, port = (request.client.host, request.client.port) if request.client else ("", None)
        server = request.scope.get("server")
        return host, port, (server[0], server[1]) if server and server[1] is not None else None

    @staticmethod
    def _admin(request: Request) -> bool:
        return passed_group(request.scope) == ADMIN_GROUP

    async def _registering(self, request: Request, kind: str) -> control.NetworkCaller | Response:
        """The caller of a register request, or the refusal of a peer that may not register:
        first, as Triton, the refusal of every register under --allow-client-shm=false, whatever
        the body says."""
        if not getattr(request.app.state, "allow_client_shm", True):
            return error_response(501, control.CLIENT_SHM_DISABLED)
        try:
            return await registering_caller(kind, *self._peer(request),
                                             getattr(request.app.state, "allow_remote_shm", False),
                                             self._admin(request))
        except ShmRefused as e:
            return error_response(e.status, str(e))

    async def _unregister(self, request: Request, cuda: bool) -> Response:
        caller = await unregistering_caller(*self._peer(request), self._admin(request))
        name = request.path_params.get("name")
        return _without_body(await self._answer(control.UnregisterCudaRegion(name, caller) if cuda
                                                else control.UnregisterSystemRegion(name, caller)))

    async def shm_register(self, request: Request) -> Response:
        caller = await self._registering(request, "system")
        if isinstance(caller, Response):
            return caller
        try:
            doc = orjson.loads(await request.body())
            if not isinstance(doc, dict):
                raise BadRequest("the register request must be a JSON object")
            for field in ("key", "byte_size"):  # Triton's words
                if field not in doc:
                    raise BadRequest(f"Shared memory register request has no '{field}' field")
            if not isinstance(doc["key"], str):  # (TritonJson's words, as a 400: docs/compatibility.md)
                raise JsonTypeError(NOT_STRING)
            if not (is_uint(doc.get("offset", 0)) and is_uint(doc["byte_size"])):
                raise JsonTypeError(NOT_UINT)
        except orjson.JSONDecodeError as e:
            return error_response(400, f"failed to parse the request JSON buffer: {e}")
        except BadRequest as e:
            return error_response(400, str(e))
        return await self._register(control.RegisterSystemRegion(request.path_params["name"], doc["key"],
                                                                 doc["byte_size"], doc.get("offset", 0), caller))

    async def shm_unregister(self, request: Request) -> Response:
        return await self._unregister(request, cuda=False)

    async def shm_status(self, request: Request) -> Response:
        return await self._answer(control.SystemRegionStatus(request.path_params.get("name")))

    # -- CUDA shared memory ----------------------------------------------------------------------
    async def cuda_register(self, request: Request) -> Response:
        caller = await self._registering(request, "CUDA")
        if isinstance(caller, Response):
            return caller
        try:
            doc = orjson.loads(await request.body())
            if not isinstance(doc, dict):
                raise BadRequest("the register request must be a JSON object")
            if "raw_handle" not in doc:  # Triton's words
                raise BadRequest("Shared memory register request has no 'raw_handle' field")
            handle = doc["raw_handle"]  # (TritonJson's words, as a 400: docs/compatibility.md)
            if not isinstance(handle, dict) or "b64" not in handle:
                raise JsonTypeError(not_member("b64"))
            raw = handle["b64"]
            if not isinstance(raw, str):
                raise JsonTypeError(NOT_STRING)
            for field in ("byte_size", "device_id"):  # both required, in Triton's order
                if field not in doc:
                    raise JsonTypeError(not_member(field))
                if not is_uint(doc[field]):
                    raise JsonTypeError(NOT_UINT)
            handle_b64 = cuda_handle_b64(raw)
        except orjson.JSONDecodeError as e:
            return error_response(400, f"failed to parse the request JSON buffer: {e}")
        except BadRequest as e:
            return error_response(400, str(e))
        return await self._register(control.RegisterCudaRegion(request.path_params["name"], handle_b64,
                                                               doc["byte_size"], doc["device_id"], caller))

    async def cuda_unregister(self, request: Request) -> Response:
        return await self._unregister(request, cuda=True)

    async def cuda_status(self, request: Request) -> Response:
        return await self._answer(control.CudaRegionStatus(request.path_params.get("name")))


_NOT_BASE64 = re.compile(rb"[^A-Za-z0-9+/]")
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def cuda_handle_b64(text: str) -> str:
    """The handle of an HTTP CUDA register as canonical base64, read as Triton's decoder (libb64)
    reads it: every character outside the alphabet skipped, '=' included. A handle that is not
    64 bytes is refused with Triton's words, before the registry is asked (where a name taken
    or a missing device would be the answer)."""
    digits = _NOT_BASE64.sub(b"", text.encode())
    if len(digits) * 3 // 4 != CUDA_IPC_HANDLE_BYTES:
        raise BadRequest("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")
    return base64.b64encode(base64.b64decode(digits + b"=" * (-len(digits) % 4))).decode()


def build_app(server_id: str, arena_bytes: int = 256 << 20, allow_remote_shm: bool = False,
              max_input_bytes: int = 1 << 31, max_tensor_elements: int = MAX_TENSOR_ELEMENTS,
              max_inflight: int = DEFAULT_SLOTS, poll_us: int = 0,
              header_forward: re.Pattern[str] | None = None, allow_client_shm: bool = True) -> FrontendApp:
    fe = Frontend(server_id, arena_bytes, max_input_bytes, max_tensor_elements, max_inflight, poll_us, header_forward)
    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version:digits}"  # Triton's [0-9]+: anything else is no route (404)
    routes = [
        Route("/v2/health/live", fe.live),
        Route("/v2/health/ready", fe.ready),
        Route("/v2", fe.server_metadata),
        Route("/v2/openapi.json", openapi_endpoint),
        Route("/v2/logging", logging_endpoint(fe.link), methods=["GET", "POST"]),
        Route("/v2/trace/setting", trace_endpoint(fe.link, fe.tracer), methods=["GET", "POST"]),
        Route(m + "/trace/setting", trace_endpoint(fe.link, fe.tracer), methods=["GET", "POST"]),
        Route("/v2/models/stats", fe.model_stats),
        Route(m + "/stats", fe.model_stats), Route(mv + "/stats", fe.model_stats),
        Route(m, fe.model_metadata), Route(mv, fe.model_metadata),
        Route(m + "/ready", fe.model_ready), Route(mv + "/ready", fe.model_ready),
        Route(m + "/config", fe.model_config), Route(mv + "/config", fe.model_config),
        Route("/v2/repository/index", fe.repository_index, methods=["POST"]),
        Route("/v2/repository/{repository}/index", fe.repository_index, methods=["POST"]),  # (the name ignored)
        Route("/v2/repository/models/{model}/load", fe.repository_load, methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", fe.repository_unload, methods=["POST"]),
        Route("/v2/repository/models/{model}/canary", fe.canary, methods=["GET", "POST"]),
        Route("/v2/repository/models/{model}/canary/{action}", fe.canary_decision, methods=["POST"]),
        Route("/v2/repository/{repository}/models/{model}/load", fe.named_repository_call, methods=["POST"]),
        Route("/v2/repository/{repository}/models/{model}/unload", fe.named_repository_call, methods=["POST"]),
        Route(m + "/infer", fe.infer_route, methods=["POST"]), Route(mv + "/infer", fe.infer_route, methods=["POST"]),
        Route(m + "/generate", fe.generate, methods=["POST"]), Route(mv + "/generate", fe.generate, methods=["POST"]),
        Route(m + "/generate_stream", fe.generate_stream, methods=["POST"]),
        Route(mv + "/generate_stream", fe.generate_stream, methods=["POST"]),
        Route("/v2/systemsharedmemory/region/{name}/register", fe.shm_register, methods=["POST"]),
        Route("/v2/systemsharedmemory/region/{name}/unregister", fe.shm_unregister, methods=["POST"]),
        Route("/v2/systemsharedmemory/unregister", fe.shm_unregister, methods=["POST"]),
        Route("/v2/systemsharedmemory/region/{name}/status", fe.shm_status),
        Route("/v2/systemsharedmemory/status", fe.shm_status),
        Route("/v2/cudasharedmemory/region/{name}/register", fe.cuda_register, methods=["POST"]),
        Route("/v2/cudasharedmemory/region/{name}/unregister", fe.cuda_unregister, methods=["POST"]),
        Route("/v2/cudasharedmemory/unregister", fe.cuda_unregister, methods=["POST"]),
        Route("/v2/cudasharedmemory/region/{name}/status", fe.cuda_status),
        Route("/v2/cudasharedmemory/status", fe.cuda_status),
        # OpenAI-compatible endpoints over text models (openai.py)
        Route("/v1/models", fe.openai.models),
        Route("/v1/models/{model}", fe.openai.model),
        Route("/v1/completions", fe.openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", fe.openai.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", fe.openai.embeddings, methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        fe.link.open_early()
        fe.tracer.start()
        yield
        fe.tracer.stop()
        fe.link.close()

    async def http_error(request: Request, exc: Exception) -> Response:
        """404 and 405 as JSON errors like every other answer (405 keeps its Allow header); in
        OpenAI's form under /v1/."""
        assert isinstance(exc, HTTPException)
        if is_openai_path(request.url.path):
            return openai_error_response(OpenAIError(exc.status_code, exc.detail), exc.headers)
        return Response(orjson.dumps({"error": exc.detail}), status_code=exc.status_code, headers=exc.headers,
                        media_type=JSON)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: http_error, 405: http_error})
    app.router.redirect_slashes = False  # Triton answers a path with a trailing slash 404, not a redirect
    app.state.allow_remote_shm = allow_remote_shm
    app.state.allow_client_shm = allow_client_shm  # --allow-client-shm (the broker refuses too)
    return FrontendApp(fe.inference, fe.tracer, app)
