"""Hub ids: a source that is no local folder is downloaded with huggingface_hub, only the files a command needs
(configs, tokenizer, sentence-transformers modules, the weights in one format), into the Hugging Face cache.

No network: a local stand-in for the Hub's HTTP API (repository info, file listing, file downloads) serves
folders built here, and the real huggingface_hub client talks to it (``HF_ENDPOINT``) in the ``posextend``
command, with a fresh ``HF_HOME``; the stand-in records every file asked for. Error answers (no such model,
no such revision, a gated model, no Hub at all, ``HF_HUB_OFFLINE``) come from the stand-in and the client too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import transformers

import posextend
from conftest import load_clean
from posextend.files import sources
from posextend.files.checkpoint import Checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parent.parent
# Files of a hub model that no command needs: the model in other formats and for other runtimes, scripts.
DECOYS = ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "rust_model.ot", "onnx/model.onnx",
          "openvino/openvino_model.bin", "openvino/openvino_model.xml", "train_script.py", ".gitattributes")


class StandIn:
    """A local stand-in for the Hugging Face Hub's HTTP API, serving ``repos`` (hub id -> folder).

    ``asked``: each file downloaded, as ``(hub id, path)``; ``revisions``: each revision asked of the API;
    ``errors``: hub id -> (HTTP status, the Hub's ``X-Error-Code``) answered instead."""

    def __init__(self) -> None:
        self.repos: dict[str, Path] = {}
        self.errors: dict[str, tuple[int, str]] = {}
        self.asked: list[tuple[str, str]] = []
        self.revisions: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stand_in.answer(self)

            do_HEAD = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        parts = [unquote(p) for p in urlparse(request.path).path.strip("/").split("/")]
        api = parts[0] == "api"  # /api/models/ORG/NAME/{revision,tree}/REV, or /ORG/NAME/resolve/REV/PATH
        repo_id = "/".join(parts[2:4] if api else parts[:2])
        if repo_id in self.errors or repo_id not in self.repos:
            status, code = self.errors.get(repo_id, (404, "RepoNotFound"))
            return _send(request, status, b'{"error": "no"}', {"X-Error-Code": code})
        root = self.repos[repo_id]
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        if api and parts[4] == "revision":
            self.revisions.append(parts[5])
            info = {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
            return _send(request, 200, json.dumps(info).encode())
        if api and parts[4] == "tree":
            tree = [{"type": "file", "path": f, "size": (root / f).stat().st_size,
                     "oid": hashlib.sha1(f.encode()).hexdigest()} for f in files]
            return _send(request, 200, json.dumps(tree).encode())
        path = "/".join(parts[4:])
        data = (root / path).read_bytes()
        if request.command == "GET":
            self.asked.append((repo_id, path))
        _send(request, 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})

    def files(self, repo_id: str) -> set[str]:
        return {path for repo, path in self.asked if repo == repo_id}

    def env(self, home: Path, *, offline: bool = False) -> dict[str, str]:
        return dict(os.environ, HF_ENDPOINT=self.url, HF_HOME=str(home), HF_HUB_OFFLINE="1" if offline else "0",
                    HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _send(request: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    request.send_response(status)
    for key, value in {"Content-Type": "application/octet-stream", **(headers or {})}.items():
        request.send_header(key, value)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    if request.command == "GET":
        request.wfile.write(body)


@pytest.fixture
def hub() -> StandIn:
    stand_in = StandIn()
    yield stand_in
    stand_in.server.shutdown()


def posextend_cli(hub: StandIn, home: Path, *args: object, offline: bool = False) -> subprocess.CompletedProcess:
    """The ``posextend`` command, with the stand-in as the Hub and ``home`` as ``HF_HOME``."""
    return subprocess.run([sys.executable, "-m", "posextend.cli", *map(str, args)], env=hub.env(home, offline=offline),
                          capture_output=True, text=True, timeout=300)


def _repo(folder: Path, where: Path, decoys: tuple[str, ...] = DECOYS) -> tuple[Path, set[str]]:
    """A hub repository at ``where``: ``decoys`` that no command needs, the files of ``folder`` (linked, never
    written through: ``folder`` may be an installed package's), and a model card where ``folder`` has none;
    returns it and the files a command needs (all but the decoys)."""
    for name in decoys:
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_bytes(b"not needed")
    for path in folder.rglob("*"):
        link = where / path.relative_to(folder)
        if path.is_file() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    if not (where / "README.md").exists():
        (where / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A tiny model\n")
    needed = {p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file()} - set(decoys)
    return where, needed


def test_a_gpt2_style_hub_id_downloads_only_what_a_resize_needs_then_resolves_offline_from_the_cache(gpt, hub, tmp_path):
    hub.repos["org/tiny-gpt2"], needed = _repo(gpt, tmp_path / "repo")
    home = tmp_path / "hf-home"
    r = posextend_cli(hub, home, "resize-model", "org/tiny-gpt2", tmp_path / "out", "--length", "64")
    assert r.returncode == 0, r.stderr
    assert "32 → 64 usable positions with tile" in r.stdout
    assert hub.files("org/tiny-gpt2") == needed == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "README.md"}
    assert hub.revisions == ["main"]
    model = load_clean(tmp_path / "out", transformers.AutoModelForCausalLM)
    assert model.transformer.wpe.weight.shape == (64, 16)
    assert "# A tiny model" in (tmp_path / "out" / "README.md").read_text()  # the card quotes the original's
    assert list((home / "hub").glob("models--org--tiny-gpt2/snapshots/*/model.safetensors"))  # HF_HOME's cache

    hub.asked.clear()
    r = posextend_cli(hub, home, "inspect", "org/tiny-gpt2", "--json", offline=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["usable"] == 32 and hub.asked == []  # from the cache, the Hub not asked


def test_a_sharded_hub_model_downloads_its_index_and_both_shards(gpt, hub, tmp_path):
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(gpt).save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt / name, sharded / name)
    decoys = (*DECOYS, "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
              "pytorch_model-00002-of-00002.bin")
    hub.repos["org/sharded"], needed = _repo(sharded, tmp_path / "repo", decoys)
    r = posextend_cli(hub, tmp_path / "hf-home", "resize-model", "org/sharded", tmp_path / "out", "--length", "64")
    assert r.returncode == 0, r.stderr
    assert hub.files("org/sharded") == needed
    assert {"model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= needed
    assert "1 file(s) rewritten, 1 copied whole" in r.stdout  # the shard without the table copied whole
    model = load_clean(tmp_path / "out", transformers.AutoModelForCausalLM)
    assert model.config.n_positions == 64


def test_a_sentence_transformers_hub_model_downloads_its_modules_and_loads_after_the_resize(minilm, hub, tmp_path):
    from sentence_transformers import SentenceTransformer

    hub.repos["sentence-transformers/all-MiniLM-L6-v2"], needed = _repo(minilm, tmp_path / "repo")
    r = posextend_cli(hub, tmp_path / "hf-home", "resize-model", "sentence-transformers/all-MiniLM-L6-v2",
                      tmp_path / "out", "--length", "1024")
    assert r.returncode == 0, r.stderr
    asked = hub.files("sentence-transformers/all-MiniLM-L6-v2")
    assert asked == needed and {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
                                "config_sentence_transformers.json", "model.safetensors", "vocab.txt"} <= asked
    model = SentenceTransformer(str(tmp_path / "out"), device="cpu")
    assert model.max_seq_length == 1024 and [type(m).__name__ for m in model] == ["Transformer", "Pooling", "Normalize"]
    assert model.encode(["word " * 900]).shape == (1, 384)


def test_a_model_without_safetensors_downloads_pytorch_weights_and_a_revision_reaches_the_hub(gpt, hub, tmp_path):
    import torch
    from safetensors.torch import load_file

    bin_only = tmp_path / "bin-only"
    shutil.copytree(gpt, bin_only)
    torch.save(load_file(bin_only / "model.safetensors"), bin_only / "pytorch_model.bin")
    (bin_only / "model.safetensors").unlink()
    decoys = tuple(d for d in DECOYS if d != "pytorch_model.bin")
    hub.repos["org/bin-only"], needed = _repo(bin_only, tmp_path / "repo", decoys)
    r = posextend_cli(hub, tmp_path / "hf-home", "inspect", "org/bin-only", "--json", "--revision", "v1.0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["weights_format"] == "bin"
    assert hub.files("org/bin-only") == needed and "pytorch_model.bin" in needed
    assert hub.revisions == ["v1.0", "v1.0"]  # safetensors first, then PyTorch's weights, of the revision asked


def test_hf_hub_offline_without_the_model_in_the_cache_is_one_line_saying_how_to_get_it(hub, tmp_path):
    hub.repos["org/tiny-gpt2"] = tmp_path
    r = posextend_cli(hub, tmp_path / "empty-home", "resize-model", "org/tiny-gpt2", tmp_path / "out", "--length", "64",
                      offline=True)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert ("org/tiny-gpt2 is not a folder here, and HF_HUB_OFFLINE is set while the Hugging Face cache" in r.stderr
            and "unset HF_HUB_OFFLINE to download it" in r.stderr and "`hf download org/tiny-gpt2 --local-dir DIR`" in r.stderr)
    assert hub.asked == [] and hub.revisions == [] and not (tmp_path / "out").exists()


@pytest.fixture
def in_process(hub, monkeypatch, tmp_path) -> StandIn:
    """The stand-in as the Hub for this process's huggingface_hub, online, with an empty cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return hub


@pytest.mark.parametrize("error, revision, message", [
    ((404, "RepoNotFound"), None, "org/model is neither a folder here nor a model on the Hugging Face Hub (a private "
                                  "model needs `hf auth login` first)"),
    ((404, "RevisionNotFound"), "v9", "The Hugging Face Hub model org/model has no revision 'v9': give a branch, tag"),
    ((403, "GatedRepo"), None, "org/model is a gated model on the Hugging Face Hub: accept its conditions on "
                               "https://huggingface.co/org/model and log in (`hf auth login`)"),
    ((503, ""), None, "org/model is not a folder here, and the Hugging Face Hub could not be reached to download it"),
])
def test_what_the_hub_answers_becomes_one_line_saying_what_to_do(in_process, error, revision, message):
    in_process.errors["org/model"] = error
    with pytest.raises(posextend.SourceError) as raised:
        Checkpoint.resolve("org/model", revision=revision)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_no_hub_at_all_is_one_line(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(posextend.SourceError, match=r"could not be reached to download it: check the connection"):
        posextend.inspect_checkpoint("org/model")


def test_paths_never_reach_the_hub_and_a_revision_needs_a_hub_id(gpt, monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "download", lambda *a, **k: pytest.fail("a path was looked up on the Hub"))
    for missing in (tmp_path / "nope", "./nope", str(tmp_path / "a" / "b")):  # a Path, a relative path, an absolute one
        with pytest.raises(posextend.SourceError, match="does not exist; give the folder of a saved model, or a "
                                                        "Hugging Face Hub id such as openai-community/gpt2"):
            Checkpoint.resolve(missing)
    with pytest.raises(posextend.SourceError, match="is a local folder; a revision .v2. selects a version of a model"):
        Checkpoint.resolve(gpt, revision="v2")


def test_every_door_resolves_a_hub_id_at_its_revision(gpt, corpus, monkeypatch, tmp_path):
    """resize_checkpoint, inspect_checkpoint, evaluate and finetune pass their revision to the one lookup."""
    asked = []

    def download(repo_id, revision=None):
        asked.append((repo_id, revision))
        return gpt

    monkeypatch.setattr(sources, "download", download)
    posextend.resize_checkpoint("org/tiny-gpt2", tmp_path / "resized", 48, revision="r1")
    assert posextend.inspect_checkpoint("org/tiny-gpt2", revision="r2").usable == 32
    posextend.evaluate("org/tiny-gpt2", [corpus], max_sequences=2, batch_size=2, revision="r3")
    posextend.finetune("org/tiny-gpt2", tmp_path / "tuned", [corpus], length=48, steps=1, batch_size=2,
                       eval_sequences=2, train="new-rows", revision="r4")
    assert asked == [("org/tiny-gpt2", r) for r in ("r1", "r2", "r3", "r4")]


def test_a_hub_source_is_recorded_by_its_id_at_its_commit_and_found_again_by_them(gpt, corpus, hub, tmp_path):
    """Provenance and the card name a hub source as another machine can have it (not this one's cache folder);
    the anchor of a later fine-tune looks it up there, offline from the cache, and says so where it cannot."""
    hub.repos["org/tiny-gpt2"], _ = _repo(gpt, tmp_path / "repo")
    home, resized = tmp_path / "hf-home", tmp_path / "resized"
    r = posextend_cli(hub, home, "resize-model", "org/tiny-gpt2", resized, "--length", "64",
                      "--strategy", "interpolate")
    assert r.returncode == 0, r.stderr
    meta = Checkpoint.of(resized).provenance
    assert (meta["posextend.source"], meta["posextend.source_revision"]) == ("org/tiny-gpt2", COMMIT)
    card = (resized / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/tiny-gpt2\n")  # the Hub links the model to its base
    assert f"- Source: `org/tiny-gpt2` (revision `{COMMIT}`)" in card and str(home) not in card

    hub.asked.clear()
    tune = ("finetune", resized, tmp_path / "tuned", "--data", corpus, "--steps", "1", "--batch-size", "2")
    r = posextend_cli(hub, home, *tune, offline=True)
    assert r.returncode == 0, r.stderr
    assert "anchor: held to the original model org/tiny-gpt2" in " ".join(r.stdout.split()) and hub.asked == []
    meta = Checkpoint.of(tmp_path / "tuned").provenance
    assert (meta["posextend.source"], meta["posextend.source_revision"]) == ("org/tiny-gpt2", COMMIT)

    # another machine, whose cache lacks it and which cannot reach the Hub: the anchor says why it holds to the input
    r = posextend_cli(hub, tmp_path / "other-home", *tune[:2], tmp_path / "elsewhere", *tune[3:], offline=True)
    assert r.returncode == 0, r.stderr
    assert ("Anchor: the original model org/tiny-gpt2 that resized was extended from is missing"
            in " ".join(r.stderr.split())), r.stderr
