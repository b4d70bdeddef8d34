"""Triton's own Python client (`tritonclient.grpc`, from PyPI) against nanokv's KServe v2 service.

Run as a script by tests/gateway/test_grpc_tritonclient.py, in a process of its own: tritonclient ships its
own stubs of the same KServe protocol (package `inference`), and protobuf's default descriptor pool
refuses a second definition of `inference.ModelInferRequest` and the rest, so tritonclient and
nanokv's stubs cannot both be imported into one process.

    python -m tests.helpers_tritonclient ADDRESS API_KEY PROMPT MAX_TOKENS

prints one JSON object with what each client call returned.
"""

from __future__ import annotations

import json
import queue
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as tc

MODEL = "SmolLM2-135M-Instruct"


def prompt_input(prompt: str) -> Any:
    inp = tc.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return inp


def main(address: str, api_key: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {api_key}"}
    # tritonclient sends bool, int and str parameters only: temperature goes as an int, or as a
    # decimal string (nanokv reads both as the float it is)
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
    client = tc.InferenceServerClient(url=address)
    out: dict[str, Any] = {
        "live": client.is_server_live(headers=headers),
        "ready": client.is_server_ready(headers=headers),
        "model_ready": client.is_model_ready(MODEL, headers=headers),
        "unknown_model_ready": None,
    }
    try:
        client.is_model_ready("no-such-model", headers=headers)
    except tc.InferenceServerException as e:
        out["unknown_model_ready"] = {"status": e.status(), "message": e.message()}
    md = client.get_model_metadata(MODEL, headers=headers, as_json=True)
    out["metadata"] = {"name": md["name"], "inputs": md["inputs"], "outputs": md["outputs"]}

    result = client.infer(MODEL, [prompt_input(prompt)], headers=headers, parameters=params,
                          outputs=[tc.InferRequestedOutput("text_output"), tc.InferRequestedOutput("output_ids")])
    resp = result.get_response()
    out["infer"] = {"text": result.as_numpy("text_output")[0].decode(),
                    "ids": result.as_numpy("output_ids").tolist(),
                    "finish_reason": resp.parameters["finish_reason"].string_param}

    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
    client.async_stream_infer(MODEL, [prompt_input(prompt)], request_id="stream-1",
                              parameters={**params, "temperature": "0.0"})
    chunks: list[dict[str, Any]] = []
    while True:
        res, err = got.get(timeout=60)
        if err is not None:
            chunks.append({"error": str(err)})
            break
        r = res.get_response()
        chunks.append({"text": res.as_numpy("text_output")[0].decode(), "ids": res.as_numpy("output_ids").tolist(),
                       "final": r.parameters["triton_final_response"].bool_param, "id": r.id})
        if chunks[-1]["final"]:
            break
    client.stop_stream()
    client.close()
    out["stream"] = chunks
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
