"""The census: every model type the installed transformers registers, resized or refused.

For each type: a tiny twin is built from its default config (widths and layers shrunk,
lengths capped at 64 and images at 16 patches a side, so forwards are quick) and saved with a
tokenizer config; posextend resizes each of its position lengths 2x with ``tile``; the result is
checked *independently* of posextend's own verification: clean ``from_pretrained``, a forward at the full new length,
outputs on a short input bit-identical to the source's, and the tokenizer and config agreeing.

Outcomes:
- ``verified``: resized and every check passed;
- ``refused``: a PosExtendError with a reason, and the twin holds no learned 1-D table;
- ``refused-table``: refused although the twin holds a 1-D position-named table;
- ``grid``: refused; the twin holds a 2-D image-patch grid that cannot be resized safely (the reason says why);
- ``grid-probed``: a 2-D image-patch grid observed on twins, resized to twice the image size and checked
  (against the family's run-time ``interpolate_pos_encoding`` where it has one);
- ``run-time-grid``: refused with the reason: the family adapts its grid to each image on every
  forward (YOLOS, SigLIP2 by a written note; others observed: a twin runs at two image sizes with
  one table), so there is nothing on disk to resize;
- ``grid-spec``: a 2-D image-patch grid with a written spec (``--image-size``), checked by
  tests/test_vision.py against transformers' run-time interpolation, not walked here;
- ``silently-wrong``: written, then a check failed (must never happen);
- ``no-twin``: transformers itself cannot build the type from its default config.

Run ``python tests/census.py --json posextend/families/census.json`` to take the record again (it is package
data: ``posextend families`` reads it), then ``python scripts/gen_families_docs.py`` to render docs/families.md
from it (``--out docs/families.md`` renders a run's results directly, the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import posextend  # noqa: E402
from posextend.families import configs, twin, twin_runs  # noqa: E402
from posextend.families.lookup import all_specs  # noqa: E402
from posextend.families.probe import length_fields  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")
LENGTH_CAP = 64
GRID_CAP = 16  # patches a side of a twin's image (see :func:`capped`)


@dataclass
class Result:
    model_type: str
    outcome: str
    cls: str = ""
    covered_by: str = ""
    groups: list[dict] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0
    layouts: dict[str, dict] = field(default_factory=dict)  # layout -> {"outcome", "reason"}
    grids: list[dict] = field(default_factory=list)  # probed image grids: group, tables, prefix, reference, outcome


def model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def _class_for(model_type: str, config: dict) -> type | None:
    """What a user's checkpoint would be: the LM-headed class when there is one, else the base."""
    from transformers.models.auto import modeling_auto as m

    mappings = [m.MODEL_FOR_MASKED_LM_MAPPING_NAMES, m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, m.MODEL_MAPPING_NAMES]
    if config.get("is_encoder_decoder"):
        mappings.insert(0, m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    mappings += [v for k, v in sorted(vars(m).items()) if k.startswith("MODEL_FOR_") and k.endswith("_MAPPING_NAMES")]
    for mapping in mappings:
        names = mapping.get(model_type)
        for name in [names] if isinstance(names, str) else list(names or []):
            cls = getattr(transformers, name, None)
            if isinstance(cls, type):
                return cls
    # sub-model types (clap_text_model, siglip_text_model ...): the class named like the config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    name = CONFIG_MAPPING_NAMES.get(model_type, "").removesuffix("Config") + "Model"
    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) else None


# Default configs that cannot build a model on their own (a field is None by default).
OVERRIDES = {
    "esm": dict(vocab_size=33, pad_token_id=1, mask_token_id=32, position_embedding_type="absolute"),
}


def default_config(model_type: str) -> dict:
    cfg = transformers.AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {})).to_dict()
    cfg["model_type"] = model_type
    return cfg


