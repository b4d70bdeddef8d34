"""Shared fixtures: the embedded model through nanokv and through HF transformers (fp32, CPU)."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "Who wrote Romeo and Juliet?",
]


@pytest.fixture(scope="session")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from nanokv.compute_service.model.loader import embedded_model_path

    path = embedded_model_path()
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="session")
def llm():
    """One shared engine on the embedded model; tests must leave it with no live requests."""
    from nanokv.gateway.llm import LLM

    return LLM(num_gpu_blocks=2048, block_size=16, max_num_batched_tokens=2048)


@pytest.fixture(scope="session")
def chat_ids(llm):
    return [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


# The gRPC API's tests share one `nanokv serve` (tests/helpers_grpc.py); imported here only when a test
# asks for it, so runs without gRPC tests start no server and load no stubs.
@pytest.fixture(scope="module")
def grpc_server():
    from tests.helpers_grpc import shared_server

    return shared_server()


@pytest.fixture(scope="module")
def grpc_channel(grpc_server):
    with grpc_server.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def grpc_stub(grpc_server, grpc_channel):
    return grpc_server.stub(grpc_channel)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    # EOS disabled rather than banned (min_new_tokens would mask it): the same as ignore_eos
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = [-1]  # no real token has id -1
    gc.pad_token_id = 0
    gc.max_new_tokens, gc.do_sample = n, False
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=gc)
    assert out.shape[1] == len(ids) + n
    return out[0, len(ids):].tolist()


def live_children() -> set[int]:
    """This process's live child processes, minus multiprocessing's resource tracker (one per process)."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: on the 2-core box two torch threads spin-wait each other (and a
    service process or a tensor-parallel worker takes the other core)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_leftover_processes():
    """One torch thread (the workers take the other core); no child process outlives the test."""
    import torch

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    before = live_children()
    yield
    torch.set_num_threads(torch_threads)
    assert live_children() <= before, "a tensor-parallel worker outlived its engine"
