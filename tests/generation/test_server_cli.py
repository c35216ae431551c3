"""The server's command line (generation/http/cli.py): every flag becomes a setting the engine's
options or the server take, under SGLang's spellings."""

from __future__ import annotations

import dataclasses

import pytest

from areal_flow.generation.engine.options import EngineOptions
from areal_flow.generation.http.cli import engine_settings, parser

SERVER_KEYS = {"api_key", "max_request_bytes"}
"""What serve() takes for the HTTP side rather than the engine."""


def test_the_defaults_are_the_engine_options_defaults():
    settings = engine_settings(parser().parse_args(["--model-path", "m"]))
    options = EngineOptions(**{k: v for k, v in settings.items() if k not in SERVER_KEYS})
    defaults = EngineOptions()
    for field in dataclasses.fields(EngineOptions):
        if field.name not in ("device", "dtype", "time_steps", "fast_decode"):  # device-dependent or no flag
            assert getattr(options, field.name) == getattr(defaults, field.name), field.name


def test_sglang_s_disable_flags_turn_the_engine_s_features_off():
    args = parser().parse_args(["--model-path", "m", "--disable-radix-cache", "--disable-overlap-schedule",
                                "--disable-cuda-graph", "--enable-deterministic-inference", "--page-size", "8",
                                "--chunked-prefill-size", "64", "--weight-version", "7", "--api-key", ""])
    settings = engine_settings(args)
    assert settings["prefix_cache"] is False and settings["overlap"] is False and settings["cuda_graphs"] is False
    assert settings["batch_invariant"] is True and settings["page_size"] == 8
    assert settings["chunked_prefill_size"] == 64 and settings["weight_label"] == "7"
    assert settings["api_key"] is None  # an empty key is none


def test_a_bad_value_is_refused_by_the_options_naming_the_setting():
    settings = engine_settings(parser().parse_args(["--model-path", "m", "--page-size", "0"]))
    with pytest.raises(ValueError, match="page_size"):
        EngineOptions(**{k: v for k, v in settings.items() if k not in SERVER_KEYS})
