"""A user's mistake on the command line: one line naming the flag and the fix,
exit code 2 (argparse's convention), no traceback, nothing loaded."""

import json
import struct

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

from mlx_h2o import H2OConfig, H2OKVCache
from mlx_h2o.cache import save_prompt_cache
from mlx_h2o.cli import main as cli_main
from mlx_h2o.cli.generate import cache_file_kind
from mlx_h2o.cli.h2o_args import flagify


def one_line_error(capsys, argv):
    """The stderr line of a refused command (SystemExit 2, stdout empty)."""
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    return err.strip()


GENERATE_ERRORS = [
    (["--h2o-max-size", "-5"], "--h2o-max-size must be >= 1, got -5"),
    (["--max-kv-size", "64"], "use --h2o-max-size 64 instead, or add --no-h2o"),
    (["--kv-bits", "8"], "use --h2o-kv-bits 8 instead, or add --no-h2o"),
    (["--kv-bits", "3"], "use --h2o-kv-bits 8 instead"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such folder"),
    (["--model", "./no-such"], "--model ./no-such: no such folder"),
    (["--no-h2o", "--h2o-max-size", "32"], "--h2o-max-size has no effect with --no-h2o"),
    (["--no-h2o", "--h2o-kv-bits", "8"], "--h2o-kv-bits has no effect with --no-h2o"),
    (["--h2o-kv-bits", "8", "--h2o-kv-recent-bits", "4", "--h2o-evict-batch", "8"],
     "mixed precision (--h2o-kv-recent-bits) evicts every step"),
    (["--h2o-kv-recent-bits", "4"], "--h2o-kv-recent-bits needs --h2o-kv-bits"),
    (["--h2o-kv-group-size", "32"], "--h2o-kv-group-size needs --h2o-kv-bits"),
    (["--h2o-max-size", "10", "--h2o-heavy-budget", "5", "--h2o-recent-budget", "5"],
     "--h2o-sink-size + --h2o-heavy-budget + --h2o-recent-budget = 4 + 5 + 5 must equal "
     "--h2o-max-size=10"),
    (["--h2o-sink-size", "300"], "--h2o-sink-size=300 leaves no room in --h2o-max-size=256"),
    (["--h2o-evict-batch", "200"], "--h2o-evict-batch=200 exceeds"),
    (["--h2o-layer-budget", "no-such.json"], "--h2o-layer-budget no-such.json: layer "
     "profile no-such.json does not exist; make a new one with `mlx-h2o calibrate"),
    (["--prompt-cache-file", "no-such.safetensors"], "--prompt-cache-file "
     "no-such.safetensors: no such file; make one with `mlx-h2o cache_prompt`"),
    (["--chat-template-config", "{x"], "--chat-template-config is not JSON"),
]


@pytest.mark.parametrize("argv, want", GENERATE_ERRORS)
def test_generate_errors_are_one_line(capsys, argv, want):
    line = one_line_error(capsys, ["generate", "--prompt", "hi", *argv])
    assert line.startswith("mlx-h2o generate: error: ") and want in line, line
    assert "_size" not in line and "_budget" not in line  # flags, not field names


def test_argparse_errors_keep_a_short_usage(capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", "--h2o-kv-bits", "3"])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 2 and err.startswith("usage: mlx-h2o generate")


def test_flagify_maps_every_field_to_its_flag():
    assert flagify("max_size must be >= 1") == "--h2o-max-size must be >= 1"
    assert flagify("recent_bits=4 must be narrower than bits=4") == \
        "--h2o-kv-recent-bits=4 must be narrower than --h2o-kv-bits=4"
    assert flagify("8 bits and the recent window") == "8 bits and the recent window"
    assert flagify("score='x' is not a score mode") == "--h2o-score='x' is not a score mode"


def _h2o_cache():
    c = H2OKVCache(H2OConfig(max_size=8, sink_size=1))
    c.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    return [c]


def _kv_cache():
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    return [c]


def test_prompt_cache_files_of_the_wrong_kind_are_refused(tmp_path, capsys):
    h2o, plain, broken, junk = (str(tmp_path / f"{n}.safetensors")
                                for n in ("h2o", "plain", "broken", "junk"))
    save_prompt_cache(h2o, _h2o_cache(), {"model": "smollm2-135m"})
    mlx_lm_save(plain, _kv_cache(), {"model": "smollm2-135m"})
    mlx_lm_save(broken, _h2o_cache())  # mlx-lm accepts it; its loader cannot read it
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert cache_file_kind(h2o) == ("mlx-h2o", ["H2OKVCache"])
    assert cache_file_kind(plain) == ("mlx-lm", ["KVCache"])
    assert cache_file_kind(broken) == ("mlx-lm", ["H2OKVCache"])
    assert cache_file_kind(junk) == (None, [])

    def refused(*argv):
        return one_line_error(capsys, ["generate", "--prompt", "hi", *argv])

    assert "holds mlx-lm caches (KVCache), not H2O ones: add --no-h2o" in refused(
        "--prompt-cache-file", plain)
    assert "holds H2O caches: drop --no-h2o" in refused("--no-h2o", "--prompt-cache-file", h2o)
    assert "mlx_lm's save_prompt_cache wrote H2O caches (H2OKVCache)" in refused(
        "--no-h2o", "--prompt-cache-file", broken)
    assert "not a prompt-cache file" in refused("--prompt-cache-file", junk)
    line = refused("--prompt-cache-file", h2o, "--h2o-max-size", "32")
    assert "--h2o-max-size has no effect with --prompt-cache-file" in line
