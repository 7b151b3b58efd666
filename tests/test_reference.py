"""The reference a new user reads: the API reference (docstrings, the built page), reports that print as the CLI's
summary, ``posextend families`` and its page, and the error pages (each error text as the libraries print it)."""

from __future__ import annotations

import html
import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.families import coverage

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "scripts"))
import gen_families_docs  # noqa: E402

from test_docs import _check_syntax, _env, blocks  # noqa: E402  (the docs' own block reader and syntax check)

runner = CliRunner()

# ------------------------------------------------------------------ docstrings


def test_no_restructuredtext_example_blocks_left():
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "posextend").rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "Example::" in line]
    assert found == [], "Google-style 'Examples:' sections with >>> lines render as code; 'Example::' does not"


@pytest.fixture(scope="module")
def package():
    griffe = pytest.importorskip("griffe", reason="griffe comes with mkdocstrings[python] (the docs extra)")
    return griffe.load("posextend", search_paths=[str(ROOT)], docstring_parser="google", allow_inspection=False)


def _public_functions():
    return [n for n in posextend.__all__ if n in posextend._LAZY and callable(getattr(posextend, n))
            and not isinstance(getattr(posextend, n), type)]


@pytest.mark.parametrize("name", _public_functions())
def test_every_public_function_documents_each_parameter(package, name):
    function = package[f"{posextend._LAZY[name]}.{name}"]
    sections = function.docstring.parse("google") if function.docstring else []
    documented = {p.name.lstrip("*") for s in sections if s.kind.value == "parameters" for p in s.value}
    params = [p.name for p in function.parameters]
    assert function.docstring, name
    assert set(params) <= documented, f"{name}: no Args entry for {sorted(set(params) - documented)}"


def test_public_examples_parse_as_examples(package):
    """Every ``>>>`` line of a public object's docstring sits in an Examples section (rendered as code)."""
    names = [n for n in posextend.__all__ if n in posextend._LAZY]
    for name in names:
        obj = package[f"{posextend._LAZY[name]}.{name}"]
        if not obj.docstring or ">>>" not in obj.docstring.value:
            continue
        sections = obj.docstring.parse("google")
        assert not [s for s in sections if s.kind.value == "text" and ">>>" in s.value], name
        assert any(s.kind.value == "examples" for s in sections), name


# ------------------------------------------------------------------ the built site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                       env=dict(_env(), NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _section(page: str, anchor: str) -> str:
    """The HTML of one rendered object, from its heading to the next object's."""
    start = page.index(f'id="{anchor}"')
    end = re.compile(r'<h[1-3] id="').search(page, start)
    return page[start:end.start() if end else None]


def test_api_reference_signatures_wrap(site):
    pytest.importorskip("ruff", reason="ruff formats the signatures (the docs extra)")
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    section = _section(page, "posextend.resize_checkpoint")
    signature = _text(re.search(r'<div class="doc-signature highlight">(.*?)</div>', section, re.S).group(1))
    assert signature.startswith("resize_checkpoint(\n    src: str | Path | Checkpoint,\n    dst: str | Path,\n")
    assert len(signature.splitlines()) == 20 and max(map(len, signature.splitlines())) <= 80


def test_api_reference_hides_internals_and_renders_examples(site):
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for shown in ("posextend.resize_checkpoint", "posextend.ResizeReport", "posextend.FinetuneConfig",
                  "posextend.evaluate_retrieval"):
        assert f'id="{shown}"' in page
    for hidden in ("ResizeReport.record", "ResizeReport.provenance", "FinetuneConfig.of", "FinetuneConfig.check",
                   "FinetuneConfig.fingerprint", "FinetuneConfig.resolved", "FinetuneConfig.with_lr"):
        assert f'id="posextend.{hidden}"' not in page, hidden
    text = _text(page)
    assert "Example::" not in text and not re.search(r":(class|func|meth|mod|data):`", text)
    section = _section(page, "posextend.resize_checkpoint")
    example = section[section.index("Examples:"):]
    assert re.match(r'Examples:</span></p>\s*<div class="highlight"><pre>', example), "examples render as code"
    assert ">>> report = posextend.resize_checkpoint(" in _text(example)
    # all 17 parameters, each in the parameter list
    params = re.findall(r"<b><code>([^<]+)</code></b>", section[section.index("Parameters:"):section.index("Returns:")])
    assert params == ["src", "dst", "new_length", "strategy", "image_size", "seed", "overwrite", "allow_shrink", "link",
                      "table", "verify", "st_max_seq_length", "revision", "allow_same", "allow_large", "progress",
                      "**params"]


