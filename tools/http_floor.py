"""The floor of any Python HTTP frontend: uvicorn as shmserve's frontend runs it (uvloop, httptools,
one process, the frontend's heap settings), with a bare ASGI app that answers each KServe v2
``infer`` with its own inputs as outputs and does nothing else: it reads the JSON header
(``Inference-Header-Content-Length``) with orjson, as the frontend does, and writes the answer's
JSON header and the input bytes back in Triton's binary tensor form.

Run as a third server beside Triton's and shmserve's HTTP endpoints (``tools/side_by_side.sh
paired``), it shows how much of shmserve's HTTP cost per request is uvicorn's and the sockets' own,
which no change to shmserve's code can remove::

    python -m shmserve.tools.http_floor --port 18703 &
    shmserve-perf -m add_sub -u 127.0.0.1:18600 --compare floor=127.0.0.1:18703 ...

Only ``infer`` and the health endpoints are answered; ``shmserve-perf`` asks the first server of a
run for the model's metadata, so the floor goes after it.
"""
from __future__ import annotations

import argparse
from typing import Any

import orjson

HEADER_LENGTH = b"inference-header-content-length"
READY = (b"/v2/health/ready", b"/v2/health/live")


def echo_answer(header: dict[str, Any], binary: memoryview, model: str) -> tuple[bytes, list[Any]]:
    """The answer's JSON header and its binary parts: input k's data as output k (named as the
    request names its outputs, else OUTPUT<k>)."""
    names = [o["name"] for o in header.get("outputs") or []]
    outputs: list[dict[str, Any]] = []
    parts: list[Any] = []
    offset = 0
    for k, tensor in enumerate(header.get("inputs") or []):
        out = {"name": names[k] if k < len(names) else f"OUTPUT{k}", "datatype": tensor["datatype"],
               "shape": tensor["shape"]}
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out["data"] = tensor.get("data")
        else:
            parts.append(binary[offset:offset + size])
            offset += size
            out["parameters"] = {"binary_data_size": size}
        outputs.append(out)
    return orjson.dumps({"model_name": model, "model_version": "1", "outputs": outputs}), parts


async def _send(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Health: 200. ``POST /v2/models/<m>[/versions/<v>]/infer``: the inputs back. Else 404."""
    if scope["type"] != "http":
        return
    path: bytes = scope["raw_path"]
    if path in READY:
        await _send(send, 200, [], b"")
        return
    if scope["method"] != "POST" or not path.endswith(b"/infer") or not path.startswith(b"/v2/models/"):
        await _send(send, 404, [], b'{"error":"not found"}')
        return
    chunks = []
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = memoryview(b"".join(chunks))
    length = next((int(v) for k, v in scope["headers"] if k == HEADER_LENGTH), len(body))
    head, parts = echo_answer(orjson.loads(body[:length]), body[length:], path.split(b"/")[3].decode())
    answer = b"".join([head, *parts])
    headers = [(b"content-type", b"application/octet-stream" if parts else b"application/json")]
    if parts:
        headers.append((HEADER_LENGTH, b"%d" % len(head)))
    await _send(send, 200, headers, answer)


def serve(address: str, port: int) -> None:
    import uvicorn

    from shmserve.shm import heap

    heap.keep_large_buffers()  # as the frontend does: else every large body is faulted in anew
    # A paired run's clients leave a server's connections idle while the others take their slices;
    # uvicorn's 5 s would close them under the clients' feet (a request sent as it closes fails).
    uvicorn.run(app, host=address, port=port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", lifespan="off", timeout_keep_alive=3600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18703)
    args = p.parse_args()
    serve(args.address, args.port)


if __name__ == "__main__":
    main()
