"""A stand-in for SGLang's HTTP routes, for the server's --engine sglang-http driver.

It answers the routes the driver calls (server/engines/sglang.py) the way SGLang 0.5.23 with
weightsync's loader does, and really reads the node's store: /update_weights_from_tensor decodes
the weightsync request (engine/sglang/request.py) of each TP rank's entry, acquires that
generation over the local socket and copies every tensor written since into each rank's
`rank_weights` (`weights`: rank 0's), releasing the lease as applied. Like the loader's ranks, the
fake's agree first: a rank whose entry is malformed, or one told to refuse (`rank_refusals`, rank ->
"REASON: ...", for the next update), makes every rank keep its weights, and the answer, rank 0's
message as SGLang gives it, names every rank's outcome. Like SGLang it refuses a second /begin_weight_update, an update or an end
outside one, answering 400 {"success": false, "message": ...}; /pause_generation and
/continue_generation set `paused`. A test scripts answers per route (`script`), consumed before the
normal ones: (status, raw body), or (status, raw body, event) to hold the answer until the event is
set (a call the driver times out on).
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from weightsync.engine import EngineClient, EngineError
from weightsync.engine.request import RequestError, UpdateRequest
from weightsync.engine.sglang.request import LOAD_FORMAT

Answer = tuple[int, bytes] | tuple[int, bytes, threading.Event]


class FakeSglang:
    def __init__(self, tp_size: int = 2) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, dict]] = []
        """Every (route, JSON body) the driver sent, in order ("POST /pause_generation", {"mode": ...})."""
        self.script: dict[str, list[Answer]] = {}
        self.requests: list[UpdateRequest] = []
        """The weightsync request of every update the fake read (rank 0's entry)."""
        self.rank_refusals: dict[int, str] = {}
        """Rank -> the verdict ("REASON: ...") it answers the next update with; consumed by it."""
        self.socket_path = ""
        """The node's local socket (GetServerInfo.local_socket): set it before the first commit."""
        self.restart(tp_size)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                fake._handle(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                fake._handle(self, "POST")

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def restart(self, tp_size: int = 2) -> None:
        """A new SGLang instance at this URL: its checkpoint's weights, version "default"."""
        with self.lock:
            self.tp_size = tp_size
            self.served = "default"
            self.rank_weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
            self.paused = False
            self.session = False

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's weights (every rank holds the same unless a test says otherwise)."""
        return self.rank_weights[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}"

    def routes(self) -> list[str]:
        """The routes called so far but the version polls (GET /model_info)."""
        with self.lock:
            return [route for route, _ in self.calls if route != "GET /model_info"]

    def body(self, route: str, index: int = -1) -> dict:
        with self.lock:
            return [body for called, body in self.calls if called == route][index]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    # -- routes ------------------------------------------------------------------------
    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = json.loads(request.rfile.read(length)) if length else {}
        route = f"{method} {request.path}"
        with self.lock:
            self.calls.append((route, body))
            scripted = self.script.get(route)
            answer = scripted.pop(0) if scripted else None
        if answer is None:
            answer = self._answer(request.path, body)
        elif len(answer) == 3:
            answer[2].wait(60)
        status, raw = answer[0], answer[1]
        try:
            request.send_response(status)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(raw)))
            request.end_headers()
            request.wfile.write(raw)
        except OSError:
            pass  # the driver stopped waiting for this answer

    def _answer(self, path: str, body: dict) -> tuple[int, bytes]:
        with self.lock:
            if path == "/model_info":
                return 200, json.dumps({"model_path": "/tiny", "weight_version": self.served}).encode()
            if path == "/server_info":
                return 200, json.dumps({"tp_size": self.tp_size, "dp_size": 1, "version": "0.5.23"}).encode()
            if path == "/pause_generation":
                self.paused = True
                return 200, b'{"message": "Generation paused successfully.", "status": "ok"}'
            if path == "/continue_generation":
                self.paused = False
                return 200, b'{"message": "Generation continued successfully.", "status": "ok"}'
            if path == "/begin_weight_update":
                if self.session:
                    return _refuse("a weight-update session is already open; call end_weight_update() first")
                self.session = True
                return 200, b'{"success": true, "message": "Success"}'
            if path == "/end_weight_update":
                if not self.session:
                    return _refuse("no weight-update session is open; call begin_weight_update() first")
                self.session = False
                return 200, b'{"success": true, "message": "Success"}'
            if path == "/update_weight_version":
                self.served = body["new_version"]
                return 200, json.dumps({"success": True, "message": "updated",
                                        "new_version": body["new_version"]}).encode()
            if path == "/update_weights_from_tensor":
                if not self.session:
                    return _refuse("update_weights_from_tensor must run between begin_weight_update() and "
                                   "end_weight_update()")
                return self._update(body)
        return 404, b'{"detail": "Not Found"}'

    def _update(self, body: dict) -> tuple[int, bytes]:
        entries = body["serialized_named_tensors"]
        if body.get("load_format") != LOAD_FORMAT or len(entries) != self.tp_size:
            return _refuse(f"load_format {body.get('load_format')!r} with {len(entries)} entries")
        requests: list[UpdateRequest | None] = []
        verdicts: list[str] = []
        for rank, raw in enumerate(entries):
            try:
                requests.append(UpdateRequest.from_named_tensors(pickle.loads(base64.b64decode(raw))))  # noqa: S301 - our own bytes
                verdicts.append(self.rank_refusals.pop(rank, ""))
            except RequestError as error:
                requests.append(None)
                verdicts.append(f"REQUEST_MALFORMED: {error}")
        ranks = "; ".join(f"rank tp{r}/{self.tp_size} " + (f"refused: {v}" if v else "ready")
                          for r, v in enumerate(verdicts))
        request = requests[0]
        if request is None or None in requests:
            return _refuse(f"the version not loaded, the engine keeps its weights: {ranks}")
        self.requests.append(request)
        try:
            with EngineClient(socket_path=self.socket_path, name="", timeout=30) as client, \
                    client.acquire(generation=request.generation) as snapshot:
                if any(verdicts):
                    return _refuse(f"version {snapshot.version.version!r} (generation {snapshot.generation}) not "
                                   f"loaded, the engine keeps its weights: {ranks}")
                for weights in self.rank_weights:
                    for name in snapshot.changed_since(request.since_generation):
                        weights[name] = snapshot.tensors[name].clone()
                snapshot.applied = True
        except EngineError as error:
            return _refuse(str(error))
        return 200, b'{"success": true, "message": "Success"}'


def _refuse(message: str) -> tuple[int, bytes]:
    return 400, json.dumps({"success": False, "message": message}).encode()