def test_families_page_is_sections_by_outcome(site):
    page = (site / "families" / "index.html").read_text(encoding="utf-8")
    headings = re.findall(r'<h2 id="([^"]+)"', page)
    assert headings == ["summary", *coverage.counts()], "a section per outcome, verified first"
    for table in re.findall(r"<table>.*?</table>", page, re.S):
        assert len(re.findall(r"<th[ >]", table.split("</tr>")[0])) <= 4, "no wide tables"
    assert 'href="#verified"' in page
    assert "EvollaModel" in _text(page) and "instructblip_vision_model" in _text(page)


def test_error_pages_are_in_the_site(site):
    for page in sorted((DOCS / "errors").glob("*.md")):
        built = site / "errors" / (page.stem if page.stem != "index" else "") / "index.html"
        assert built.exists(), page.name


# ------------------------------------------------------------------ reports print as the CLI's summary


def test_resize_report_prints_the_cli_summary(gpt, tmp_path):
    r = runner.invoke(app, ["resize-model", str(gpt), str(tmp_path / "cli"), "--length", "64", "--seed", "0"])
    assert r.exit_code == 0, r.output
    report = posextend.resize_checkpoint(gpt, tmp_path / "api", 64, seed=0)
    text = str(report)
    assert text.splitlines()[0].startswith("Resized gpt2 checkpoint: 32 → 64 usable positions with tile, in ")  # no seed
    assert "  tables: transformer.wpe.weight" in text and text.endswith(f"written to {tmp_path / 'api'}")
    same = [re.sub(r"in [\d.]+ s|written to .*", "", line) for line in text.splitlines()]
    cli = [re.sub(r"in [\d.]+ s|written to .*", "", line) for line in r.output.strip().splitlines()]
    assert same == cli, "the CLI prints str(report)"
    assert len(text) < len(repr(report)) / 2


def test_eval_report_prints_a_table_by_position():
    from posextend.scoring.by_position import report_from, side_by_side

    total, count = torch.full((64,), 2.0, dtype=torch.float64), torch.ones(64, dtype=torch.float64)
    total[32:] = 3.0
    report = report_from(total, count, [0, 32, 48, 64], objective="causal", sequences=1, old_length=32)
    lines = str(report).splitlines()
    assert lines[0] == "1 sequences of 64 tokens (causal)"
    assert lines[1].split() == ["positions", "perplexity", "tokens"]
    assert lines[2].split() == ["0–31", "7.389", "32"]
    assert lines[3].split() == ["32–47", "(new)", "20.086", "16"]
    assert lines[-1].split() == ["all", f"{report.perplexity:.3f}", "64"]
    both = side_by_side({"before": None, "after": report}).splitlines()
    assert both[0].split() == ["positions", "before", "perplexity", "after", "perplexity", "tokens"]
    assert both[1].split() == ["0–31", "-", "7.389", "32"]


def test_eval_report_says_what_its_samples_and_positions_are():
    """An image size is printed as pixels of images and captions as caption tokens of pairs (never "sequences of N
    tokens"); the JSON keeps every key it had and adds the words."""
    from posextend.scoring.by_position import Bucket, EvalReport

    sizes = [Bucket(h, h + 1, 0.5, 1.6, 24, accuracy=a) for h, a in ((16, 0.5), (32, 0.75))]
    images = EvalReport("vision", 32, 24, 0.5, 1.6, 24, sizes, accuracy=0.75, metric="accuracy", axis="px",
                        noun="images", unit="images")
    lines = str(images).splitlines()
    assert lines[0] == "24 images at 32 px (vision)"
    assert [row.split() for row in lines[1:]] == [["px", "accuracy", "images"], ["16", "0.500", "24"],
                                                 ["32", "0.750", "24"], ["all", "0.750", "24"]]
    lengths = [Bucket(0, 33, 0.5, 1.6, 50, accuracy=0.7), Bucket(33, 73, 0.5, 1.6, 46, accuracy=0.6)]
    pairs = EvalReport("image-text", 72, 96, 0.5, 1.6, 96, lengths, 32, accuracy=0.65, metric="R@1",
                       axis="caption tokens", noun="pairs", unit="pairs")
    assert str(pairs).splitlines()[:2] == ["96 pairs, captions up to 72 tokens (image-text)",
                                           "caption tokens    R@1  pairs"]
    keys = {"objective", "length", "sequences", "loss", "perplexity", "tokens", "buckets", "old_length", "accuracy",
            "metric", "verdict", "context_use"}
    assert set(pairs.to_dict()) == keys | {"axis", "noun", "unit"}


