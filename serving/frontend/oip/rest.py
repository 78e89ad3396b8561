"""The Open Inference Protocol over HTTP/REST (KServe v2 REST, Triton's HTTP API with its binary
tensor data extension), served by each front end next to gRPC (``serve --http-port``):

    GET  /v2/health/live | /v2/health/ready | /v2
    GET  /v2/models/{name}[/versions/{version}]            metadata (the tensor contract)
    GET  /v2/models/{name}[/versions/{version}]/ready      200, or the error (404 unknown, 503 loading)
    GET  /v2/models/{name}[/versions/{version}]/config     Triton's model configuration
    GET  /v2/models[/{name}[/versions/{version}]]/stats    Triton's statistics extension
    POST /v2/models/{name}[/versions/{version}]/infer      JSON or JSON + binary tensors
    GET  /v2/systemsharedmemory[/region/{region}]/status   Triton's system shared memory extension
    POST /v2/systemsharedmemory/region/{region}/register   (serve --shared-memory system, oip/shm.py)
    POST /v2/systemsharedmemory[/region/{region}]/unregister
    GET|POST /v2/cudasharedmemory/...                      the same paths: no region, register 501

A translator like the gRPC servicer (oip/servicer.py): bodies <-> oip/protocol.py through
oip/jsonwire.py; errors become HTTP statuses (serving/errors.py) with the body ``{"error": message}``,
and requests are counted and traced under the gRPC method's name, in serving/frontend/status.py.
What aiohttp answers itself (no such path: 404, method: 405, a request that is not HTTP: 400, ...)
has that body too (:class:`JsonErrors`). Every GET path answers HEAD as HTTP requires (no body).
With ``--auth-token-file`` every path but live, ready and model ready needs ``Authorization: Bearer T``;
a request without it that sent ``Expect: 100-continue`` gets its 401 before it sends its body, as below.

JSON is parsed in the front end's event loop (``json.loads`` and the arrays from it: about 50 MB/s on
one core, docs/benchmarks.md, ``python -m bench.json_body``), and nothing else of that front end,
gRPC and health checks included, moves meanwhile; a thread would not help (json.loads holds the GIL
throughout; the loop stops as long). So a body's JSON, the whole body or the document before the
binary tensors, has a limit of its own, ``--max-json-mb`` (default 4: about 0.1 s of parsing), below
the body's: above it, 413 before the body is read where its length is known, with a message that says
to send tensors as binary data (Triton's binary tensor extension) or over gRPC, whose raw bytes cost
no parsing. A client that sent ``Expect: 100-continue`` gets that 413 instead of "100 Continue", before
it sends a byte of the body, and the connection closes after it.

Why aiohttp: its server runs in the front end's own asyncio loop beside grpc.aio (no thread, no
extra process, no copy between them), parses HTTP/1.1 with llhttp (C), takes SO_REUSEPORT so that
every front end listens on the one port as they do for gRPC, limits bodies (``client_max_size``: the
same --max-message-mb as gRPC, 413 above) and hands the body over as one bytes object, of which the
binary tensors are numpy views, as gRPC's raw_input_contents are.
"""
from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Callable, List, Optional

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_urldispatcher import _default_expect_handler

from serving.errors import Cancelled, InvalidInput, Overloaded, ServingError, TooLarge
from serving.frontend.oip import jsonwire
from serving.frontend.oip.protocol import (PLATFORM, InferRequest, Oip, model_config, model_metadata, request_options,
                                          server_version)
from serving.frontend.oip.shm import NO_SHARED_MEMORY, SharedMemory
from serving.frontend.security import authorized
from serving.frontend.status import Call, http_errors, peer

MODEL = "/v2/models/{name}"
VERSION = "/v2/models/{name}/versions/{version}"
OPEN = ("ServerLive", "ServerReady", "ModelReady")  # probes: no token needed (as over gRPC)
UNAUTHENTICATED = "missing or invalid bearer token"
# Set on a request whose Expect: 100-continue was not answered "100 Continue": its body never comes.
BODY_WITHHELD = web.RequestKey("body_withheld", bool)


