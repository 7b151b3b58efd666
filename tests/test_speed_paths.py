"""What makes a fine-tune step cheap on a GPU, checked on CPU: PyTorch's fused attention (SDPA) where the family
has it, the ``auto`` precision, fused AdamW, and gradient checkpointing turned on when the first step runs out of
GPU memory (a test objective raises the out-of-memory error CUDA would)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file

from posextend.errors import TrainingError
from posextend.training import loop
from posextend.training.loading import attention_kwargs, load_headed_model
from posextend.training.objectives.causal import CausalLM
from posextend.training.setup import _adamw, cpu_has_native_bf16, make_accelerator, precision_for
from tiny import FAMILIES, build


def _eager(path, cls):
    return cls.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.parametrize("fixture, cls, objective", [("gpt", transformers.AutoModelForCausalLM, "causal"),
                                                     ("bert", transformers.AutoModelForMaskedLM, "masked")])
def test_training_loads_sdpa_with_the_outputs_of_eager_attention(request, fixture, cls, objective):
    path = request.getfixturevalue(fixture)
    model = load_headed_model(path, cls, objective, objective).model.eval()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(5, 1000, (3, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # a padded row: the mask takes SDPA's masked path
    mask[2, 9:] = 0
    with torch.no_grad():
        fused = model(input_ids=ids, attention_mask=mask).logits
        plain = _eager(path, cls)(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert fused.shape == plain.shape == (3, 32, model.config.vocab_size)
    assert (fused[keep] - plain[keep]).abs().max() < 1e-5


def test_a_family_without_sdpa_loads_with_its_own_attention(tmp_path):
    path = build(FAMILIES["gpt_neo"], tmp_path / "neo")
    assert attention_kwargs(transformers.AutoModelForCausalLM, {"model_type": "gpt_neo"}) == {}
    model = load_headed_model(path, transformers.AutoModelForCausalLM, "causal", "causal").model
    assert model.config._attn_implementation == "eager"
    assert attention_kwargs(transformers.GPT2LMHeadModel, {}) == {"attn_implementation": "sdpa"}  # a class itself


def test_contrastive_loads_the_sentence_transformer_with_sdpa(minilm):
    from posextend.training.objectives.contrastive import Contrastive

    loaded = Contrastive().load_model(minilm, init_head=False)
    assert loaded.hf_model.config._attn_implementation == "sdpa"
    embedding = loaded.model.encode(["The grass is green."], convert_to_tensor=True)
    assert embedding.shape == (1, 384) and torch.isfinite(embedding).all()


def test_auto_precision_is_bf16_only_where_the_device_computes_it_natively(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for avx512_bf16, amx, expected in ((False, False, "no"), (True, False, "bf16"), (False, True, "bf16")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert precision_for("auto", cpu) == expected
        assert [precision_for(p, cpu) for p in ("no", "fp16", "bf16")] == ["no", "fp16", "bf16"]
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # a torch without the checks: fp32, as before
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert precision_for("auto", cpu) == "no"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert precision_for("auto", cuda) == "no"  # emulated only (pre-Ampere)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert precision_for("auto", cuda) == "bf16"
    assert precision_for("no", cuda) == "no"
    assert precision_for("auto", torch.device("mps")) == "no"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's choice")
def test_the_default_precision_on_cpu_follows_its_bf16_instructions():
    expected = "bf16" if cpu_has_native_bf16() else "no"
    accelerator = make_accelerator("auto", 1)
    assert accelerator.mixed_precision == expected
    with accelerator.autocast():
        product = torch.ones(4, 4) @ torch.ones(4, 4)
    assert product.dtype == (torch.bfloat16 if expected == "bf16" else torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's choice")
def test_auto_precision_is_the_launchers_when_accelerate_launch_gives_one(monkeypatch):
    """``accelerate launch --mixed_precision P`` (or its config file) sets ACCELERATE_MIXED_PRECISION: ``auto`` follows
    it, here the opposite of what this CPU would pick; a precision given to the run still wins."""
    own = precision_for("auto", torch.device("cpu"))
    launcher = "no" if own == "bf16" else "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    assert make_accelerator("auto", 1).mixed_precision == launcher
    assert make_accelerator(own, 1).mixed_precision == own
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(TrainingError, match="launch with no, fp16 or bf16"):
        make_accelerator("auto", 1)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_run_says_what_precision_its_steps_computed_in(gpt, corpus, tmp_path, precision):
    """bf16 autocast on CPU (what ``auto`` picks on a CPU with bf16 instructions) trains; the report, its JSON and the
    model card say which precision the steps used. Both run in one process, one after the other (accelerate refuses
    a second precision in its process-wide state unless the run starts it afresh)."""
    report = loop.finetune(gpt, tmp_path / "out", [corpus], length=64, steps=2, batch_size=2, eval_sequences=2,
                           seed=0, mixed_precision=precision)
    assert report.precision == precision == report.to_dict()["precision"]
    assert report.precision_note == ("" if precision == "no" else ", bf16")
    assert all(torch.isfinite(torch.tensor(report.losses)))
    trained = next(line for line in (tmp_path / "out" / "README.md").read_text().splitlines() if "- Trained:" in line)
    assert (", bf16)" in trained) == (precision == "bf16")


def test_adamw_is_fused_and_keeps_the_parameters_accelerate_moves():
    model = torch.nn.Linear(8, 3)
    optimizer = _adamw(list(model.parameters()), 1e-3)
    assert optimizer.defaults["fused"] is True  # torch >= 2.4 has the kernel on CPU as on CUDA
    prepared, wrapped = make_accelerator("no", 1).prepare(model, optimizer)
    # the device move is in place: the optimizer steps the model's own parameters wherever they went
    assert [id(p) for p in wrapped.optimizer.param_groups[0]["params"]] == [id(p) for p in prepared.parameters()]


class OutOfMemory(CausalLM):
    """The causal objective, whose micro-batch starting at sample ``at`` runs out of GPU memory (as CUDA raises it)
    unless gradient checkpointing is on (``always``: even then)."""

    def __init__(self, at: int = 0, always: bool = False):
        self.at, self.always, self.raised = at, always, []  # shared by the copy the anchor option makes

    def loss(self, run, positions, batch):
        if positions.start == self.at and (self.always or not run.unwrapped.is_gradient_checkpointing):
            self.raised.append(positions.start)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's)")
        return super().loss(run, positions, batch)


def _finetune(monkeypatch, objective, gpt, corpus, out, **options):
    monkeypatch.setattr(loop, "get_objective", lambda name: objective)
    # fp32, so that the out-of-memory message offers bf16 (it does not when the run computes in it already)
    return loop.finetune(gpt, out, [corpus], steps=3, batch_size=2, anchor=0, seed=0, mixed_precision="no", **options)


def test_first_step_out_of_memory_retries_once_with_gradient_checkpointing(monkeypatch, caplog, gpt, corpus, tmp_path):
    objective = OutOfMemory()
    with caplog.at_level(logging.WARNING, logger="posextend.training.setup"):
        report = _finetune(monkeypatch, objective, gpt, corpus, tmp_path / "retried", grad_accum=2)
    assert objective.raised == [0] and len(report.losses) == 3
    lines = [r.getMessage() for r in caplog.records if "gradient checkpointing" in r.getMessage()]
    assert lines == ["The first step did not fit in GPU memory: training with gradient checkpointing on "
                     "(slower, less memory)"]
    # nothing had trained, and accumulation starts again: the run is the one with checkpointing on from the start
    _finetune(monkeypatch, CausalLM(), gpt, corpus, tmp_path / "planned", grad_accum=2, gradient_checkpointing=True)
    retried, planned = load_file(tmp_path / "retried" / "model.safetensors"), load_file(tmp_path / "planned" / "model.safetensors")
    assert retried.keys() == planned.keys()
    assert max(float((retried[k] - planned[k]).abs().max()) for k in planned) < 1e-6
    assert any(not torch.equal(retried[k], v) for k, v in load_file(gpt / "model.safetensors").items())  # it trained


@pytest.mark.parametrize("at, checkpointing, told", [(2, False, "after 1 optimizer step(s)"),
                                                     (0, True, "after 0 optimizer step(s)")])
def test_out_of_memory_that_a_retry_cannot_fix_says_what_to_change(monkeypatch, gpt, corpus, tmp_path, at,
                                                                    checkpointing, told):
    objective = OutOfMemory(at=at, always=True)
    with pytest.raises(TrainingError, match="Out of GPU memory") as error:
        _finetune(monkeypatch, objective, gpt, corpus, tmp_path / "out", gradient_checkpointing=checkpointing)
    message = str(error.value)
    assert told in message and "use bf16" in message and "lower the batch size" in message
    assert ("turn gradient checkpointing on" in message) is not checkpointing
    assert objective.raised == [at] and not (tmp_path / "out").exists()
