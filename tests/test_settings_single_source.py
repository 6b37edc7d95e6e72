"""Each setting is said once, in the config dataclasses (services/common/config.py): the services'
parsers and `echospec serve`'s are built from their fields, with the fields' defaults."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from echospec import cli
from echospec.cli import serve
from echospec.services.common import config
from echospec.services.verifier import engine
from echospec.stack import StackConfig, StackConfigs

CONFIGS = (*config.SERVICE_CONFIGS, StackConfig)


def _serve_parser() -> argparse.ArgumentParser:
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_one_flag_one_variable_one_default(cls):
    fields = dataclasses.fields(cls)
    for f in fields:
        assert f.default is not dataclasses.MISSING, f.name   # the default: in the field
        assert f.metadata["help"], f.name
        assert f.metadata["flag"] == "--" + f.name.replace("_", "-")
        assert f.metadata["env"] == "ECHOSPEC_" + f.name.upper()
    assert len({f.metadata["flag"] for f in fields}) == len(fields)
    assert len({f.metadata["env"] for f in fields}) == len(fields)


@pytest.mark.parametrize("cls", config.SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_a_service_parser_has_one_option_per_field(cls):
    ap = argparse.ArgumentParser()
    config.add_arguments(ap, cls)
    opts = {a.dest: a for a in ap._actions if a.dest != "help"}
    assert set(opts) == {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        assert f.metadata["flag"] in opts[f.name].option_strings
        assert f.metadata["env"] in opts[f.name].help
    assert config.load(cls, [], environ={}) == cls()


def test_serve_options_are_the_fields_that_say_so_with_their_defaults():
    p = _serve_parser()
    actions = {a.dest: a for a in p._actions if a.dest != "help"}
    offered = serve.serve_fields()
    flags = [f.metadata["serve"] for _, f in offered]
    assert len(flags) == len(set(flags)), "a serve option names two settings"
    assert len({f.name for _, f in offered}) == len(offered), "a setting has two serve options"
    assert set(actions) == {f.name for _, f in offered}, "a serve option without a field"
    for _, f in offered:
        a = actions[f.name]
        assert a.option_strings == [f.metadata["serve"]], f.name
        if f.name in ("api_key", "internal_key", "model"):   # not given: its variable, then the
            assert a.default is None                          # default (the default model)
        else:
            assert a.default == f.default, f.name
        if f.metadata["choices"]:
            assert tuple(a.choices) == f.metadata["choices"]
    # parsing nothing gives every config its defaults
    args = cli.parse_args(["serve"])
    args.api_key = args.internal_key = args.model = ""
    assert serve.configs_of(args) == StackConfigs()


def test_serve_flags_reach_their_fields():
    args = cli.parse_args(["serve", "--threads", "3", "--n-ctx", "512", "--fixed-k",
                           "--no-prefix-cache", "--spec", "--http-port", "0", "--processes"])
    c = serve.configs_of(args)
    assert c.verifier.n_threads == 3 and c.verifier.n_ctx == 512 and not c.verifier.prefix_cache
    assert not c.coordinator.adaptive_k and c.coordinator.spec
    assert c.stack.http_port == 0 and c.stack.processes


def test_the_n_ctx_minimum_is_the_engines():
    lo, hi, _ = config._INT_RANGES["n_ctx"]
    assert int(lo) == engine.MIN_CTX == engine.lib.ES_MIN_CTX == 16
    assert int(hi) == engine.MAX_CTX
    with pytest.raises(ValueError, match=r"--n-ctx / ECHOSPEC_N_CTX 15"):
        config.check_ranges(config.VerifierConfig(n_ctx=engine.MIN_CTX - 1))
    config.check_ranges(config.VerifierConfig(n_ctx=engine.MIN_CTX))


def test_start_stack_keywords_reach_one_config_each():
    c = StackConfigs().replace(model="m.gguf", port=0, n_ctx=64, min_n=3, http_port=0, api_key="k",
                               tls_client_ca="ca.pem")
    assert c.verifier.tls_client_ca == "ca.pem" and c.coordinator.tls_client_ca == ""
    assert c.coordinator.model == "m.gguf" and c.coordinator.port == 0 and c.coordinator.api_key == "k"
    assert c.verifier.n_ctx == 64 and c.draft.min_n == 3 and c.stack.http_port == 0
    with pytest.raises(TypeError):
        StackConfigs().replace(no_such_setting=1)
