"""An HTTP proxy in front of one backend (moto, the emulated API server) that injects faults.

Start it on a running event loop (``await FaultProxy(upstream).start()``); clients use ``url``
instead of the backend's. Every request is forwarded unchanged, unless a rule matches it first:

``fail(status, match=, times=)``   answer ``status`` (500, 503, 429 ...) with an AWS-style error
                                   body (``code``, e.g. ``Throttling``, ``ServiceUnavailable``)
``reset(match=, times=)``          close the connection without an answer
``stall(seconds, match=, times=)`` hold the request ``seconds`` before serving it (forwarded, or
                                   answered by a standing ``answer``/``handle`` rule)
``answer(status, body, match=)``   answer with a fixed body instead of the backend (a call the
                                   backend lacks; see :data:`EMPTY_CAPACITY_RESERVATIONS`)
``handle(fn, match=)``             answer with ``fn(request, body) -> (status, body)`` instead of
                                   the backend (calls answered from data: tests/support/ec2blocks.py)
``lose(match=, times=)``           let the request be served (by a standing ``answer``/``handle``
                                   rule, or the backend), then close the connection before the
                                   answer: the call happened, its caller never learns so

``match(request, body) -> bool`` sees the aiohttp request and its body; :func:`aws_action`
matches AWS query-protocol actions (``Action=...`` in the form body) and JSON-protocol ones
(``X-Amz-Target``). ``hits`` counts the requests each rule changed; ``requests`` counts all.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import aiohttp
from aiohttp import web

Match = Callable[[web.Request, bytes], bool]

#: DescribeCapacityReservations with no reservation, as EC2 answers it (API reference,
#: https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeCapacityReservations.html):
#: moto 5.2.5 does not implement the action (NotImplementedError, HTTP 500).
EMPTY_CAPACITY_RESERVATIONS = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    '<DescribeCapacityReservationsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
    "<requestId>00000000-0000-4000-8000-000000000000</requestId><capacityReservationSet/>"
    "</DescribeCapacityReservationsResponse>")

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


def aws_action(*names: str) -> Match:
    """Requests for these AWS actions (query protocol ``Action=``, or JSON ``X-Amz-Target``)."""
    def match(request: web.Request, body: bytes) -> bool:
        target = request.headers.get("X-Amz-Target", "")
        if target and target.rsplit(".", 1)[-1] in names:
            return True
        if request.method == "POST" and body[:1] not in (b"{", b"<"):
            try:
                action = parse_qs(body.decode("utf-8", "replace")).get("Action", [""])[0]
            except ValueError:
                return False
            return action in names
        return False
    return match


def path_contains(text: str) -> Match:
    return lambda request, body: text in request.path_qs


@dataclass
class Rule:
    kind: str  # fail | reset | stall | answer | handle | lose
    match: Match
    times: int | None
    status: int = 500
    code: str = "InternalError"
    seconds: float = 0.0
    body: str = ""
    hits: int = 0
    style: str = "query"  # fail: "query" (<ErrorResponse>), "ec2" (<Response><Errors>), "s3" (<Error>),
    # or "json" (SQS's JSON protocol: {"__type": ...} and x-amzn-query-error)
    fn: Callable[[web.Request, bytes], tuple[int, str]] | None = None

    def take(self, request: web.Request, body: bytes) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if not self.match(request, body):
            return False
        self.hits += 1
        return True


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.rules: list[Rule] = []
        self.requests = 0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ rules
    def _add(self, rule: Rule) -> Rule:
        """Newest first: a fault armed now wins over a standing ``answer``."""
        self.rules.insert(0, rule)
        return rule

    def fail(self, status: int = 500, *, code: str = "InternalError", match: Match = lambda r, b: True,
             times: int | None = None, style: str = "query") -> Rule:
        """``style="ec2"``: EC2's error body (``Response/Errors/Error``, ``RequestID``; EC2 API
        reference, "Error codes for the Amazon EC2 API"); ``"s3"``: S3's ``Error`` (S3 API
        reference, "Error responses"); ``"json"``: SQS's JSON protocol (``__type`` and the
        ``x-amzn-query-error`` header of a query-compatible service: botocore's sqs service model
        2012-11-05, ``awsQueryCompatible``); else the query protocol's ``ErrorResponse``."""
        return self._add(Rule("fail", match, times, status=status, code=code, style=style))

    def reset(self, *, match: Match = lambda r, b: True, times: int | None = None) -> Rule:
        return self._add(Rule("reset", match, times))

    def stall(self, seconds: float, *, match: Match = lambda r, b: True, times: int | None = None) -> Rule:
        return self._add(Rule("stall", match, times, seconds=seconds))

    def answer(self, body: str, *, status: int = 200, match: Match, times: int | None = None) -> Rule:
        return self._add(Rule("answer", match, times, status=status, body=body))

    def handle(self, fn: Callable[[web.Request, bytes], tuple[int, str]], *, match: Match,
               times: int | None = None) -> Rule:
        return self._add(Rule("handle", match, times, fn=fn))

    def lose(self, *, match: Match = lambda r, b: True, times: int | None = None) -> Rule:
        return self._add(Rule("lose", match, times))

    def clear(self, *, keep_answers: bool = True) -> None:
        self.rules = [r for r in self.rules if keep_answers and r.kind in ("answer", "handle")]

    # ------------------------------------------------------------------ serving
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests += 1
        lose = False
        response: web.StreamResponse | None = None
        for rule in list(self.rules):
            if not rule.take(request, body):
                continue
            if rule.kind == "lose":  # served below, then the answer is dropped
                lose = True
                continue
            if rule.kind == "answer":
                response = web.Response(status=rule.status, text=rule.body, content_type="text/xml")
            elif rule.kind == "handle":
                assert rule.fn is not None
                status, text = rule.fn(request, body)
                response = web.Response(status=status, text=text, content_type="text/xml")
            elif rule.kind == "fail":
                response = _error_response(rule)
            elif rule.kind == "reset":
                self._abort(request)
            elif rule.kind == "stall":  # then served as it would have been: by a standing answer or upstream
                await asyncio.sleep(rule.seconds)
                continue
            break
        if response is None:
            response = await self._forward(request, body)
        if lose:
            self._abort(request)
        return response

    @staticmethod
    def _abort(request: web.Request) -> None:
        assert request.transport is not None
        request.transport.abort()
        raise asyncio.CancelledError  # aiohttp drops the handler with the connection

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=body, allow_redirects=False) as upstream:
            payload: Any = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            if "Content-Encoding" in upstream.headers:
                out["Content-Encoding"] = upstream.headers["Content-Encoding"]
            return web.Response(status=upstream.status, body=payload, headers=out)


