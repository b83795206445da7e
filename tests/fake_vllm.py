"""A stand-in for vLLM's weight-transfer HTTP routes, for the server's --engine vllm-http driver.

It answers the routes the driver calls (server/engines/driver.py) the way vLLM with the weightsync
backend does, and really reads the node's store: /init_weight_transfer_engine attaches an
EngineClient to the local socket with the token it was given, /update_weights acquires
that generation and copies every tensor written since into `weights`, releasing the lease as
applied. A test scripts bad answers per route (`script`), consumed before the normal ones.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from weightsync.engine import EngineClient, EngineError


class FakeVllm:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inits: list[dict] = []
        """Every init_info the driver sent, in order."""
        self.calls: list[str] = []
        """Every route called, in order ("GET /weight_info", "POST /start_weight_update", ...)."""
        self.script: dict[str, list[tuple[int, bytes]]] = {}
        """Route -> answers (status, raw body) to give first, one per call."""
        self.served: str | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.applied_generation = -1
        self.client: EngineClient | None = None
        self.attach_errors: list[str] = []
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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}"

    def tokens(self) -> list[str]:
        with self.lock:
            return [i["token"] for i in self.inits]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        if self.client is not None:
            self.client.close()

    # -- routes ------------------------------------------------------------------------
    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = json.loads(request.rfile.read(length)) if length else {}
        route = f"{method} {request.path}"
        with self.lock:
            self.calls.append(route)
            scripted = self.script.get(route)
            answer = scripted.pop(0) if scripted else None
        if answer is None:
            answer = self._answer(request.path, body)
        status, raw = answer
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(raw)))
        request.end_headers()
        request.wfile.write(raw)

    def _answer(self, path: str, body: dict) -> tuple[int, bytes]:
        if path == "/weight_info":
            return 200, json.dumps({"weight_version": self.served}).encode()
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            with self.lock:
                self.inits.append(info)
            if self.client is not None:
                self.client.close()
                self.client = None
            try:
                self.client = EngineClient(socket_path=info["local_socket"], name="", token=info["token"] or None,
                                           timeout=30)
            except EngineError as error:
                self.attach_errors.append(error.reason)
                return 500, json.dumps({"error": str(error)}).encode()
            return 200, b"{}"
        if path == "/update_weights":
            info = body["update_info"]
            if self.client is None:
                return 400, b'{"error": "NOT_INITIALIZED"}'
            if info.get("phase") == "prepare":
                return 200, b"{}"  # the real backend stages here; this fake copies at the apply
            try:
                with self.client.acquire(generation=info["generation"]) as snapshot:
                    for name in snapshot.changed_since(info["since_generation"]):
                        self.weights[name] = snapshot.tensors[name].clone()
                    snapshot.applied = True
                    self.applied_generation = snapshot.generation
            except EngineError as error:
                return 500, json.dumps({"error": str(error)}).encode()
            return 200, b"{}"
        if path == "/finish_weight_update":
            self.served = body["weight_version"]
            return 200, b"{}"
        return 200, b"{}"  # /start_weight_update