def capped(config: dict) -> dict:
    """Lengths capped at :data:`LENGTH_CAP`, and a local attention window (LED's, Longformer's) at a quarter of it:
    a stack that pads its input to a multiple of its window (LED's encoder) must still run within its table.
    Image sizes are capped at :data:`GRID_CAP` patches a side: a SAM-style tower's 1024 px (64 patches a side,
    128 once doubled) made the census's slowest forward passes, and a grid's handling does not depend on its size
    (16 patches still span several of SAM's 14-patch windows)."""
    out = config
    for path in length_fields(config):
        if configs.get_path(out, path) > LENGTH_CAP:
            out = configs.set_path(out, path, LENGTH_CAP)
    for path, sub in list(configs.sub_configs(out)):
        size, patch = sub.get("image_size"), sub.get("patch_size")
        if isinstance(size, int) and isinstance(patch, int) and patch > 0 and size > GRID_CAP * patch:
            out = configs.set_path(out, f"{path}image_size", GRID_CAP * patch)
    window = out.get("attention_window")
    if isinstance(window, int) and window > LENGTH_CAP // 4:
        out = {**out, "attention_window": LENGTH_CAP // 4}
    elif isinstance(window, list) and any(w > LENGTH_CAP // 4 for w in window):
        out = {**out, "attention_window": [min(w, LENGTH_CAP // 4) for w in window]}
    return out


def holds_table(config: dict, cls: type) -> str:
    """'grid', 'table' or '' from the twin's parameter shapes (for classifying refusals only).

    Only absolute tables count (:func:`posextend.families.twin.absolute_position_tables`). 'grid': one shaped
    as an image grid (:func:`posextend.families.twin.is_grid_shape`), in a model whose config has a patch size.
    'table': a 2-D one with as many rows as a length field says (or 2 more).
    """
    try:
        model = twin.build(config, device="meta", cls=cls)
    except Exception:
        return ""
    lengths = {configs.get_path(config, f) for f in length_fields(config)}
    patches = any("patch_size" in sub for _, sub in configs.sub_configs(config))
    kind = ""
    for _, p in twin.absolute_position_tables(model):
        shape = tuple(p.shape)
        if patches and twin.is_grid_shape(shape):
            kind = "grid"
        elif len(shape) == 2 and shape[0] in {v + k for v in lengths for k in (0, 2)}:
            return "table"
    return kind


def _owned(model):
    """``model`` in float32, eval mode, every tensor 64-byte aligned: weights left mapped from a file sit
    at the file's offsets, and CPU kernels round differently at other alignments (1e-8 noise)."""
    model = model.float().eval()
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() % 64:
            tensor.data = tensor.data.clone()
    return model


def _load_both(src: Path, dst: Path, cls: type):
    """``(written, source)`` loaded by ``cls``, after checking the written one loads as cleanly as the source
    (bare weights loaded by a family's only, headed, class lack the head in both)."""
    torch.manual_seed(0)  # weights the file lacks start the same in both
    loaded, info = cls.from_pretrained(dst, output_loading_info=True)
    torch.manual_seed(0)
    source, expected = cls.from_pretrained(src, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and v != expected[k]}
    assert not problems, f"from_pretrained is not clean: {problems}"
    return _owned(loaded), _owned(source)


def _tensors(out, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a forward's output (logits, encoder states, n-gram logits ...), by a stable name."""
    if isinstance(out, torch.Tensor):
        return {prefix or "output": out}
    items = out.items() if hasattr(out, "items") else enumerate(out) if isinstance(out, (tuple, list)) else ()
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        if value is not None:
            found.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def _stack_inputs(model, path: str, lengths: dict[str, int], config: dict) -> dict[str, torch.Tensor]:
    """Token inputs of module ``path``: each stack (``input_ids``, ``decoder_input_ids`` ...) gets random
    plain tokens of its length in ``lengths`` (else 5 + its index), the same for the same lengths."""
    module = model.get_submodule(path) if path else model
    inputs = twin_runs.forward_inputs(model, module, torch.zeros((1, 5), dtype=torch.long))
    for i, key in enumerate(_stacks(inputs)):
        inputs[key] = twin_runs.random_tokens(config, lengths.get(key, 5 + i), seed=i)
    if "bbox" in inputs:  # layout models: one box per token of the first stack
        inputs["bbox"] = torch.zeros((*inputs[_stacks(inputs)[0]].shape, 4), dtype=torch.long)
    return inputs


def _stacks(inputs: dict[str, torch.Tensor]) -> list[str]:
    """The inputs that are token ids of a stack (encoder, decoder)."""
    return [k for k, v in inputs.items() if k != "bbox" and v.dtype == torch.long and v.dim() == 2]


def _run(model, path: str, inputs: dict[str, torch.Tensor], watch: dict[str, torch.Tensor] | None = None):
    """``(outputs, lookups)``: every output tensor of module ``path`` on ``inputs``, and the rows of each
    lookup into ``watch``'s tables."""
    import contextlib

    module = model.get_submodule(path) if path else model
    watching = twin_runs._Lookups(watch) if watch else contextlib.nullcontext()
    with watching, torch.no_grad(), twin._quiet():
        torch.manual_seed(0)
        out = module(**inputs)
    return _tensors(out), (watching.seen if watch else {})


def _outermost(model, tables: list[str], config: dict) -> tuple[str, dict[str, torch.Tensor]]:
    """The outermost module around ``tables`` that runs on token ids alone (the whole model where it can;
    CLIPModel wants pixel values too: its text model), and its outputs on short inputs."""
    failures = []
    for path in twin_runs._paths_around(tables):
        module = model.get_submodule(path) if path else model
        if twin_runs.forward_inputs(model, module, torch.zeros((1, 5), dtype=torch.long)) is None:
            continue
        try:
            return path, _run(model, path, _stack_inputs(model, path, {}, config))[0]
        except Exception as exc:  # needs more than token ids: the next module inside
            failures.append(f"{path or type(model).__name__}: {twin._first_line(exc)}")
    raise AssertionError(f"no module around {tables[0]} runs on 5 tokens ({'; '.join(failures[-2:])})")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    """Bit-identical outputs, every tensor and its shape."""
    assert a.keys() == b.keys(), f"{what}: the outputs differ ({sorted(a.keys() ^ b.keys())[:3]})"
    for key, x in a.items():
        y = b[key]
        assert x.shape == y.shape, f"{what}: output {key} changed shape {list(x.shape)} -> {list(y.shape)}"
        assert torch.equal(x, y), f"{what}: output {key} changed (max diff {float((x - y).abs().max()):.3g})"


def check_written(src: Path, dst: Path, cls: type, spec, new: int) -> None:
    """Independent checks of a written checkpoint; raises AssertionError naming the first that fails.

    On the whole model (where it runs on token ids alone; else the outermost module around the tables
    that does), with every stack it has (encoder and decoder inputs):
    - loads cleanly (with the source's missing keys only: a head the file never held);
    - short inputs of every stack: every output tensor bit-identical to the source's, shapes included;
    - each stack that looks the resized tables up runs at the full new length (the others short), its
      lookups inside the tables and by position, its outputs finite;
    - the same stack at the source's full length: outputs bit-identical to the source's;
    - config and tokenizer state the new length.
    """
    loaded, source = _load_both(src, dst, cls)
    params = dict(loaded.named_parameters())
    tables = [t for t in spec.table_names(frozenset(params) | frozenset(dict(loaded.named_buffers())))
              if t in params]
    config = json.loads((dst / "config.json").read_text())
    watch = {t: params[t] for t in tables}
    path, before = _outermost(source, tables, config)
    where = path or cls.__name__
    # short inputs (stack i: 5 + i tokens): identical outputs
    short = _stack_inputs(loaded, path, {}, config)
    after, _ = _run(loaded, path, short, watch)
    _same(before, after, f"{where} on short inputs")
    old = spec.usable_from_config(json.loads((src / "config.json").read_text()))
    for stack in _stacks_using(loaded, path, config, watch, old):
        try:
            out, seen = _run(loaded, path, _stack_inputs(loaded, path, {stack: new}, config), watch)
        except Exception as exc:
            raise AssertionError(f"{where} fails with {stack} at the full new length {new} "
                                 f"({twin._first_line(exc)})") from None
        for name, looks in seen.items():
            for rows in looks:
                assert int(rows.max()) < params[name].shape[0], f"{name} looked up past its end"
                if len(rows) == new:
                    assert torch.equal(rows, torch.arange(rows[0], rows[0] + new)), f"{name} not looked up by position"
        main = next(iter(out.values()))
        assert not main.is_floating_point() or bool(main.isfinite().all()), \
            f"{where}: non-finite outputs with {stack} at the full new length {new}"
        try:  # the old full length: what the source computes
            before = _run(source, path, _stack_inputs(source, path, {stack: old}, config))[0]
        except Exception as exc:
            raise AssertionError(f"the source's {where} fails with {stack} at its stated length {old} "
                                 f"({twin._first_line(exc)})") from None
        _same(before, _run(loaded, path, _stack_inputs(loaded, path, {stack: old}, config))[0],
              f"{where} with {stack} at the old length {old}")
    assert spec.usable_from_config(config) == new, "config does not state the new length"
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    assert tok["model_max_length"] == new, "tokenizer model_max_length disagrees"


def _stacks_using(model, path: str, config: dict, watch: dict[str, torch.Tensor], old: int) -> list[str]:
    """The stacks (encoder, decoder inputs) of module ``path`` that look ``watch``'s tables up: with several, each
    alone at the source's full length ``old``, the others short, changes those lookups (LED pads its encoder's
    input to its attention window, so short lengths alone cannot tell); a stack that fails there reads another,
    shorter table. None found: every stack."""
    short = _stack_inputs(model, path, {}, config)
    stacks = _stacks(short)
    if len(stacks) < 2:
        return stacks

    def lengths(inputs: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        return {n: [len(rows) for rows in looks] for n, looks in _run(model, path, inputs, watch)[1].items()}

    before, users = lengths(short), []
    for stack in stacks:
        try:
            if lengths(_stack_inputs(model, path, {stack: old}, config)) != before:
                users.append(stack)
        except Exception:  # noqa: BLE001, S112  (beyond its own table: not one of these tables' stacks)
            continue
    return users or stacks


def _runs(model, config: dict) -> bool:
    """Whether the model's outermost module that takes token ids runs on 5 tokens."""
    ids = torch.full((1, 5), twin_runs.safe_token(config), dtype=torch.long)
    for name, module in model.named_modules():
        if name.count(".") > 1 or twin_runs.forward_inputs(model, module, ids) is None:
            continue
        try:
            twin_runs.forward_output(model, name, ids)
            return True
        except Exception:
            continue
    return False


def _tiny_twin(config: dict, cls: type):
    """(model, shrunk config): widths shrunk if that twin runs, else layers only; or the failure."""
    failure, first = "", None
    for widths in (True, False):
        small = configs.shrink(config, widths=widths)
        try:
            model = twin.build(small, cls=cls)
        except Exception as exc:
            failure = failure or (str(exc) if isinstance(exc, posextend.PosExtendError) else twin._first_line(exc))
            continue
        first = first or (model, small)
        if _runs(model, small):
            return model, small
    return first or failure


# How users hold a checkpoint of a family with a head: (a) headed, as save_pretrained writes the headed class;
# (b) bare base-model weights under the headed class's ``architectures`` (sentence-transformers, hub uploads);
# (c) bare weights under the base class's own ``architectures``.
LAYOUTS = ("headed", "bare", "bare-class")
OUTCOMES = ("verified", "refused", "silently-wrong", "error")  # of a layout


def census_one(model_type: str, workdir: Path, layouts: tuple[str, ...] = LAYOUTS) -> Result:
    """Resize a tiny twin of ``model_type`` saved in each of ``layouts`` and check it independently.

    ``outcome`` and ``reason`` are the headed layout's; ``layouts`` records every layout's outcome
    (the bare ones for a family whose headed class keeps its base model under a prefix).
    """
    start = time.perf_counter()
    result = Result(model_type, "")
    try:
        built = _build(model_type, result)
        if built is None:
            return result
        cls, model, small = built
        src = workdir / model_type / "headed"
        model.save_pretrained(src)
        try:
            specs = all_specs(json.loads((src / "config.json").read_text()))
        except posextend.PosExtendError as exc:
            kind = holds_table(small, cls)
            result.outcome = {"table": "refused-table", "grid": "grid"}.get(kind, "refused")
            if isinstance(exc, posextend.RunTimeGridError):
                result.outcome = "run-time-grid"
            result.reason = str(exc)
            return result
        # written image grids (ViT, CLIP's vision tower) are checked by tests/test_vision.py; probed ones here
        grids, specs = [s for s in specs if s.rank == 2], [s for s in specs if s.rank == 1]
        result.grids = [_grid_checked(src, cls, g) for g in grids if g.covered_by == "probed"]
        if not specs:
            result.outcome, result.reason = _grid_outcome(result.grids, grids)
            return result
        result.covered_by = specs[0].covered_by
        result.outcome, result.reason = _resize_and_check(src, cls, specs, small, result.groups)
        prefix = twin.base_prefix(small, cls)
        if result.outcome != "verified" or not prefix:  # the class is its own base: one layout
            return result
        base = twin.base_class(small)
        base = None if base is cls else base
        result.layouts["headed"] = {"outcome": result.outcome, "reason": ""}
        for layout in layouts:
            if layout == "bare" or (layout == "bare-class" and base is not None):
                result.layouts[layout] = _bare_layout(layout, src, cls, base, prefix, small, specs)
        return result
    except Exception as exc:  # a bug in the census or posextend itself
        result.outcome, result.reason = "error", "".join(traceback.format_exception_only(exc)).strip()[:300]
        return result
    finally:
        shutil.rmtree(workdir / model_type, ignore_errors=True)
        result.seconds = round(time.perf_counter() - start, 2)


def _build(model_type: str, result: Result) -> tuple[type, object, dict] | None:
    """(headed class, tiny twin, its config), or None with ``result`` saying why there is no twin."""
    try:
        config = default_config(model_type)
    except Exception as exc:  # transformers cannot make this type's default config
        result.outcome, result.reason = "no-twin", twin._first_line(exc)
        return None
    cls = _class_for(model_type, config)
    if cls is None:
        result.outcome, result.reason = "no-twin", "transformers has no model class for it"
        return None
    result.cls = cls.__name__
    config["architectures"] = [cls.__name__]
    built = _tiny_twin(capped(config), cls)
    if isinstance(built, str):
        result.outcome, result.reason = "no-twin", built
        return None
    return cls, *built


def _bare_layout(layout: str, headed: Path, cls: type, base: type | None, prefix: str, small: dict,
                 specs: list) -> dict:
    """Save the base model alone (``bare``: under the headed ``architectures``), resize and check it."""
    src = save_bare(layout, headed, cls, base, prefix, small)
    outcome, reason = _resize_and_check(src, base or cls, specs, small, [])
    return {"outcome": outcome, "reason": reason}


def save_layouts(model_type: str, workdir: Path, layouts: tuple[str, ...] = ("headed", "bare")) -> dict[str, tuple]:
    """A tiny twin of ``model_type`` saved in each of ``layouts`` its family has (``bare`` only where its headed
    class keeps a base model under a prefix): ``{layout: (folder, the class whose names the file holds)}``."""
    result = Result(model_type, "")
    built = _build(model_type, result)
    assert built is not None, result.reason
    cls, model, small = built
    headed = workdir / model_type / "headed"
    model.save_pretrained(headed)
    saved = {"headed": (headed, cls)}
    prefix = twin.base_prefix(small, cls)
    base = twin.base_class(small)
    base = None if base is cls else base
    for layout in layouts:
        if prefix and (layout == "bare" or (layout == "bare-class" and base is not None)):
            saved[layout] = (save_bare(layout, headed, cls, base, prefix, small), base or cls)
    return saved


def save_bare(layout: str, headed: Path, cls: type, base: type | None, prefix: str, small: dict) -> Path:
    """The base model alone, saved beside ``headed`` (``bare``: under the headed ``architectures``; ``bare-class``:
    its own). A family without a bare class in transformers (TrOCR) gets the headed file's tensors under
    ``prefix`` with the prefix cut, which its headed class loads (``from_pretrained`` adds it back).
    """
    src = headed.parent / layout
    if base is not None:
        twin.build(small, cls=base, seed=1).save_pretrained(src)
    else:
        from safetensors.torch import load_file, save_file

        shutil.copytree(headed, src)
        state = load_file(src / "model.safetensors")
        save_file({n.removeprefix(prefix + "."): t for n, t in state.items() if n.startswith(prefix + ".")},
                  src / "model.safetensors", metadata={"format": "pt"})
    if layout == "bare":  # what sentence-transformers and many hub uploads leave
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "architectures": [cls.__name__]}))
    return src


def _grid_outcome(checked: list[dict], grids: list) -> tuple[str, str]:
    """A vision model's outcome: ``grid-spec`` (a written grid), else its probed grids' worst outcome."""
    if not checked:
        return "grid-spec", f"image grid ({grids[0].model_type}): tests/test_vision.py"
    worst = next((g for g in checked if g["outcome"] != "grid-probed"), checked[0])
    return {"refused": "grid"}.get(worst["outcome"], worst["outcome"]), worst["reason"]


def _grid_checked(src: Path, cls: type, spec) -> dict:
    """Resize a probed grid to twice its patch grid and check it independently (:func:`check_grid_written`)."""
    config = json.loads((src / "config.json").read_text())
    (h, w), (ph, pw) = spec.grid.sizes(config)
    new = (2 * (h // ph) * ph, 2 * (w // pw) * pw)  # twice the patch grid (384 px of 14 px patches: 27 -> 54)
    out = {"group": spec.group, "tables": list(spec.tables), "prefix": spec.reserved_rows(config),
           "image": spec.grid.image_key, "reference": spec.grid.reference, "outcome": "grid-probed", "reason": ""}
    dst = src.parent / f"{src.name}-grid-{spec.group}"
    try:
        posextend.resize_checkpoint(src, dst, image_size=new, seed=0, table=spec.group)
    except posextend.PosExtendError as exc:
        out.update(outcome="refused", reason=str(exc))
        return out
    try:
        check_grid_written(src, dst, cls, spec, new)
    except Exception as exc:  # the worst outcome: written, then wrong
        out.update(outcome="silently-wrong", reason=twin._first_line(exc))
    return out


def check_grid_written(src: Path, dst: Path, cls: type, spec, size: tuple[int, int]) -> None:
    """Independent checks of a written image grid at ``size``: loads as cleanly as the source; the outermost
    module around the grid that takes pixels runs at ``size`` with finite outputs; where the grid was verified
    against the family's run-time path, it computes what the source computes with
    ``interpolate_pos_encoding=True`` at that size (within 1e-5); the config states the new grid."""
    loaded, source = _load_both(src, dst, cls)
    config = json.loads((dst / "config.json").read_text())
    assert spec.grid.grid(config) == tuple(n // p for n, p in zip(size, spec.grid.sizes(config)[1])), \
        "config does not state the new image size"
    tables = [t for t in spec.table_names(frozenset(dict(loaded.named_parameters())))]
    pixels = torch.randn(1, twin_runs.num_channels(config), *size, generator=torch.Generator().manual_seed(0))
    run_time = spec.grid.reference == "run-time"
    for path in twin_runs._paths_around(tables):
        module = loaded.get_submodule(path) if path else loaded
        if not twin_runs._accepts(module, "pixel_values") or (
                run_time and not twin_runs._accepts(module, "interpolate_pos_encoding")):
            continue
        try:
            after = _tensors(_forward(module, pixels))
        except Exception:  # needs more than pixels (a dual encoder's input_ids): the next module inside
            continue
        main = next(iter(after.values()))
        assert bool(main.isfinite().all()), f"{path or cls.__name__}: non-finite outputs at {size}"
        if run_time:
            before = _tensors(_forward(source.get_submodule(path) if path else source, pixels, interpolate=True))
            a, b = next(iter(before.values())), main
            assert a.shape == b.shape, f"{path or cls.__name__}: output {list(b.shape)}, run-time {list(a.shape)}"
            diff = float((a - b).abs().max())
            assert diff <= 1e-5, f"{path or cls.__name__}: {diff:.2g} from the run-time interpolation at {size}"
        return
    raise AssertionError(f"no module around {tables[0]} runs on pixels at {size}")


def _forward(module, pixels: torch.Tensor, *, interpolate: bool = False):
    torch.manual_seed(0)  # families that draw (ViT-MAE's patch order) draw the same
    with torch.no_grad():
        return module(pixel_values=pixels, **({"interpolate_pos_encoding": True} if interpolate else {}))


def _resize_and_check(src: Path, cls: type, specs: list, small: dict, groups: list[dict]) -> tuple[str, str]:
    """Resize each length of the checkpoint at ``src`` 2x with ``tile``, check each with ``cls`` (the class
    whose names the file holds); ``(outcome, reason)``."""
    for spec in specs:
        try:
            posextend.inspect_checkpoint(src)  # inspect works on every layout, or refuses with a reason
        except posextend.PosExtendError as exc:
            return "refused", f"inspect: {exc}"
        usable = spec.usable_from_config(json.loads((src / "config.json").read_text()))
        (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": usable}))
        new = 2 * usable
        dst = src.parent / f"{src.name}-{spec.group}"
        group = {"group": spec.group, "tables": list(spec.tables), "reserved": spec.reserved_rows(small),
                 "length": spec.length_keys[0], "usable": usable}
        groups.append(group)
        try:
            report = posextend.resize_checkpoint(src, dst, new, "tile", seed=0, verify=True,
                                                 table=spec.group if len(specs) > 1 else None)
        except posextend.PosExtendError as exc:
            return "refused", f"{spec.group}: {exc}"
        group["tables"] = report.tables
        try:
            check_written(src, dst, cls, spec, new)
        except Exception as exc:  # the worst outcome: written, then wrong
            return "silently-wrong", f"{spec.group}: {twin._first_line(exc)}"
    return "verified", ""


def run(types: list[str], *, progress: bool = False) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="posextend-census-") as tmp:
        results = []
        for i, mt in enumerate(types, 1):
            results.append(census_one(mt, Path(tmp)))
            if progress:
                r = results[-1]
                print(f"[{i}/{len(types)}] {mt}: {r.outcome} ({r.seconds}s) {r.reason[:160]}", file=sys.stderr, flush=True)
        return results


def markdown(results: list[Result]) -> str:
    """The families page for ``results``, rendered as ``scripts/gen_families_docs.py`` renders the record."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import gen_families_docs

    return gen_families_docs.render([asdict(r) for r in results], transformers.__version__)


def layout_counts(results: list[Result]) -> dict[str, dict[str, int]]:
    """``{layout: {outcome: families}}`` over the families checked in more than one layout."""
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        for layout, v in r.layouts.items():
            counts.setdefault(layout, {}).setdefault(v["outcome"], 0)
            counts[layout][v["outcome"]] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every registered one)")
    parser.add_argument("--out", type=Path, help="write the Markdown table here")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    results = run(args.types or model_types(), progress=True)
    if args.out:
        args.out.write_text(markdown(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    print(json.dumps(counts, sort_keys=True))
    print(json.dumps({"layouts": layout_counts(results)}, sort_keys=True))


if __name__ == "__main__":
    main()
