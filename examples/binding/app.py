"""Two models from one script: `python examples/binding/app.py`, then call them with tritonclient
(HTTP :8000, gRPC :8001), the local client, or curl (docs/binding.md)."""
import numpy as np

import shmserve


@shmserve.model(inputs={"x": (np.float32, [-1])}, outputs={"y": (np.float32, [-1])},
                max_batch_size=64, max_queue_delay_us=1000, instances=2)
def scale(x):
    return {"y": x * 2.0}                       # x: the requests of one batch, stacked


@shmserve.model(inputs={"text": (bytes, [1])}, outputs={"word": (bytes, [1])})
def words(text):
    for word in text[0].split():                # a generator streams: one response per word
        yield {"word": np.array([word], dtype=object)}


if __name__ == "__main__":
    shmserve.serve(http_port=8000)
