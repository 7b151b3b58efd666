"""The posextend CLI: what users run, including every bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import tree_digest
from typer.testing import CliRunner

import posextend
from posextend.cli import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_resize_model_prints_what_it_did(tiny, tmp_path):
    r = run("resize-model", tiny["gpt2"], tmp_path / "out", "--length", "64", "--strategy", "random",
            "--param", "std=matched", "--seed", "3")
    assert r.exit_code == 0, r.output
    assert "37 → 64 usable positions with random (std=matched), seed 3" in r.output
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["n_positions"] == 64


def test_inspect_json_and_table(tiny):
    r = run("inspect", tiny["bert"], "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert (info["usable"], info["reserved"], info["spec"]) == (37, 0, "bert")
    assert info["tables"] == [{"name": "bert.embeddings.position_embeddings.weight", "rows": 37, "dim": 16, "dtype": "F32"}]
    assert info["tokenizer_max_length"] == 37
    r = run("inspect", tiny["gpt2"])
    assert r.exit_code == 0 and "transformer.wpe.weight" in r.output and "usable positions: 37" in r.output


def test_strategies_and_version():
    r = run("strategies")
    assert r.exit_code == 0
    for name in ("tile", "interpolate", "random"):
        assert name in r.output
    r = run("--version")
    assert r.exit_code == 0 and r.output.startswith("posextend ")


def _corrupt(src, tmp_path, how):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    if how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"\xff" * 8 + data[8:])
    return bad


def _no_config(src, tmp_path):
    bad = tmp_path / "noconf"
    shutil.copytree(src, bad)
    (bad / "config.json").unlink()
    return bad


def _retype(src, tmp_path, model_type):
    bad = tmp_path / model_type
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = model_type
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


BAD = {
    "missing src": (lambda s, t: t / "nope", [], "does not exist"),
    "no config": (_no_config, [], "No config.json in"),
    "unsupported": (lambda s, t: _retype(s, t, "funnelnet"), [], "Unsupported architecture 'funnelnet': transformers"),
    "not learned": (lambda s, t: _retype(s, t, "llama"), [], "uses rotary embeddings (RoPE), not a learned absolute position table"),
    "length zero": (lambda s, t: s, ["--length", "0"], "must be a positive number of positions, got 0"),
    "length negative": (lambda s, t: s, ["--length", "-5"], "must be a positive number of positions, got -5"),
    "unknown strategy": (lambda s, t: s, ["--strategy", "zigzag"], "Unknown strategy 'zigzag'. Valid strategies: bicubic, bilinear, interpolate, kps, nearest, random, tile"),
    "bad param": (lambda s, t: s, ["--param", "sdt=1", "--strategy", "random"], "does not take parameter(s) sdt"),
    "truncated": (lambda s, t: _corrupt(s, t, "truncated"), [], "is not a valid safetensors file"),
    "garbage header": (lambda s, t: _corrupt(s, t, "header"), [], "is not a valid safetensors file"),
    "shrink": (lambda s, t: s, ["--length", "10"], "is below the current 37"),
    "shrink, the flag to pass": (lambda s, t: s, ["--length", "10"], "To shrink on purpose, pass --shrink."),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_red_line_exit_1_nothing_written(tiny, tmp_path, case):
    make_src, extra, message = BAD[case]
    src = make_src(tiny["gpt2"], tmp_path)
    before = tree_digest(src) if src.exists() else None
    dst = tmp_path / "dst"
    args = ["resize-model", src, dst, "--length", "64", *extra]
    r = run(*args)
    assert r.exit_code == 1, r.output
    assert message in r.output
    assert "Traceback" not in r.output
    assert not dst.exists()
    assert not list(tmp_path.glob(".dst.posextend-*"))
    if before is not None:
        assert tree_digest(src) == before


def test_dst_exists_without_overwrite(tiny, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = run("resize-model", tiny["gpt2"], dst, "--length", "64")
    assert r.exit_code == 1 and "already exists; pass --overwrite" in r.output
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_dst_equal_to_or_inside_src(tiny, tmp_path, where):
    src = tmp_path / "src"
    shutil.copytree(tiny["gpt2"], src)
    before = tree_digest(src)
    dst = src if where == "same" else src / "sub"
    r = run("resize-model", src, dst, "--length", "64", "--overwrite")
    assert r.exit_code == 1 and "is the source or inside it" in r.output
    assert tree_digest(src) == before


def test_console_script_error_is_one_line_and_debug_shows_traceback(tiny, tmp_path):
    cmd = [sys.executable, "-m", "posextend.cli", "resize-model", str(tmp_path / "nope"), str(tmp_path / "d"), "-n", "64"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "Error:" in r.stderr and "does not exist" in r.stderr
    r = subprocess.run([*cmd[:3], "--debug", *cmd[3:]], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" in r.stderr and "SourceError" in r.stderr


def test_cli_and_file_path_do_not_import_torch_at_start():
    """resize-model copies bytes while torch is imported in the background: keep it that way."""
    code = "import sys, posextend.cli, posextend.resize.on_disk; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


@pytest.mark.parametrize("family", ["gpt2", "roberta", "opt", "bart"])
def test_tile_copies_row_bytes_without_torch_and_matches_the_tensor_path(tiny, tmp_path, family):
    """A row strategy resizes files by byte copies: no torch import, same table as resize_table."""
    code = ("import sys, posextend; posextend.resize_checkpoint(sys.argv[1], sys.argv[2], 150, 'tile'); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(tiny[family]), str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
    import torch
    from safetensors.torch import load_file

    import posextend

    info = posextend.inspect_checkpoint(tiny[family])
    before = load_file(tiny[family] / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    for table in info.tables:  # BART-style: encoder and decoder tables
        expected = posextend.resize_table(before[table.name], 150, "tile", reserved=info.reserved)
        assert after[table.name].shape == expected.shape and torch.equal(after[table.name], expected)
    assert info.reserved > 0 or family == "gpt2"


def test_row_strategy_takes_no_parameters():
    import posextend

    with pytest.raises(posextend.StrategyError, match="takes no parameters"):
        @posextend.register_strategy("rows-with-param", rows=lambda old, new: list(range(new)))
        def bad(table, new_len, *, generator, k=1):
            return table[:new_len]


def test_documented_python_api_is_exported():
    import posextend

    for name in ("extend_model", "resize_checkpoint", "inspect_checkpoint", "finetune", "evaluate",
                 "register_strategy", "available_strategies", "resize_table"):
        assert callable(getattr(posextend, name)), name
    import posextend.training.loop  # importing the module must not shadow the function
    assert callable(posextend.finetune) and posextend.finetune.__module__ == "posextend.training.loop"


@pytest.fixture(scope="module")
def led(tmp_path_factory):
    """A tiny LED whose stacks have lengths of their own (encoder 48, decoder 40, attention window 8), saved headed
    and as its bare LEDModel under the headed architectures; its tokenizer states the encoder's length."""
    import transformers

    root = tmp_path_factory.mktemp("led")
    config = transformers.LEDConfig(
        vocab_size=120, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_encoder_position_embeddings=48,
        max_decoder_position_embeddings=40, attention_window=8)
    model = transformers.LEDForConditionalGeneration(config)
    model.save_pretrained(root / "headed")
    model.led.save_pretrained(root / "bare")
    bare = json.loads((root / "bare" / "config.json").read_text())
    (root / "bare" / "config.json").write_text(json.dumps({**bare, "architectures": ["LEDForConditionalGeneration"]}))
    for layout in ("headed", "bare"):
        (root / layout / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 48}))
    return root


