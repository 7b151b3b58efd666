"""The census: every model type the installed transformers registers, resized or refused.

For each type: a tiny twin is built from its default config (widths and layers shrunk,
lengths capped at 64 so forwards are quick) and saved with a tokenizer config; posextend
resizes each of its position lengths 2x with ``tile``; the result is checked *independently*
of posextend's own verification: clean ``from_pretrained``, a forward at the full new length,
outputs on a short input bit-identical to the source's, and the tokenizer and config agreeing.

Outcomes:
- ``verified``: resized and every check passed;
- ``refused``: a PosExtendError with a reason, and the twin holds no learned 1-D table;
- ``refused-table``: refused although the twin holds a 1-D position-named table;
- ``grid``: refused; the twin holds a 2-D image-patch grid that no written grid spec covers;
- ``run-time-grid``: refused with the reason: the family resamples its grid to each image on
  every forward (YOLOS, SigLIP2), so there is nothing on disk to resize;
- ``grid-spec``: a 2-D image-patch grid with a written spec (``--image-size``), checked by
  tests/test_vision.py against transformers' run-time interpolation, not walked here;
- ``silently-wrong``: written, then a check failed (must never happen);
- ``no-twin``: transformers itself cannot build the type from its default config.

Run ``python tests/census.py --out docs/families.md`` to regenerate the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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
from posextend import twin  # noqa: E402
from posextend.lookup import all_specs  # noqa: E402
from posextend.probe import length_fields  # noqa: E402
from posextend.specs import RUN_TIME_GRIDS  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")
LENGTH_CAP = 64


@dataclass
class Result:
    model_type: str
    outcome: str
    cls: str = ""
    covered_by: str = ""
    groups: list[dict] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0


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
    out = config
    for path in length_fields(config):
        if twin.get_path(out, path) > LENGTH_CAP:
            out = twin.set_path(out, path, LENGTH_CAP)
    return out


def holds_table(config: dict, cls: type) -> str:
    """'grid', 'table' or '' from the twin's parameter shapes (for classifying refusals only).

    'grid': a position-named parameter whose rows (less 0-5 prefix tokens) are a square, in a
    model whose config has a patch size. 'table': a 2-D position-named parameter with as many
    rows as a length field says (or 2 more).
    """
    try:
        model = twin.build(config, device="meta", cls=cls)
    except Exception:
        return ""
    lengths = {twin.get_path(config, f) for f in length_fields(config)}
    patches = any("patch_size" in sub for _, sub in twin.sub_configs(config))
    kind = ""
    for name, p in model.named_parameters():
        if "pos" not in name.lower() and not name.endswith("wpe.weight"):
            continue
        shape = tuple(p.shape)
        rows = shape[-2] if len(shape) >= 2 else 0
        if patches and rows > 4 and any(math.isqrt(rows - k) ** 2 == rows - k for k in (0, 1, 2, 5)):
            kind = "grid"
        elif len(shape) == 2 and rows in {v + k for v in lengths for k in (0, 2)}:
            return "table"
    return kind


def check_written(src: Path, dst: Path, cls: type, spec, new: int) -> None:
    """Independent checks of a written checkpoint; raises AssertionError naming the first that fails."""
    loaded, info = cls.from_pretrained(dst, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"from_pretrained is not clean: {problems}"
    loaded = loaded.float().eval()
    source = cls.from_pretrained(src).float().eval()
    params = dict(loaded.named_parameters())
    tables = [t for t in spec.table_names(frozenset(params) | frozenset(dict(loaded.named_buffers())))
              if t in params]
    token = twin.safe_token(json.loads((dst / "config.json").read_text()))
    used, path = twin.run_lookups(loaded, tables, new, token=token)  # full new length
    for name, rows in used.items():
        assert int(rows.max()) < params[name].shape[0], f"{name} looked up past its end"
        assert torch.equal(rows[:new], torch.arange(rows[0], rows[0] + new)), f"{name} not looked up by position"
    short = torch.full((1, 5), token, dtype=torch.long)
    torch.manual_seed(0)
    a = twin.forward_output(source, path, short)
    torch.manual_seed(0)
    b = twin.forward_output(loaded, path, short)
    if a.dim() > 1 and a.shape[0] == b.shape[0] and a.shape[2:] == b.shape[2:]:  # outputs as long as the table
        n = min(a.shape[1], b.shape[1])  # (Perceiver's decoder queries): compare the positions both have
        a, b = a[:, :n], b[:, :n]
    assert torch.equal(a, b), f"tile changed outputs on a short input (max diff {float((a - b).abs().max()):.3g})"
    cfg = json.loads((dst / "config.json").read_text())
    assert spec.usable_from_config(cfg) == new, "config does not state the new length"
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    assert tok["model_max_length"] == new, "tokenizer model_max_length disagrees"


def _runs(model, config: dict) -> bool:
    """Whether the model's outermost module that takes token ids runs on 5 tokens."""
    ids = torch.full((1, 5), twin.safe_token(config), dtype=torch.long)
    for name, module in model.named_modules():
        if name.count(".") > 1 or twin.forward_inputs(model, module, ids) is None:
            continue
        try:
            twin.forward_output(model, name, ids)
            return True
        except Exception:
            continue
    return False


