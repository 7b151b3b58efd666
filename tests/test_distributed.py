"""Fine-tuning on two CPU processes (gloo) equals one process with the same global batch.

Each run on two processes is a real launch of the CLI, as the README documents it: ``torchrun`` or
``accelerate launch``; the one-process runs they are compared with run in the test's process, through
``posextend.finetune`` with the same options (built once a test process). Dropout is off in these twins: it is the one random choice inside
the model, drawn per process, so with it two runs are alike in distribution, not to the bit.
Every run computes in fp32 (``--mixed-precision no``): bf16 autocast, which ``auto`` picks on a CPU
with bf16 instructions, rounds differently when the batch is split across processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import posextend

from tiny import FAMILIES, build, sentence_transformer

STEPS = 6
TOLERANCE = 1e-5


def _twin(kind: str, root: Path) -> Path:
    if kind == "causal":
        fam = FAMILIES["gpt2"]
        overrides = {**fam.overrides, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    else:
        fam = FAMILIES["bert"]
        overrides = {**fam.overrides, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
                     "attention_probs_dropout_prob": 0.0}
    return build(dataclasses.replace(fam, overrides=overrides, usable=32), root / f"{kind}-src")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _launch(launcher: str, processes: int, args: list[str]) -> subprocess.CompletedProcess:
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    else:  # accelerate
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={processes}",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", "--main_process_port=0"]
    result = subprocess.run([*cmd, "-m", "posextend.cli", *args], capture_output=True, text=True, env=_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _finetune(launcher, processes, src, dst, corpus, batch_size, *extra):
    return _launch(launcher, processes, ["finetune", str(src), str(dst), "--data", str(corpus), "--length", "48",
                                         "--steps", str(STEPS), "--batch-size", str(batch_size), "--lr", "3e-3",
                                         "--seed", "0", "--mixed-precision", "no", *extra])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus):
    """``one_process(kind)``: the twin of ``kind`` and its run on one process with the global batch of 2, built once
    a test process (each run of two is compared with it), here: ``posextend.finetune`` with the CLI's options."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"one-{kind}")
            src = _twin(kind, root)
            posextend.finetune(src, root / "one", [corpus], length=48, steps=STEPS, batch_size=2, lr=3e-3, seed=0,
                               mixed_precision="no")
            made[kind] = src, root / "one"
        return made[kind]

    return get


def _max_diff(a: Path, b: Path) -> float:
    """Largest difference over every tensor both hold with the same shape."""
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x if x[k].shape == y[k].shape)


def _update_difference(src: Path, a: Path, b: Path) -> float:
    """|update_a - update_b| / |update_a| over every tensor the three hold with the same shape."""
    s, x, y = (load_file(p / "model.safetensors") for p in (src, a, b))
    same = [k for k in x if k in s and s[k].shape == x[k].shape == y[k].shape]
    num = sum(float(((x[k].double() - y[k].double()) ** 2).sum()) for k in same)
    den = sum(float(((x[k].double() - s[k].double()) ** 2).sum()) for k in same)
    assert den > 0, f"{a} did not train: its weights equal the source's"
    return (num / den) ** 0.5


def _tokens(card: Path) -> int:
    return int(re.search(r"for \d+ steps \((\d+) tokens", card.read_text()).group(1))


@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_two_processes_equal_one_with_the_same_global_batch(tmp_path, corpus, one_process, kind):
    src, one = one_process(kind)
    two = _finetune("torchrun", 2, src, tmp_path / "two", corpus, 1)
    assert _max_diff(one, tmp_path / "two") < TOLERANCE
    assert _max_diff(src, tmp_path / "two") > 1e-3  # it did train
    # one output, one report, every process's tokens counted
    assert two.stdout.count("Fine-tuned") == 1 and "on 2 processes" in two.stdout
    assert _tokens(tmp_path / "two" / "README.md") == _tokens(one / "README.md") == STEPS * 2 * 48
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("two")) == ["two"]


