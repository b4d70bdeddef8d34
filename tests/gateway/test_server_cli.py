"""`nanokv serve` argument wiring: no model is loaded here."""

from __future__ import annotations

import argparse

import pytest

from nanokv.config import EngineConfig
from nanokv.gateway.http.cli import _is_loopback, add_serve_args, engine_kwargs, serve_main


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_defaults_bind_loopback_and_pass_no_engine_keys():
    args = parse()
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key is None
    assert engine_kwargs(args) == {}  # EngineConfig keeps its own defaults


def test_every_config_key_has_a_flag():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    dests = {a.dest for a in parser._actions}
    missing = [name for name in EngineConfig.keys() if name not in dests]
    assert not missing


def test_flags_map_to_engine_config():
    args = parse("--model", "m.gguf", "--block-size", "32", "--num-gpu-blocks", "64", "--max-num-seqs", "4",
                 "--eviction-policy", "arc", "--enable-compression", "--quantization-bitwidth", "4",
                 "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                 "--api-key", "a", "--api-key", "b", "--host", "0.0.0.0", "--port", "9000")
    cfg = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (cfg.model, cfg.block_size, cfg.num_gpu_blocks, cfg.max_num_seqs) == ("m.gguf", 32, 64, 4)
    assert cfg.eviction_policy == "arc" and cfg.enable_compression and not cfg.enable_prefix_caching
    assert cfg.quantization_bitwidth == {"default": 4, "layers": {}} and cfg.gpu_memory_utilization == 0.5
    assert args.api_key == ["a", "b"] and args.port == 9000


def test_per_layer_bitwidth_json():
    args = parse("--quantization-bitwidth", '{"default": 4, "layers": {"0": 8}}')
    cfg = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert cfg.quantization_bitwidth == {"default": 4, "layers": {"0": 8}}


def test_bad_config_exits_2_naming_the_flag(capsys):
    assert serve_main(parse("--eviction-policy", "random")) == 2
    err = capsys.readouterr().err
    assert "--eviction-policy" in err and "lru" in err


def test_bad_flag_type_is_an_argparse_error():
    with pytest.raises(SystemExit):
        parse("--block-size", "big")


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                       ("0.0.0.0", False), ("10.1.2.3", False), ("example.com", False)])
def test_loopback_detection(host, loop):
    assert _is_loopback(host) is loop