def _tiny_twin(config: dict, cls: type):
    """(model, shrunk config): widths shrunk if that twin runs, else layers only; or the failure."""
    failure, first = "", None
    for widths in (True, False):
        small = twin.shrink(config, widths=widths)
        try:
            model = twin.build(small, cls=cls)
        except Exception as exc:
            failure = failure or (str(exc) if isinstance(exc, posextend.PosExtendError) else twin._first_line(exc))
            continue
        first = first or (model, small)
        if _runs(model, small):
            return model, small
    return first or failure


def census_one(model_type: str, workdir: Path) -> Result:
    start = time.perf_counter()
    result = Result(model_type, "")
    try:
        try:
            config = default_config(model_type)
        except Exception as exc:  # transformers cannot make this type's default config
            result.outcome, result.reason = "no-twin", twin._first_line(exc)
            return result
        cls = _class_for(model_type, config)
        if cls is None:
            result.outcome, result.reason = "no-twin", "transformers has no model class for it"
            return result
        result.cls = cls.__name__
        config["architectures"] = [cls.__name__]
        config = capped(config)
        built = _tiny_twin(config, cls)
        if isinstance(built, str):
            result.outcome, result.reason = "no-twin", built
            return result
        model, small = built
        src = workdir / model_type / "src"
        model.save_pretrained(src)
        try:
            specs = all_specs(json.loads((src / "config.json").read_text()))
        except posextend.PosExtendError as exc:
            kind = holds_table(small, cls)
            result.outcome = {"table": "refused-table", "grid": "grid"}.get(kind, "refused")
            if model_type in RUN_TIME_GRIDS:
                result.outcome = "run-time-grid"
            result.reason = str(exc)
            return result
        # image grids (ViT, CLIP's vision tower) are checked by tests/test_vision.py, not walked here yet
        grids, specs = [s for s in specs if s.rank == 2], [s for s in specs if s.rank == 1]
        if not specs:
            result.outcome, result.reason = "grid-spec", f"image grid ({grids[0].model_type}): tests/test_vision.py"
            return result
        result.covered_by = specs[0].covered_by
        for spec in specs:
            info = posextend.inspect_checkpoint(src) if len(specs) == 1 else None
            usable = spec.usable_from_config(json.loads((src / "config.json").read_text()))
            (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": usable}))
            new = 2 * usable
            dst = workdir / model_type / f"dst-{spec.group}"
            group = {"group": spec.group, "tables": list(spec.tables), "reserved": spec.reserved_rows(small),
                     "length": spec.length_keys[0], "usable": usable}
            result.groups.append(group)
            try:
                report = posextend.resize_checkpoint(src, dst, new, "tile", seed=0, verify=True,
                                                     table=spec.group if len(specs) > 1 else None)
            except posextend.PosExtendError as exc:
                result.outcome, result.reason = "refused", f"{spec.group}: {exc}"
                return result
            group["tables"] = report.tables
            try:
                check_written(src, dst, cls, spec, new)
            except Exception as exc:  # the worst outcome: written, then wrong
                result.outcome, result.reason = "silently-wrong", f"{spec.group}: {twin._first_line(exc)}"
                return result
            del info
        result.outcome = "verified"
        return result
    except Exception as exc:  # a bug in the census or posextend itself
        result.outcome, result.reason = "error", "".join(traceback.format_exception_only(exc)).strip()[:300]
        return result
    finally:
        shutil.rmtree(workdir / model_type, ignore_errors=True)
        result.seconds = round(time.perf_counter() - start, 2)


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
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lines = [
        "# Model families: how posextend covers each",
        "",
        f"Generated by `python tests/census.py --out docs/families.md` with transformers {transformers.__version__} "
        f"({len(results)} model types). Each type's tiny twin (its default config, widths shrunk, lengths capped at "
        f"{LENGTH_CAP}) is resized 2x with `tile` and checked: clean `from_pretrained`, a forward at the full new "
        "length, outputs on a short input bit-identical, tokenizer and config agreeing.",
        "",
        "| outcome | types |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(counts.items())),
        "",
        "- **spec**: a written spec in `posextend/specs.py`; **probed**: observed on a twin of the model's own config.",
        "- **refused**: no learned absolute 1-D table (rotary, relative, sinusoidal, none), with the reason.",
        "- **grid**: a 2-D image-patch grid (ViT and relatives) without a written grid spec: refused.",
        "- **run-time-grid**: a 2-D grid the family resamples to each image on every forward: refused, with "
        "what to do instead.",
        "- **grid-spec**: a 2-D image-patch grid resized with `--image-size` by a written spec, checked by "
        "`tests/test_vision.py` (the same outputs as transformers' run-time `interpolate_pos_encoding`).",
        "",
        "| model type | outcome | covered by | class | tables (group: reserved rows, length field) | reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        tables = "<br>".join(f"{g['group']}: `{', '.join(g['tables'])}` ({g['reserved']}, `{g['length']}`)"
                             for g in r.groups)
        reason = re.sub(r"\s+", " ", r.reason.replace("|", "\\|"))[:220]
        lines.append(f"| `{r.model_type}` | {r.outcome} | {r.covered_by} | {r.cls} | {tables} | {reason} |")
    return "\n".join(lines) + "\n"


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


if __name__ == "__main__":
    main()