def test_contrastive_two_processes_equal_one(tmp_path, corpus):
    """In-batch negatives are gathered across processes: the global batch is the same either way.

    On a tiny sentence-transformers twin (BERT 2 x 16 at 64 positions, mean pooling, no dropout) extended to 160.
    Compared by the whole update rather than the largest difference: some gradients here are
    zero up to rounding (attention key biases: softmax ignores them), and Adam turns a gradient's
    rounding into a step of the full learning rate. Without the gathering each process would see
    one document and no negative (loss 0): the updates would differ entirely."""
    src = sentence_transformer(tmp_path)
    args = ["--length", "160", "--steps", "3", "--lr", "1e-3", "--seed", "0", "--eval-every", "0",
            "--eval-sequences", "2", "--mixed-precision", "no"]
    one = posextend.finetune(src, tmp_path / "one", [corpus], batch_size=2, length=160, steps=3, lr=1e-3, seed=0,
                             eval_every=0, eval_sequences=2, mixed_precision="no")
    two = _launch("torchrun", 2, ["finetune", str(src), str(tmp_path / "two"), "--data", str(corpus),
                                  "--batch-size", "1", *args])
    assert one.objective == "contrastive" and "on 2 processes" in two.stdout
    assert _update_difference(src, tmp_path / "one", tmp_path / "two") < 1e-2


def test_accelerate_launch_forms_a_cpu_group(tmp_path, corpus, one_process):
    src, one = one_process("masked")
    two = _finetune("accelerate", 2, src, tmp_path / "two", corpus, 1)
    assert "on 2 processes" in two.stdout and two.stdout.count("Fine-tuned") == 1
    assert _max_diff(one, tmp_path / "two") < TOLERANCE


def test_fsdp_config_shipped_in_examples_trains_on_two_cpu_processes(tmp_path, corpus, one_process):
    """examples/accelerate/fsdp.yaml (2 processes, fp32 here): sharded training, full weights written."""
    shipped = (Path(__file__).parent.parent / "examples" / "accelerate" / "fsdp.yaml").read_text()
    config = tmp_path / "fsdp.yaml"
    config.write_text(shipped.replace("num_processes: 8", "num_processes: 2").replace("mixed_precision: bf16",
                                                                                      "mixed_precision: 'no'"))
    src, one = one_process("causal")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port=0",
           "-m", "posextend.cli", "finetune", str(src), str(tmp_path / "two"), "--data", str(corpus), "--length", "48",
           "--steps", str(STEPS), "--batch-size", "1", "--lr", "3e-3", "--seed", "0", "--mixed-precision", "no"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "on 2 processes" in result.stdout
    assert _max_diff(one, tmp_path / "two") < TOLERANCE


def test_resume_on_one_process_continues_a_two_process_run(tmp_path, corpus, one_process):
    """State saved by 2 processes, resumed by 1 with the same global batch: the same weights."""
    src, straight = one_process("masked")
    driver = tmp_path / "interrupted.py"
    driver.write_text(
        "import sys, posextend\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from tiny import loss_nan_at\n"
        "from posextend.training.loop import finetune\n"
        "try:\n"
        "    with loss_nan_at(4):\n"
        f"        finetune({str(src)!r}, {str(tmp_path / 'resumed')!r}, [{str(corpus)!r}], length=48, steps={STEPS},\n"
        "                 batch_size=1, lr=3e-3, seed=0, mixed_precision='no')\n"
        "except posextend.TrainingError as exc:\n"
        "    print('stopped:', exc)\n"
    )
    stopped = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(driver)], capture_output=True, text=True, env=_env(), timeout=600)
    assert stopped.returncode == 0 and stopped.stdout.count("stopped:") == 2, stopped.stdout + stopped.stderr[-2000:]
    assert (tmp_path / "resumed.state" / "posextend.json").is_file() and not (tmp_path / "resumed").exists()
    posextend.finetune(src, tmp_path / "resumed", [corpus], length=48, steps=STEPS, batch_size=2, lr=3e-3, seed=0,
                       mixed_precision="no", resume=True)
    assert _max_diff(straight, tmp_path / "resumed") < TOLERANCE
    assert not (tmp_path / "resumed.state").exists()


def test_a_process_group_accelerate_does_not_see_is_refused_in_one_line(monkeypatch):
    """Started as 2 processes, but accelerate sees 1 (e.g. a launcher that set no CPU group up)."""
    from unittest import mock

    from posextend.errors import TrainingError
    from posextend.training.setup import make_accelerator

    monkeypatch.setenv("WORLD_SIZE", "2")
    with mock.patch("accelerate.Accelerator") as accelerator:
        accelerator.return_value.num_processes = 1
        with pytest.raises(TrainingError, match="started 2 processes .* formed a group of 1"):
            make_accelerator("no", 1)
    assert accelerator.call_args.kwargs["cpu"] is not torch.cuda.is_available()  # a CPU group without a GPU