@pytest.mark.parametrize("layout", ["headed", "bare"])
def test_an_encoder_decoder_grows_each_stack_alone_or_both(led, tmp_path, layout):
    """Issue 52: LED's encoder alone (its own recipe) is verified with each stack at its own length; the
    tokenizer follows the encoder, and stays when only the decoder grows; both grow together by naming both."""
    src = led / layout
    lengths = {"encoder": "max_encoder_position_embeddings", "decoder": "max_decoder_position_embeddings"}
    for tables, want, tokenizer in ((["encoder"], {"encoder": 96, "decoder": 40}, 96),
                                    (["decoder"], {"encoder": 48, "decoder": 96}, 48),
                                    (["encoder", "decoder"], {"encoder": 96, "decoder": 96}, 96)):
        dst = tmp_path / "-".join(tables)
        r = run("resize-model", src, dst, "--length", "96", *(a for t in tables for a in ("--table", t)))
        assert r.exit_code == 0, r.output
        assert "verified" in r.output and "Input ids are automatically padded" not in r.output
        config = json.loads((dst / "config.json").read_text())
        assert {group: config[field] for group, field in lengths.items()} == want
        assert json.loads((dst / "tokenizer_config.json").read_text())["model_max_length"] == tokenizer
    assert "encoder 48 → 96, decoder 40 → 96 usable positions" in r.output


