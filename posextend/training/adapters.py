"""LoRA adapters through peft for ``train="lora"``: LongLoRA's recipe (arXiv 2309.12307) for models too big
to train whole.

LoRA alone, on the attention projections, falls behind full fine-tuning at long lengths; with the
position embeddings and the norms trainable it does not. So a ``lora`` run trains:

- LoRA (rank :data:`RANK`, alpha :data:`ALPHA`, no dropout, started as PiSSA: :data:`INIT`) on every linear
  layer of the attention blocks (:func:`attention_projections`: q, k, v and o, as LongLoRA), found by module type;
  a model without one is refused;
- the position table(s) the family's spec names (the run's tables, whole), as peft ``modules_to_save`` (a table that
  is a parameter of a larger block, ViT's: :func:`table_modules`);
- every normalisation layer (:func:`is_norm`: found by module type, not by name), as ``modules_to_save``;
- a classifier's head (:func:`head_modules`: an image classifier's, whose head may be new), as ``modules_to_save``;
- the tables, norms and head, trained whole, at :data:`WHOLE_LR` of LoRA's lr (:func:`param_groups`).

The adapter goes on the transformers model that holds the table (a sentence-transformers model's first
module), in place: the objective still calls the model it loaded. The output is merged
(:func:`unload`: LoRA folded into the weights it adapts, the trained tables and norms in place of the
originals) and written as a plain checkpoint by the fine-tune's writer; the adapter itself, on request,
as peft saves it (:class:`AdapterFiles`), converted to a plain LoRA of the source's weights (PiSSA trains a
residual of them: :func:`adapter_files`).

What else decides what trains lives here too: :func:`keep_rows`, a table's first rows kept while the rest learns
(``new-rows`` training, and Long-CLIP's kps rows in the image-text objective).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posextend.errors import TrainingError

log = logging.getLogger(__name__)

# LongLoRA and peft use rank 8; at the same steps rank 32 read the quality grid's far range closer to `all`'s
# (benchmarks/lora.py: 2x128 1.034 of it against 1.044, 4x192 1.059 against 1.081) and keeps a
# GPT-2-small-shaped model at 4096 positions at 3.9% trainable (the table is 2.5% of it)
RANK = 32
ALPHA = 64  # LoRA's update is scaled by ALPHA / RANK (2, as peft's and LongLoRA's 16 / 8)
DROPOUT = 0.0  # posextend's language models train without dropout
# PiSSA (arXiv 2404.02948; peft's fast-SVD variant): LoRA starts as the weight's top RANK singular directions, the
# rest frozen, rather than at zero. In the time of `all`'s 150 steps it read the grid's far range at 1.016 of `all`'s
# on 2x128 and 1.040 on 4x192, against 1.034 and 1.059 from zero (benchmarks/lora.py)
INIT = "pissa_niter_4"
# the table(s) and norms are trained whole, as under `all`, so they take a whole weight's step: half LoRA's lr (a
# causal LM's: 1e-3, `all`'s). benchmarks/lora.py, in the time of `all`'s 150 steps, far range over `all`'s: 2x128
# 1.006 against 1.016 at LoRA's lr, 1.018 against 1.030 on the novel kept aside; a quarter read as half, 3x 1.049
WHOLE_LR = 0.5
# torch's normalisation layers; a model's own classes (LlamaRMSNorm, T5LayerNorm) are found by their type's name
_TORCH_NORMS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm, torch.nn.modules.batchnorm._NormBase)


def attention_projections(model: torch.nn.Module) -> list[str]:
    """The names of the linear layers (``nn.Linear``, transformers' ``Conv1D``) inside ``model``'s attention blocks:
    the modules whose class's name ends in ``Attention``, found by type as the norms are (:func:`is_norm`). These
    are LongLoRA's q, k, v and o: GPT-2's ``c_attn`` and ``attn.c_proj``; BERT's query, key, value and
    ``attention.output.dense``; MPNet's, DistilBERT's, CLIP's, BART's (cross-attention too) … A model without
    such a block is refused."""
    from transformers.pytorch_utils import Conv1D

    names = {f"{name}.{sub}" if name else sub for name, block in model.named_modules()
             if type(block).__name__.endswith("Attention")
             for sub, layer in block.named_modules() if sub and isinstance(layer, (torch.nn.Linear, Conv1D))}
    if not names:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise TrainingError(
            f"No attention block of this {kind} model (a module whose class's name ends in Attention) holds a linear "
            "layer, so LoRA has nowhere to go; train the positions or every parameter instead.")
    return sorted(names)


def is_norm(module: torch.nn.Module) -> bool:
    """A normalisation layer: one of torch's (LayerNorm, RMSNorm, GroupNorm, the batch and instance norms), or a
    class of the model's own whose name ends in ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``) with parameters of
    its own and no submodules (so never a block that contains one)."""
    if isinstance(module, _TORCH_NORMS):
        return any(True for _ in module.parameters(recurse=False))
    own = any(True for _ in module.parameters(recurse=False))
    return own and not any(True for _ in module.children()) and type(module).__name__.lower().endswith("norm")


def norm_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s normalisation layers (:func:`is_norm`)."""
    return [name for name, module in model.named_modules() if name and is_norm(module)]


def table_modules(model: torch.nn.Module, tables: Sequence[torch.nn.Parameter]
                  ) -> tuple[list[str], list[torch.nn.Parameter]]:
    """Where ``tables`` (parameters of ``model``) train whole beside LoRA: the names of the modules that peft keeps a
    trained copy of (``modules_to_save``), and the tables that train as plain parameters instead. A table that is its
    module's one parameter (an embedding) is saved as that module. One that is a parameter of a larger block: the
    block, when no attention block is inside it (ViT's, DeiT's, DINOv2's embeddings, whose patch projection and class
    token then train whole too, as LongLoRA trains a language model's embeddings); else the table alone, as a plain
    parameter (SAM's grid is a parameter of its whole encoder), which the merged output holds but peft's adapter
    files do not."""
    owners = {id(p): name.rpartition(".")[0] for name, p in model.named_parameters()}
    names, plain = [], []
    for table in tables:
        owner = owners.get(id(table))
        if owner is None:
            raise TrainingError("The position table is not a parameter of the model LoRA adapts; "
                                "train the positions or every parameter instead.")
        block = model.get_submodule(owner)
        if len(list(block.parameters())) == 1 or not any(
                type(m).__name__.endswith("Attention") for m in block.modules()):
            names.append(owner)
        else:
            plain.append(table)
    return names, plain


def head_modules(model: torch.nn.Module) -> list[str]:
    """A classifier's task head (the modules with parameters outside its base model, in a class whose name holds
    ``Classification``): trained whole beside LoRA, as peft's own classification tasks save theirs (a head made for the
    user's classes has learned nothing yet). None for other models."""
    base = getattr(model, "base_model", model)
    if base is model or "Classification" not in type(model).__name__:
        return []
    return [name for name, child in model.named_children()
            if child is not base and any(True for _ in child.parameters())]


@dataclass(frozen=True)
class Lora:
    """An adapter on a model (:func:`add_lora`): peft's ``PeftModel``, and LoRA's matrices as they started.
    PiSSA moved their product out of the adapted weights, so the adapter's files (:func:`adapter_files`) subtract it."""

    peft: Any
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # peft's state-dict names: LoRA's A and B at the start


def add_lora(model: torch.nn.Module, tables: Sequence[torch.nn.Parameter], *, init: str | bool = INIT) -> Lora:
    """Put LoRA on ``model``'s attention projections, in place, with ``tables`` (parameters of ``model``) and
    every norm trainable (peft ``modules_to_save``); everything else frozen. ``init``: peft's
    ``init_lora_weights`` (True: LoRA's own, B at zero; the only one for a model on the meta device). Returns the
    :class:`Lora` that holds the adapter (:func:`unload` merges it); ``model`` itself is the one to call.

    Examples:
        >>> lora = add_lora(gpt2, [gpt2.transformer.wpe.weight])
        >>> gpt2(input_ids).logits  # LoRA's layers in the forward pass
    """
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import ModulesToSaveWrapper
    from transformers.pytorch_utils import Conv1D

    targets = attention_projections(model)
    blocks, plain = table_modules(model, tables)
    whole = blocks + head_modules(model)
    norms = [n for n in norm_modules(model) if not any(n.startswith(w + ".") for w in whole)]  # not inside them
    saved = list(dict.fromkeys(whole + norms))
    modules = dict(model.named_modules())
    fan_in_fan_out = any(isinstance(modules[n], Conv1D) for n in targets)
    total = sum(p.numel() for p in model.parameters())
    # PiSSA's matrices hold at most a layer's rank: a layer narrower than RANK (a tiny model) gets its own
    rank = min(RANK, *(min(modules[n].weight.shape) for n in targets))
    config = LoraConfig(r=rank, lora_alpha=ALPHA * rank // RANK, lora_dropout=DROPOUT, target_modules=targets,
                        modules_to_save=saved, fan_in_fan_out=fan_in_fan_out, init_lora_weights=init)
    adapter = get_peft_model(model, config)
    for table in plain:  # trained as a plain parameter (peft froze it)
        table.requires_grad_(True)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    if sorted(wrapped) != sorted(saved):  # peft matches modules_to_save by the end of their names
        other = sorted(set(wrapped) ^ set(saved))[0]
        raise TrainingError(f"peft made other modules trainable than the table(s) and norms ({other}); train the "
                            "positions or every parameter instead.")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA (rank %d) on %d attention projections (%s), with %d table(s) and %d norms: %s trainable "
             "parameters, %.2f%% of %s", rank, len(targets), ", ".join(sorted({n.rpartition(".")[2] for n in targets})),
             len(tables), len(norm_modules(model)), f"{trainable:,}", 100 * trainable / total, f"{total:,}")
    return Lora(adapter, _lora_matrices(adapter) if init is not True else {})