# ------------------------------------------------------------------ posextend families


def test_families_answers_for_a_model_type_and_a_class_name():
    r = runner.invoke(app, ["families", "bert"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[:2] == ["bert: verified",
                         "  resized 2x and checked: loads, runs at the new length, short inputs unchanged"]
    assert "  covered by: a written spec" in lines
    assert "  model positions: bert.embeddings.position_embeddings.weight (reserved rows: 0; length in " \
           "max_position_embeddings)" in lines
    assert "  layouts: headed verified, bare verified, bare-class verified" in lines
    for name in ("BertModel", "BertForMaskedLM", "BERT"):
        assert runner.invoke(app, ["families", name]).output == r.output, name


def test_families_answers_a_refused_type_with_its_reason():
    r = runner.invoke(app, ["families", "llama"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("llama: refused\n  positions are rotary")
    assert "  reason: Model type 'llama' uses rotary embeddings (RoPE), not a learned absolute position" in r.output
    grid = runner.invoke(app, ["families", "owlvit"]).output
    assert "  vision image grid: vision_model.embeddings.position_embedding.weight (prefix tokens: 1; size in " \
           "vision_config.image_size): grid-probed, checked against its run-time interpolation" in grid


def test_families_answers_for_a_checkpoint_folder(tmp_path):
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=100)
    transformers.BertModel(transformers.BertConfig(**small, max_position_embeddings=40)).save_pretrained(tmp_path / "b")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)).save_pretrained(tmp_path / "l")
    r = runner.invoke(app, ["families", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[:4] == [
        f"{tmp_path / 'b'}: model type 'bert'",
        "  model positions: resizable, by a written spec (length in max_position_embeddings)",
        "In the census (transformers 5.23.0):",
        "bert: verified"]
    r = runner.invoke(app, ["families", str(tmp_path / "l")])
    assert r.exit_code == 0 and "  refused: Model type 'llama' uses rotary embeddings (RoPE)" in r.output, r.output


def test_families_summary_and_an_unknown_name():
    r = runner.invoke(app, ["families"])
    assert r.exit_code == 0, r.output
    rows = [line.split() for line in r.output.splitlines()[1:-1]]
    assert [row[0] for row in rows] == list(coverage.OUTCOMES)[:len(rows)] and rows[0][0] == "verified"
    assert sum(int(row[1]) for row in rows) == len(coverage.record()) == 804
    assert "(39 by a written spec, 77 observed on a twin)" in r.output
    r = runner.invoke(app, ["families", "no-such-model"])
    assert r.exit_code == 1 and r.output.startswith("Error: 'no-such-model' is no model type"), r.output
    assert len(r.output.strip().splitlines()) == 1


def test_the_record_names_the_pinned_transformers_and_the_page_is_rendered_from_it():
    pin = re.search(r'"transformers==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert coverage.TRANSFORMERS == pin
    page = (DOCS / "families.md").read_text(encoding="utf-8")
    assert page == gen_families_docs.render(list(coverage.record().values())), \
        "docs/families.md is stale: run python scripts/gen_families_docs.py"


# ------------------------------------------------------------------ error pages: the texts the libraries print


def _page_lines(name: str) -> set[str]:
    """The lines of a page's ``text`` blocks: the error texts it quotes."""
    text = (DOCS / "errors" / f"{name}.md").read_text(encoding="utf-8")
    return {line.strip() for block in re.findall(r"```text\n(.*?)```", text, re.S) for line in block.splitlines()}


def _error(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def _small(**kw):
    return {"vocab_size": 100, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32, **kw}


def _ids(n: int) -> torch.Tensor:
    return torch.randint(5, 90, (1, n))


def test_error_pages_quote_what_transformers_prints():
    gpt = transformers.GPT2Model(transformers.GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2))
    assert _error(lambda: gpt(input_ids=_ids(1100))) in _page_lines("index-out-of-range")
    roberta = transformers.RobertaModel(
        transformers.RobertaConfig(**_small(hidden_size=16), max_position_embeddings=514, pad_token_id=1))
    assert _error(lambda: roberta(input_ids=_ids(600))) in _page_lines("index-out-of-range")
    bert = transformers.BertModel(transformers.BertConfig(**_small(hidden_size=16)))
    types = torch.zeros(1, 600, dtype=torch.long)
    assert _error(lambda: bert(input_ids=_ids(600), token_type_ids=types)) in _page_lines("tensor-size")
    assert _error(lambda: bert(input_ids=_ids(600))) in _page_lines("tensor-size")
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(**_small(hidden_size=16)))
    assert _error(lambda: clip(input_ids=_ids(100))) in _page_lines("clip-77-tokens")
    vit = transformers.ViTModel(transformers.ViTConfig(**_small(hidden_size=16)))
    assert _error(lambda: vit(pixel_values=torch.randn(1, 3, 448, 448))) in _page_lines("interpolate-pos-encoding")
    out = vit(pixel_values=torch.randn(1, 3, 448, 448), interpolate_pos_encoding=True)
    assert out.last_hidden_state.shape[1] == 1 + 28 * 28


def test_loading_a_longer_table_fails_and_ignoring_it_throws_the_table_away(tmp_path):
    bert = transformers.BertModel(transformers.BertConfig(**_small(hidden_size=768, num_attention_heads=12)))
    bert.save_pretrained(tmp_path / "bert")
    message = _error(lambda: transformers.BertModel.from_pretrained(tmp_path / "bert", max_position_embeddings=1024))
    assert message in _page_lines("size-mismatch")  # transformers 5.x; the 4.x text above it is torch's own wording
    loaded = transformers.BertModel.from_pretrained(tmp_path / "bert", max_position_embeddings=1024,
                                                    ignore_mismatched_sizes=True)
    old = bert.embeddings.position_embeddings.weight
    assert not torch.equal(loaded.embeddings.position_embeddings.weight[:512], old)  # the trained rows are gone
    posextend.resize_checkpoint(tmp_path / "bert", tmp_path / "bert-1k", 1024)
    kept = transformers.BertModel.from_pretrained(tmp_path / "bert-1k")
    assert torch.equal(kept.embeddings.position_embeddings.weight[:512], old)


def test_the_tokenizer_warns_as_quoted(minilm):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = transformers.logging.get_logger("transformers")
    before = transformers.logging.get_verbosity()
    logger.addHandler(handler)
    transformers.logging.set_verbosity_warning()
    try:
        tokenizer("word " * 600)
    finally:
        transformers.logging.set_verbosity(before)
        logger.removeHandler(handler)
    assert stream.getvalue().strip() in _page_lines("token-indices")


def test_sentence_transformers_past_512_fails_as_quoted(minilm):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm), device="cpu")
    model.max_seq_length = 1024
    assert _error(lambda: model.encode(["word " * 900])) in _page_lines("max-seq-length")


def test_the_fix_removes_the_error(gpt, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt)
    with pytest.raises(IndexError, match="index out of range in self"):
        model(input_ids=_ids(40))
    posextend.resize_checkpoint(gpt, tmp_path / "gpt-64", 64, "interpolate")
    longer = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt-64")
    assert longer(input_ids=_ids(40)).logits.shape[1] == 40


@pytest.mark.parametrize("page", sorted((DOCS / "errors").glob("*.md")), ids=lambda p: p.stem)
def test_error_page_commands_exist_and_lead_with_the_error(page):
    text = page.read_text(encoding="utf-8")
    found = blocks(page)
    for block in found:
        _check_syntax(block)
    if page.stem != "index":
        assert [b for b in found if "posextend " in b.body], "each page gives the command that fixes it"
        title, body = text.split("\n", 1)
        assert title.startswith("# ") and body.lstrip().startswith("```text\n"), "the error text comes first"