class RestServicer:
    def __init__(self, engine, metrics, max_body_bytes: int, tokens: Optional[List[bytes]],
                 on_unauthenticated=lambda rpc, peer: None, model_control: str = "poll",
                 shared: SharedMemory = NO_SHARED_MEMORY, idle_timeout_s: float = 0.0,
                 max_json_bytes: Optional[int] = None) -> None:
        self.oip = Oip(engine, model_control, shared)
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        # the most JSON parsed from one body (--max-json-mb; None: as much as the body may hold)
        self.max_json_bytes = min(max_body_bytes, max_json_bytes or max_body_bytes)
        self.idle_timeout_s = idle_timeout_s  # a body that stops arriving for this long is cut off (0: never)
        # None: no --auth-token-file, every path open. A list (security.TokenFile's, replaced in place on
        # rotation): only its tokens, whatever it holds later (empty: none), as gRPC's interceptor.
        self.tokens = tokens
        self.on_unauthenticated = on_unauthenticated

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._close_where_body_withheld,
                                                                                   self._authenticate])
        get = [("/v2/health/live", self.ServerLive), ("/v2/health/ready", self.ServerReady),
               ("/v2", self.ServerMetadata), ("/v2/models/stats", self.ModelStatistics)]
        for base in (MODEL, VERSION):
            get += [(base, self.ModelMetadata), (base + "/ready", self.ModelReady), (base + "/config", self.ModelConfig),
                    (base + "/stats", self.ModelStatistics)]
            app.router.add_post(base + "/infer", self.ModelInfer, name=f"ModelInfer{base.count('/')}",
                                expect_handler=self._continue_unless(self._refuse_infer_early))
        bodiless = self._continue_unless(lambda request: None)  # no length limit to check, only the token
        json_object = self._continue_unless(self._refuse_json_object_early)
        app.router.add_post("/v2/repository/index", self.RepositoryIndex, name="RepositoryIndex",
                            expect_handler=json_object)
        app.router.add_post("/v2/repository/models/{name}/load", self.RepositoryModelLoad, name="RepositoryModelLoad",
                            expect_handler=json_object)
        app.router.add_post("/v2/repository/models/{name}/unload", self.RepositoryModelUnload,
                            name="RepositoryModelUnload", expect_handler=json_object)
        for kind, status, register, unregister in (
                ("system", self.SystemSharedMemoryStatus, self.SystemSharedMemoryRegister,
                 self.SystemSharedMemoryUnregister),
                ("cuda", self.CudaSharedMemoryStatus, self.CudaSharedMemoryRegister, self.CudaSharedMemoryUnregister)):
            base = f"/v2/{kind}sharedmemory"
            get += [(base + "/status", status), (base + "/region/{region}/status", status)]
            app.router.add_post(base + "/region/{region}/register", register, name=register.__name__,
                                expect_handler=json_object)
            for path in (base + "/unregister", base + "/region/{region}/unregister"):
                app.router.add_post(path, unregister, name=f"{unregister.__name__}{path.count('/')}",
                                    expect_handler=bodiless)
        for path, handler in get:
            app.router.add_get(path, handler, name=f"{handler.__name__}{path.count('/')}",  # and HEAD
                               expect_handler=bodiless)
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        rpc = self._unauthenticated(request)
        if rpc:
            self.on_unauthenticated(rpc, peer(request))
            return web.json_response({"error": UNAUTHENTICATED}, status=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except web.HTTPException as e:  # no such path (404) or method (405): the protocol's error body
            if e.status < 400:
                raise
            return web.json_response({"error": f"{e.reason}: {request.method} {request.path[:200]}"}, status=e.status,
                                     headers={k: v for k, v in e.headers.items() if k == "Allow"})

    @web.middleware
    async def _close_where_body_withheld(self, request: web.Request, handler):
        """A request whose body the client was told not to send (its 413 or 401 answered ``Expect: 100-continue``):
        the connection closes after the answer, and the answer says so. Kept open, the client's next
        request on it would be read as the body its headers announced (RFC 9112 9.6, RFC 9110 10.1.1)."""
        response = await handler(request)
        if request.get(BODY_WITHHELD):
            response.force_close()
        return response

    def _unauthenticated(self, request: web.Request) -> str:
        """The RPC of a request that needs a token and lacks a valid one ('' where it may go on)."""
        rpc = (request.match_info.route.name or "").rstrip("0123456789")
        return rpc if rpc and rpc not in OPEN and not self._trusted(request) else ""

    def _trusted(self, request: web.Request) -> bool:
        """No token needed (no --auth-token-file), or a valid one sent."""
        return self.tokens is None or authorized(self.tokens, request.headers.get("Authorization"))

    @http_errors("ServerLive")
    async def ServerLive(self, request: web.Request, call: Call) -> web.Response:
        return web.json_response({"live": True})

    @http_errors("ServerReady")
    async def ServerReady(self, request: web.Request, call: Call) -> web.Response:
        if not self.oip.ready:  # raised, not returned: counted UNAVAILABLE like the 503 it is
            raise Overloaded("the server is not ready: loading models, or shutting down")
        return web.json_response({"ready": True})

    @http_errors("ServerMetadata")
    async def ServerMetadata(self, request: web.Request, call: Call) -> web.Response:
        return web.json_response({"name": PLATFORM, "version": server_version(),
                                  "extensions": self.oip.extensions + ["binary_tensor_data"]})

    @http_errors("ModelReady")
    async def ModelReady(self, request: web.Request, call: Call) -> web.Response:
        name, version = _model(request)
        # raises 404 (unknown) or 503 (loading, shutting down); without a token, a 404 that tells nothing
        self.oip.served(name, version, call, detailed=self._trusted(request))
        return web.json_response({"name": name, "ready": True})

    @http_errors("ModelMetadata")
    async def ModelMetadata(self, request: web.Request, call: Call) -> web.Response:
        name, version = _model(request)
        schema, versions = self.oip.model(name, version, call)
        return web.json_response(model_metadata(name, versions, schema, self.oip.settings(name)))

    @http_errors("ModelConfig")
    async def ModelConfig(self, request: web.Request, call: Call) -> web.Response:
        name, version = _model(request)
        schema, _ = self.oip.model(name, version, call)
        return web.json_response(model_config(name, schema, self.oip.settings(name)))

    @http_errors("ModelStatistics")
    async def ModelStatistics(self, request: web.Request, call: Call) -> web.Response:
        name, version = _model(request)
        return web.json_response({"model_stats": await self.oip.statistics(name, version, call)})

    @http_errors("RepositoryIndex")
    async def RepositoryIndex(self, request: web.Request, call: Call) -> web.Response:
        body = await self._json_object(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("'ready' must be true or false")
        return web.json_response(self.oip.repository_index("", ready))

    @http_errors("RepositoryModelLoad")
    async def RepositoryModelLoad(self, request: web.Request, call: Call) -> web.Response:
        body = await self._json_object(request)
        await self.oip.control("load", "", request.match_info["name"], _parameters(body), call)
        return web.json_response({})

    @http_errors("RepositoryModelUnload")
    async def RepositoryModelUnload(self, request: web.Request, call: Call) -> web.Response:
        body = await self._json_object(request)
        await self.oip.control("unload", "", request.match_info["name"], _parameters(body), call)
        return web.json_response({})

    @http_errors("SystemSharedMemoryStatus")
    async def SystemSharedMemoryStatus(self, request: web.Request, call: Call) -> web.Response:
        return web.json_response([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                                  for r in self.oip.shared.status(request.match_info.get("region", ""))])

    @http_errors("SystemSharedMemoryRegister")
    async def SystemSharedMemoryRegister(self, request: web.Request, call: Call) -> web.Response:
        body = await self._json_object(request)
        key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str) or type(offset) is not int or type(size) is not int or offset < 0 or size < 0:
            raise InvalidInput('the body must be {"key": string, "offset": integer >= 0, "byte_size": integer >= 0}')
        self.oip.shared.register(request.match_info["region"], key, offset, size)
        return web.json_response({})

    @http_errors("SystemSharedMemoryUnregister")
    async def SystemSharedMemoryUnregister(self, request: web.Request, call: Call) -> web.Response:
        self.oip.shared.unregister(request.match_info.get("region", ""))
        return web.json_response({})

    @http_errors("CudaSharedMemoryStatus")
    async def CudaSharedMemoryStatus(self, request: web.Request, call: Call) -> web.Response:
        return web.json_response(self.oip.shared.cuda_status(request.match_info.get("region", "")))

    @http_errors("CudaSharedMemoryRegister")
    async def CudaSharedMemoryRegister(self, request: web.Request, call: Call) -> web.Response:
        self.oip.shared.cuda_register()
        return web.json_response({})

    @http_errors("CudaSharedMemoryUnregister")
    async def CudaSharedMemoryUnregister(self, request: web.Request, call: Call) -> web.Response:
        self.oip.shared.cuda_unregister(request.match_info.get("region", ""))
        return web.json_response({})

    @http_errors("ModelInfer")
    async def ModelInfer(self, request: web.Request, call: Call) -> web.Response:
        name, version = _model(request)
        header_length = request.headers.get(jsonwire.HEADER_LENGTH)
        self._refuse_infer_early(request)
        body = await _body(request, self.max_body_bytes, self.idle_timeout_s)
        with call.step("decode"):
            infer = jsonwire.parse_infer(body, header_length, self.max_json_bytes)
            only, until = request_options(infer.parameters, None)
        try:
            answered, outputs = await self.oip.infer(
                InferRequest(name, version, infer.output_names, only,
                             lambda expected: jsonwire.arrays(infer, expected, self.oip.shared), infer.output_places),
                until, call)
            with call.step("encode"):
                payload, header_length = jsonwire.infer_response(outputs, infer, name, answered, self.oip.shared)
        finally:  # the regions its outputs were checked against (oip/shm.py)
            self.oip.shared.release(infer.output_places)
        if header_length is None:
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, content_type="application/octet-stream",
                            headers={jsonwire.HEADER_LENGTH: str(header_length)})

    def _continue_unless(self, refuse: Callable[[web.Request], None]):
        """A route's ``Expect: 100-continue`` handler: aiohttp's "100 Continue", but none for a request
        without a valid token (--auth-token-file) or that ``refuse`` raises for (its lengths are past a
        limit): the 401 of :meth:`_authenticate` or its handler's 413 is then the first answer, the client,
        which waits for one, never sends the body (RFC 9110 10.1.1), and the connection closes after it
        (:meth:`_close_where_body_withheld`)."""
        async def expect(request: web.Request) -> None:
            withheld = bool(self._unauthenticated(request))  # _authenticate answers it, before any handler
            if not withheld:
                try:
                    refuse(request)
                except ServingError:  # the handler raises it again, before it reads the body, and answers it
                    withheld = True
            if withheld:
                request[BODY_WITHHELD] = True
                return None
            return await _default_expect_handler(request)

        return expect

    def _refuse_infer_early(self, request: web.Request) -> None:
        header_length = request.headers.get(jsonwire.HEADER_LENGTH)
        self._refuse_early(request, jsonwire.json_too_large if header_length is None else None)
        jsonwire.refuse_stated_json(header_length, self.max_json_bytes)  # the binary extension's JSON

    def _refuse_json_object_early(self, request: web.Request) -> None:
        self._refuse_early(request, json_object_too_large)

    def _refuse_early(self, request: web.Request, json_too_large) -> None:
        """413 before the body is read, where its length says it is too large: larger than the body's
        limit, or (``json_too_large``: the message for it, None where the body is not all JSON) than
        the JSON one. A compressed body's length is not what it holds: it is refused once read."""
        length = request.content_length
        if length is None or request.headers.get(hdrs.CONTENT_ENCODING, "identity").lower() != "identity":
            return
        if length > self.max_body_bytes:
            raise body_too_large(self.max_body_bytes)
        if json_too_large is not None and length > self.max_json_bytes:
            raise json_too_large(length, self.max_json_bytes)

    async def _json_object(self, request: web.Request) -> dict:
        """A small JSON object body (the repository and shared memory extensions'); an empty body is {}."""
        self._refuse_json_object_early(request)
        raw = await _body(request, self.max_body_bytes, self.idle_timeout_s)
        if len(raw) > self.max_json_bytes:  # a compressed body, or one of no stated length
            raise json_object_too_large(len(raw), self.max_json_bytes)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            body = None
        if not isinstance(body, dict):
            raise InvalidInput("the request body must be a JSON object")
        return body