def param_groups(lora: Lora, lr: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups of a model adapted by :func:`add_lora`: LoRA's matrices at ``lr``, what trains
    whole (the tables, norms and a classifier's head: peft's ``modules_to_save``, and a table trained as a plain
    parameter) at :data:`WHOLE_LR` × ``lr``."""
    trained = [(n, p) for n, p in lora.peft.named_parameters() if p.requires_grad]
    whole = [p for n, p in trained if ".lora_" not in n]
    adapted = [p for n, p in trained if ".lora_" in n]
    return [{"params": adapted, "lr": lr}, {"params": whole, "lr": WHOLE_LR * lr}]


def _lora_matrices(adapter: Any) -> dict[str, torch.Tensor]:
    """A copy of LoRA's A and B matrices, by the names peft saves them under."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(adapter).items()
            if ".lora_A." in k or ".lora_B." in k}


def trainable_share(model: torch.nn.Module) -> float:
    """The trainable parameters of ``model`` (adapted by :func:`add_lora`) over the parameters of the model they
    train (without LoRA's matrices, and without the frozen originals peft keeps of the tables and norms)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    originals = sum(p.numel() for n, p in model.named_parameters() if ".original_module." in n)
    return trainable / (sum(p.numel() for p in model.parameters()) - lora - originals)


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter as peft saves it (``adapter_config.json``, ``adapter_model.safetensors``), taken before
    merging. Its base is the source model extended to the run's length (any strategy: the tables are in
    the adapter whole)."""

    state: dict[str, torch.Tensor]
    config: Any

    def write(self, folder: Path) -> None:
        from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
        from safetensors.torch import save_file

        folder.mkdir()
        save_file(self.state, str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
        self.config.save_pretrained(str(folder))


def adapter_files(lora: Lora) -> AdapterFiles:
    """The adapter's weights and config as ``PeftModel.save_pretrained`` writes them; one that started from
    PiSSA as peft converts it (``path_initial_model_for_weight_conversion``): a LoRA of twice the rank whose
    product is the trained one less the initial one (``B A - B0 A0 = [B | -B0] [A ; A0]``), so that it applies
    to the source's own weights, not to the residual PiSSA trained."""
    from peft.utils import get_peft_model_state_dict

    state = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(lora.peft).items()}
    config = copy.deepcopy(lora.peft.peft_config["default"])
    config.inference_mode = True
    if lora.initial:
        for name, start in lora.initial.items():
            state[name] = torch.cat([state[name], start], 0) if ".lora_A." in name else torch.cat([state[name], -start], 1)
        config.init_lora_weights, config.r, config.lora_alpha = True, 2 * config.r, 2 * config.lora_alpha
    return AdapterFiles({k: v.contiguous() for k, v in state.items()}, config)