def test_a_model_with_several_lengths_names_the_table_to_choose(led, tmp_path):
    r = run("resize-model", led / "headed", tmp_path / "out", "--length", "96")
    assert r.exit_code == 1 and not (tmp_path / "out").exists()
    assert "choose the table to resize: --table decoder or --table encoder, or several to the same length: " \
           "--table decoder --table encoder." in r.output
    r = run("inspect", led / "headed")
    assert r.exit_code == 0, r.output
    assert "decoder: usable positions: 40, config: max_decoder_position_embeddings=40" in r.output
    assert "encoder: usable positions: 48, config: max_encoder_position_embeddings=48" in r.output


# The lean path (issue 52): `posextend resize-model` and `--version` start without typer, rich or the fine-tune.
HEAVY = ("typer", "rich", "pydantic", "torch", "transformers", "huggingface_hub", "importlib.metadata",
         "posextend.training", "posextend.commands", "posextend.scoring", "posextend.data")
LOADED = "import sys; print(sorted({m for m in sys.modules for h in HEAVY if m == h or m.startswith(h + '.')}))"


def _loaded(code: str, *args: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", f"import sys\nHEAVY = {HEAVY!r}\n{code}\n{LOADED}", *map(str, args)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    return eval(r.stdout.strip().splitlines()[-1])


def test_resize_model_and_version_import_neither_typer_rich_nor_the_fine_tune(tiny, tmp_path):
    resize = "from posextend import cli; assert cli._lean(['resize-model', *sys.argv[1:]])"
    assert _loaded(resize, tiny["gpt2"], tmp_path / "out", "--length", "64") == []
    assert json.loads((tmp_path / "out" / "config.json").read_text())["n_positions"] == 64
    assert _loaded("import posextend.resize.on_disk, posextend.resize.inspection, posextend.cli") == []
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "posextend.cli", "--version"], capture_output=True,
                       text=True, check=True)
    assert r.stdout.strip() == f"posextend {posextend.__version__}"
    assert not [m for h in HEAVY for m in re.findall(rf"\| +({re.escape(h)}(\.\S+)?)$", r.stderr, re.MULTILINE)]


def test_inspect_builds_the_app_without_the_fine_tune(tiny):
    code = ("from posextend import cli; argv = ['inspect', sys.argv[1]]\n"
            "try:\n    cli.typer_app(argv)(argv)\nexcept SystemExit as e:\n    assert not e.code, e")
    assert [m for m in _loaded(code, tiny["gpt2"]) if m.startswith("posextend.training")] == []  # transformers: yes


def test_the_version_is_the_installed_packages():
    from importlib.metadata import version

    assert posextend.__version__ == version("posextend")


RESIZE_LINES = [
    ["-n", "64"], ["--length=64", "--table", "encoder", "--table=decoder", "--overwrite", "-y"],
    ["--image-size", "448x336", "-s", "bicubic", "-p", "antialias=true", "--no-verify", "--seed", "007"],
    ["--length", "64", "--verify", "--st-max-seq-length", "32", "--revision", "main", "--link", "--shrink"],
    ["--allow-same", "--strategy=", "--length", "64", "--param", "a=1", "--param", "b=x"],
]


@pytest.mark.parametrize("options", RESIZE_LINES, ids=range(len(RESIZE_LINES)))
def test_the_lean_parser_gives_resize_model_what_typer_gives_it(monkeypatch, options):
    from posextend import cli, shell

    calls = []
    monkeypatch.setattr(shell, "resize_model", lambda *args: calls.append(args))
    monkeypatch.setattr(shell, "setup_logging", lambda **flags: calls.append(flags))
    line = ["--debug", "resize-model", *options[:2], "src", *options[2:], "dst"]  # options before, between, after
    assert cli._lean(line)
    assert run(*line).exit_code == 0
    assert len(calls) == 4 and calls[0] == calls[2] and calls[1] == calls[3]


@pytest.mark.parametrize("options", [
    ["--help"], ["--length", "-5"], ["-n", "+5"], ["--length", "64", "--length", "65"], ["--bogus"], ["--", "x"],
    ["--overwrite=1"], ["-n64"], ["extra"],
])
def test_the_lean_parser_leaves_to_typer_what_is_not_plainly_given(options):
    from posextend import cli

    assert not cli._lean(["resize-model", "src", "dst", *options])
