"""Python clients for both frontends, sync and asyncio.

    with SocketClient("run/escapement.sock") as c:
        r = c.infer("digits_mlp", {"INPUT__0": x})      # x: np.ndarray [batch, 64] float32
        r.outputs["OUTPUT__0"]

`AsyncSocketClient` keeps many requests in flight on one connection, matched by id.

Shared memory (Triton's system shared-memory extension, on the socket): register a region of a
POSIX shared-memory object, then pass `ShmInput`s for inputs and `ShmOutput`s for outputs:

    c.register_shared_memory("in", "/my_input", nbytes)
    r = c.infer("m", {"INPUT__0": ShmInput("in", nbytes, "FP32", [1, 64])},
                outputs=[ShmOutput("OUTPUT__0", "out", 40)])
    r.in_regions["OUTPUT__0"]   # {"datatype", "shape", "parameters": where it was written}

Applications (docs/applications.md): `app_infer` answers an `AppResult` whose `query_id`
`app_feedback` names with the true label or a reward.

`HttpClient` / `AsyncHttpClient` speak KServe v2 with binary tensors. Errors raise
`InferenceServerError` with the daemon's status and message.

The socket clients are in uds.py, the HTTP clients in http.py, and what both put on and read from
the wire in wire.py; this module is the names a user imports.
"""

from daemon.client.http import AsyncHttpClient, HttpClient
from daemon.client.uds import AsyncSocketClient, SocketClient
from daemon.client.wire import AppResult, InferenceServerError, InferResult, ShmInput, ShmOutput

__all__ = ["AppResult", "AsyncHttpClient", "AsyncSocketClient", "HttpClient", "InferResult", "InferenceServerError",
           "ShmInput", "ShmOutput", "SocketClient"]