def unload(lora: Lora) -> torch.nn.Module:
    """Merge the LoRA weights into the projections they adapt and put the trained tables and norms in place
    of peft's wrappers: the model, plain again, in place (a sentence-transformers model holding it holds
    it merged). The parameters that changed are marked trainable, which tells the writer to compare them
    with the files."""
    adapter = lora.peft
    changed = list(adapter.base_model.targeted_module_names) + list(adapter.peft_config["default"].modules_to_save)
    model = adapter.merge_and_unload()
    for name in changed:
        model.get_submodule(name).requires_grad_(True)
    return model


def merge(lora: Lora, root: torch.nn.Module, *, keep_adapter: bool
          ) -> tuple[dict[str, torch.Tensor], AdapterFiles | None]:
    """The trained model's weights with the adapter merged (:func:`unload`): the state dict of ``root``, the
    model that trained (which holds the adapted one); and, with ``keep_adapter``, the adapter's files, taken
    before merging."""
    files = adapter_files(lora) if keep_adapter else None
    unload(lora)
    return root.state_dict(), files


def keep_rows(table: torch.Tensor, keep: int) -> torch.Tensor:
    """Zero the gradient of ``table``'s first ``keep`` rows for as long as it trains (a hook on the tensor: the rows
    from ``keep`` on learn); returns those rows as they are now, a copy. An optimizer may still move a row with zero
    gradient (weight decay, Adam's moments), so a run that must keep them exact writes the copy back after each step."""
    table.register_hook(lambda grad: torch.cat([torch.zeros_like(grad[:keep]), grad[keep:]]))
    return table.detach()[:keep].clone()
