"""An application container beside the server in one pod (deploy/kubernetes/pod-local-client/):
it calls models through the shared /dev/shm with the local client, no HTTP, no copy of tensors
in its regions. It waits for the server at start and reconnects when the server restarts.

    python examples/pod_client/app.py [server id] [requests per second]
"""
from __future__ import annotations

import sys
import time

import numpy as np

from shmserve import Client, InferenceServerError, ServerUnavailable


def connect(server_id: str) -> Client:
    """The server's container may start after ours, or restart: wait for it."""
    while True:
        try:
            client = Client(server_id)
            if client.is_server_ready():
                return client
            client.close()
        except ServerUnavailable as e:
            print(f"waiting for the server: {e}", flush=True)
        time.sleep(1.0)


def main() -> None:
    server_id = sys.argv[1] if len(sys.argv) > 1 else "shmserve"
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    while True:
        client = connect(server_id)
        inputs = client.create_region("app_inputs", 4096)  # travels by reference: no copy
        a = inputs.array(np.int32, (16,))
        a[:] = np.arange(16)
        try:
            while True:
                result = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
                print("add_sub:", result["OUTPUT0"][:4].tolist(), flush=True)
                time.sleep(1.0 / rate)
        except (ServerUnavailable, InferenceServerError) as e:
            if isinstance(e, InferenceServerError) and e.status != 503:
                raise
            print(f"the server went away ({e}); connecting again", flush=True)
            client.close()


if __name__ == "__main__":
    main()