def _error_response(rule: Rule) -> web.Response:
    if rule.style == "json":  # SQS: JSON protocol, query-compatible (x-amzn-query-error)
        return web.Response(status=rule.status, content_type="application/x-amz-json-1.0",
                            headers={"x-amzn-query-error": f"{rule.code};Sender"},
                            text=json.dumps({"__type": f"com.amazonaws.sqs#{rule.code}",
                                             "message": "injected by the fault proxy"}))
    return web.Response(status=rule.status, content_type="text/xml", text=_error(rule))


def _error(rule: Rule) -> str:
    if rule.style == "s3":  # S3's REST error body (S3 API reference, "Error responses")
        return (f"<Error><Code>{rule.code}</Code><Message>injected by the fault proxy</Message>"
                f"<RequestId>0000000000000000</RequestId></Error>")
    if rule.style == "ec2":
        return (f"<Response><Errors><Error><Code>{rule.code}</Code><Message>injected by the fault proxy"
                f"</Message></Error></Errors><RequestID>00000000-0000-4000-8000-000000000000</RequestID></Response>")
    return (f"<ErrorResponse><Error><Type>Receiver</Type><Code>{rule.code}</Code>"
            f"<Message>injected by the fault proxy</Message></Error>"
            f"<RequestId>00000000-0000-4000-8000-000000000000</RequestId></ErrorResponse>")