async def _body(request: web.Request, limit: int, idle_s: float) -> bytes:
    """The whole body; a client that sends none of it for ``idle_s`` (--idle-timeout; 0: no limit) is
    cut off: aiohttp's keep-alive timeout stops at the headers, and a stalled body (slowloris) would
    hold its connection, which --max-connections does not count, for good."""
    try:
        if not idle_s or request.content.is_eof():  # all of it here already (the common case)
            return await request.read()
        body = bytearray()
        async with asyncio.timeout(idle_s) as stalled:
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
                stalled.reschedule(asyncio.get_running_loop().time() + idle_s)
        return bytes(body)
    except TimeoutError:
        if request.transport is not None:
            request.transport.close()
        raise Cancelled(f"the client sent no byte of its body for {idle_s:g} s (serve --idle-timeout)") from None
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None
    except ConnectionError:  # the client went away while sending it
        raise Cancelled("the client went away") from None
    except RequestPayloadError as e:  # e.g. a Content-Encoding its bytes are not in
        raise InvalidInput(f"the request body cannot be read ({str(e)[:200]})") from None


def body_too_large(limit: int) -> TooLarge:
    return TooLarge(f"the request body is larger than the server's limit of {limit} bytes (serve --max-message-mb); "
                    "split the request")


def json_object_too_large(size: int, limit: int) -> TooLarge:
    """A body of the repository or shared memory extensions past the JSON limit (no tensors in it)."""
    return TooLarge(f"the request's JSON is {size} bytes, more than the {limit} this server parses "
                    "(serve --max-json-mb)")


