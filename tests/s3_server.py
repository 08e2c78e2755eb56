"""A real S3-compatible HTTP server on 127.0.0.1 for the tests (moto's server mode, in a thread).

The tests talk to it over HTTP with the same clients a user's run uses (pyarrow's S3 file system,
configured by the standard AWS_* environment variables), so a subprocess `batchinfer run` reaches
it too. One fix on the wire: moto names the root element of a CompleteMultipartUpload answer
`CompleteMultipartUploadResponse` where S3 sends `CompleteMultipartUploadResult`, and the AWS C++
SDK inside pyarrow then takes the answer for an error; the server renames that one element.
"""

from __future__ import annotations

import socket
from typing import Any

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server


def _s3_compatible(app: Any) -> Any:
    def wsgi(environ: dict, start_response: Any) -> list[bytes]:
        seen: dict[str, Any] = {}

        def capture(status: str, headers: list, exc_info: Any = None) -> None:
            seen["status"], seen["headers"] = status, headers

        body = b"".join(app(environ, capture))
        if b"<CompleteMultipartUploadResponse" in body:
            body = body.replace(b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult")
            seen["headers"] = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in seen["headers"]]
        start_response(seen["status"], seen["headers"])
        return [body]

    return wsgi


class S3Server(ThreadedMotoServer):
    """moto's threaded server with the answer fix above."""

    def _server_entry(self) -> None:
        self._server = make_server(self._ip_address, self._port, _s3_compatible(DomainDispatcherApplication(create_backend_app)), True)
        self._server_ready_event.set()
        self._server.serve_forever()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start() -> tuple[S3Server, dict[str, str]]:
    """(server, the AWS_* environment that points clients at it)."""
    port = free_port()
    server = S3Server(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    return server, env