class JsonErrors(RequestHandler):
    """aiohttp's connection handler, whose own answers carry the protocol's error body
    ``{"error": message}`` (KServe's REST errors), not aiohttp's text: a request that does not parse
    as HTTP (400, message's first line only: it quotes the client's bytes), an HTTP error raised
    outside the middleware (an ``Expect`` other than 100-continue: 417), and an exception that
    escapes a handler (500, "internal error" as serving/frontend/status.py answers). The connection
    is closed after them, as aiohttp does."""

    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if an answer was begun
        lines = (message or "").strip().splitlines()
        first = lines[0].rstrip(":") if lines else ""
        if status >= 500:
            text = "internal error"
        else:
            text = f"{_reason(status)}: {first[:200]}" if first else _reason(status)
        response = web.json_response({"error": text}, status=status)
        response.force_close()
        return response

    async def finish_response(self, request, resp: web.StreamResponse, start_time):
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            text = (resp.text or "").strip()
            if text in ("", f"{resp.status}: {resp.reason}"):  # aiohttp's text when none is given
                text = ""
            resp = web.json_response({"error": f"{resp.reason}: {text[:200]}" if text else resp.reason},
                                     status=resp.status, headers={k: v for k, v in resp.headers.items()
                                                                  if k in (hdrs.ALLOW, hdrs.WWW_AUTHENTICATE)})
        return await super().finish_response(request, resp, start_time)


def connections(server: web.Server, **handler_args):
    """The protocol factory for ``loop.create_server``: :class:`JsonErrors` connections of the aiohttp
    ``server`` (an AppRunner's), ``handler_args`` being those the runner was given for them."""
    loop = asyncio.get_running_loop()
    return lambda: JsonErrors(server, loop=loop, **handler_args)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


def _parameters(body: dict) -> dict:
    """A load or unload request's ``parameters`` (absent: none)."""
    parameters = body.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return parameters


def _model(request: web.Request):
    return request.match_info.get("name", ""), request.match_info.get("version", "")

