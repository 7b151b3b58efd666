"""Running twins: forward passes on tokens, images and patch sequences, and the table rows a forward looks up.

:func:`tiny_lookups` builds a tiny twin (:mod:`posextend.families.twin`) and records which rows of its position
tables a forward on token ids uses; :func:`run_pixels` and :func:`run_patches` feed a model one random image as
pixels or as a patch sequence with its grid; the token helpers give ids that are no special token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posextend.errors import UnsupportedArchitectureError
from posextend.families.configs import pair, shrink, sub_configs, token_ids
from posextend.families.twin import _first_line, _quiet, build

if TYPE_CHECKING:
    import torch
    from torch import nn

def tiny_lookups(
    config: Mapping[str, Any], cls: type | None, tables: list[str], length: int, *, whole: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`run_lookups` on a tiny CPU twin: widths shrunk if such a twin runs, else layers only.
    ``whole``: :func:`run_whole` instead (the module that runs on a few tokens, at ``length``).

    Returns the rows used and the shrunk config. Raises ``RuntimeError`` naming the failures.
    """
    failures = []
    for widths in (True, False):
        small = shrink(config, widths=widths)
        try:
            model = build(small, cls=cls)
        except UnsupportedArchitectureError:
            raise
        except Exception as exc:  # a foreign constructor: try a milder shrink
            failures.append(f"building: {_first_line(exc)}")
            continue
        try:
            return (run_whole if whole else run_lookups)(model, tables, length, token=safe_token(small))[0], small
        except RuntimeError as exc:
            failures.append(str(exc))
    raise RuntimeError(failures[-1] if failures else "no twin")


# ----------------------------------------------------------------------------- watching lookups


class _Lookups:
    """Records the rows every ``F.embedding`` / ``weight[...]`` lookup into given tensors uses
    (the first sequence of each lookup: ``index[0, :]`` of a batch)."""

    def __init__(self, tables: Mapping[str, torch.Tensor]):
        from torch.overrides import TorchFunctionMode

        self.tables = dict(tables)
        self.seen: dict[str, list[torch.Tensor]] = {n: [] for n in tables}
        owner = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                owner._record(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _record(self, func, args, kwargs) -> None:
        import torch
        import torch.nn.functional as F

        if func is F.embedding and len(args) >= 1:
            index, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        elif func is torch.Tensor.__getitem__ and len(args) == 2:
            weight, index = args
            if isinstance(index, tuple) and index:
                index = index[0]
            if isinstance(index, slice):
                rows = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() else 0
                index = torch.arange(rows)[index]
        else:
            return
        for name, table in self.tables.items():
            if weight is table and isinstance(index, torch.Tensor) and index.dim() >= 1:
                self.seen[name].append(index.detach().reshape(-1, index.shape[-1])[0].cpu().clone())

    def __enter__(self) -> _Lookups:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_inputs(model: nn.Module, module: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Keyword arguments that run ``module`` (a part of ``model``) on token ``ids``; None if it takes none."""
    import torch

    key = next((k for k in ("input_ids", "inputs") if _accepts(module, k)), None)  # Perceiver: inputs
    if key is None:
        return None
    kwargs = {key: ids}
    if _accepts(module, "decoder_input_ids") and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    if _accepts(module, "bbox"):  # layout models: one box per token
        kwargs["bbox"] = torch.zeros((*ids.shape, 4), dtype=torch.long)
    return kwargs


def forward_output(model: nn.Module, path: str, ids: torch.Tensor) -> torch.Tensor:
    """The main output tensor (logits, last hidden state) of module ``path`` of ``model`` on ``ids``."""
    import torch

    module = model.get_submodule(path) if path and path != type(model).__name__ else model
    with torch.no_grad(), _quiet():
        out = module(**forward_inputs(model, module, ids))
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return next(v for v in (out.values() if hasattr(out, "values") else out) if isinstance(v, torch.Tensor))


def run_lookups(
    model: nn.Module, tables: list[str], length: int, *, token: int,
) -> tuple[dict[str, torch.Tensor], str]:
    """Run the outermost module around ``tables`` that takes token ids on ``length`` tokens.

    Only tables that are parameters are watched (a companion buffer such as I-BERT's
    ``weight_integer`` follows its table but is not looked up). Returns the rows each table's lookups
    used (for the first sequence; every lookup of the forward, concatenated, the first one first) and
    the name of the module that ran. Every token is ``token`` (never the padding id).
    Raises ``RuntimeError`` with the last failure when no module on the way runs.
    """
    import torch

    learned = dict(model.named_parameters())
    watched = {n: learned[n] for n in tables if n in learned}  # companion buffers are not looked up
    if not watched:
        raise RuntimeError(f"none of {', '.join(tables)} is a learned parameter of {type(model).__name__}")
    tables = list(watched)
    ids = torch.full((1, length), token, dtype=torch.long)
    failures = []
    for path in _paths_around(tables):
        module = model.get_submodule(path) if path else model
        kwargs = forward_inputs(model, module, ids)
        if kwargs is None:
            continue
        with _Lookups(watched) as seen, torch.no_grad(), _quiet():
            try:
                module(**kwargs)
            except Exception as exc:  # a foreign forward: try the next module inside
                failures.append(f"{path or type(model).__name__}: {_first_line(exc)}")
                continue
        if any(seen.seen[n] for n in tables):  # a table may also be used whole (Perceiver's output queries)
            # every lookup, the first one first: a second one (ProphetNet's predicting stream reads
            # position + 1) can reach rows past the positions
            return {n: torch.cat(seen.seen[n]) for n in tables if seen.seen[n]}, path or type(model).__name__
        failures.append(f"{path or type(model).__name__}: ran without looking up {', '.join(tables)}")
    raise RuntimeError("; ".join(failures[-3:]) or "no module around the table takes input_ids")


def run_whole(
    model: nn.Module, tables: list[str], length: int, *, token: int, short: int = 5,
) -> tuple[dict[str, torch.Tensor], str]:
    """:func:`run_lookups` at ``length`` on the module that runs on ``short`` tokens, no module inside
    it standing in for it: each of its token inputs (encoder, decoder) that looks ``tables`` up gets
    ``length`` tokens, the others ``short``, so that each stack stays within its own table (see
    :func:`_users`). Raises ``RuntimeError`` when that module fails.
    """
    import torch

    _, name = run_lookups(model, tables, short, token=token)
    path = name if name in dict(model.named_modules()) else ""
    module = model.get_submodule(path) if path else model
    learned = dict(model.named_parameters())
    watched = {n: learned[n] for n in tables if n in learned}
    base = forward_inputs(model, module, torch.full((1, short), token, dtype=torch.long)) or {}
    stacks = [k for k, v in base.items() if k != "bbox" and v.dtype == torch.long and v.dim() == 2]

    def run(lengths: dict[str, int]) -> dict[str, list[torch.Tensor]]:
        kwargs = {k: torch.full((1, lengths.get(k, short)), token, dtype=torch.long) if k in stacks else v
                  for k, v in base.items()}
        if "bbox" in kwargs:
            kwargs["bbox"] = torch.zeros((*kwargs[stacks[0]].shape, 4), dtype=torch.long)
        with _Lookups(watched) as seen, torch.no_grad(), _quiet():
            module(**kwargs)
        return seen.seen

    users, seen = _users(run, stacks, length, short, name)
    if seen is None:
        try:
            seen = run({k: length for k in users})
        except Exception as exc:
            raise RuntimeError(f"{name} with {', '.join(users)} of {length} tokens: {_first_line(exc)}") from None
    return {n: torch.cat(seen[n]) for n in watched if seen[n]}, name


def _users(
    run: Callable[[dict[str, int]], dict[str, list[torch.Tensor]]], stacks: list[str], length: int, short: int,
    name: str,
) -> tuple[list[str], dict[str, list[torch.Tensor]] | None]:
    """The token inputs of ``stacks`` that look the watched tables up, and the lookups of the one that does
    at ``length`` (None: not run yet, or several do).

    With one input, it. With several (an encoder's and a decoder's, each with a table and a length of its
    own), each runs alone at ``length``, the others at ``short``: it uses the tables when their lookups then
    change. One that fails there uses them only where short inputs of distinct lengths say so (LED pads its
    encoder's, so lengths alone cannot tell): else its failure is another stack's shorter table, not these.
    Raises ``RuntimeError`` naming each failure when every input fails at ``length``.
    """
    if len(stacks) < 2:
        return stacks, None

    def lengths(seen: dict[str, list[torch.Tensor]]) -> dict[str, list[int]]:
        return {n: [len(rows) for rows in looks] for n, looks in seen.items()}

    before = lengths(run({}))
    try:  # short inputs of distinct lengths: the lookups' lengths name the inputs they follow
        told = {stacks[len(rows) - short] for looks in run({k: short + i for i, k in enumerate(stacks)}).values()
                for rows in looks if 0 <= len(rows) - short < len(stacks)}
    except Exception:  # noqa: BLE001  (a forward that wants its inputs of one length: each input's own run decides)
        told = set()
    found: dict[str, dict[str, list[torch.Tensor]] | None] = {}
    failures = []
    for stack in stacks:
        try:
            seen = run({stack: length})
        except Exception as exc:  # noqa: BLE001  (a foreign forward's failure, any type, is what is reported)
            failures.append(f"{stack} of {length} tokens: {_first_line(exc)}")
            if stack in told:
                found[stack] = None  # it uses the tables and fails: the run of every user says so
            continue
        if lengths(seen) != before:
            found[stack] = seen
    if not found and failures:
        raise RuntimeError(f"{name} with " + "; with ".join(failures))
    users = list(found) or stacks  # no input moves the lookups (a table used whole): every input at length
    return users, found[users[0]] if len(users) == 1 and users[0] in found else None


def num_channels(config: Mapping[str, Any]) -> int:
    """The image channels a vision model (or tower) takes: its config's ``num_channels``, else 3."""
    return next((v for _, sub in sub_configs(config) if isinstance(v := sub.get("num_channels"), int)), 3)


def run_pixels(model: nn.Module, tables: list[str], size: tuple[int, int], channels: int = 3,
               *, resampling: bool = False) -> torch.Tensor:
    """Run the outermost module around ``tables`` that takes ``pixel_values`` on one random image
    of ``size`` (height, width); return its main output.

    Raises ``RuntimeError`` when no module on the way runs, or when the one that runs resamples
    anything to another size (``F.interpolate``; DPT's call on every forward keeps the size): at
    its own image size a model must use its table as it is. ``resampling=True``: that is allowed
    (an image of another size).
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Resampling(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is F.interpolate and out.shape[-2:] != (args[0] if args else kwargs["input"]).shape[-2:]:
                Resampling.calls += 1
            return out

    pixels = torch.randn(1, channels, *size, generator=torch.Generator().manual_seed(0))
    failures = []
    for path in _paths_around(tables):
        module = model.get_submodule(path) if path else model
        if not _accepts(module, "pixel_values"):
            continue
        Resampling.calls = 0  # only what the module that runs does counts
        try:
            with Resampling(), torch.no_grad(), _quiet():
                out = module(pixel_values=pixels)
        except Exception as exc:  # a foreign forward (CLIPModel wants input_ids too): try the next module inside
            failures.append(f"{path or type(model).__name__}: {_first_line(exc)}")
            continue
        if Resampling.calls and not resampling:
            raise RuntimeError(f"{path or type(model).__name__} resamples its positions at its own image size")
        return main_tensor(out)
    raise RuntimeError("; ".join(failures[-3:]) or "no module around the table takes pixel_values")


# ----------------------------------------------------------------------------- patch sequences

# What a tower's forward takes for an image of ``(h, w)`` patches, by parameter name: its grid as
# ``[[t, h, w]]`` (Qwen-VL's grid_thw) or ``[[h, w]]``, and companions of the patch sequence.
_GRID_THW = ("grid_thw", "image_grid_thw")
_GRID_HW = ("image_grid_hw", "spatial_shapes", "target_sizes")
# Config keys of one fact each: the pixels in a patch, its channels, frames per patch, patches merged a side.
_PATCH_KEYS = ("patch_size",)
_CHANNEL_KEYS = ("num_channels", "in_channels", "in_chans")
_TEMPORAL_KEYS = ("temporal_patch_size", "patch_temporal")
_MERGE_KEYS = ("spatial_merge_size", "merge_size", "merge_kernel_size")
# How the patches of an image are laid out, as families take them: the shape for ``n`` patches of
# ``c`` channels, ``t`` frames, ``p x q`` pixels, merged ``m`` a side; ``merged``: the grid counts merged tokens.
PATCH_LAYOUTS = {
    "flat": (lambda n, c, t, p, q, m: (n, c * t * p * q), False),  # Qwen-VL, GLM-4V: [patches, c*t*p*q]
    "sequence": (lambda n, c, t, p, q, m: (1, n, c, p, q), False),  # PaddleOCR-VL: [1, patches, c, p, q]
    "strip": (lambda n, c, t, p, q, m: (1, c, p, n * q), False),  # MiniCPM-V: patches side by side
    "patches": (lambda n, c, t, p, q, m: (n, c, p, q), False),  # Kimi: [patches, c, p, q]
    "tokens": (lambda n, c, t, p, q, m: (1, n, c * p * q), False),  # SigLIP2 (NaFlex): [1, patches, c*p*q]
    "merged": (lambda n, c, t, p, q, m: (n // (m * m), m * p, m * q, c), True),  # one crop per merged token
}


def _config_value(config: Any, keys: tuple[str, ...], default: Any) -> Any:
    """The first of ``keys`` a config object holds (not None), else ``default``."""
    return next((v for k in keys if (v := getattr(config, k, None)) is not None), default)


def patch_inputs(module: nn.Module, config: Any, grid: tuple[int, int], layout: str) -> dict[str, Any] | None:
    """Keyword arguments that give ``module`` one random image of ``grid`` patches as a patch sequence in
    ``layout`` (see :data:`PATCH_LAYOUTS`) with its grid; None when its forward takes no grid."""
    import torch

    params = inspect.signature(module.forward).parameters
    if not any(k in params for k in (*_GRID_THW, *_GRID_HW, "pixel_position_ids")):
        return None
    p, q = pair(_config_value(config, _PATCH_KEYS, 14))
    merge = pair(_config_value(config, _MERGE_KEYS, 1))[0]
    shape, merged = PATCH_LAYOUTS[layout]
    n = grid[0] * grid[1]
    channels, frames = _config_value(config, _CHANNEL_KEYS, 3), _config_value(config, _TEMPORAL_KEYS, 1)
    pixels = torch.randn(*shape(n, channels, frames, p, q, merge), generator=torch.Generator().manual_seed(0))
    h, w = (grid[0] // merge, grid[1] // merge) if merged else grid
    first = next(iter(params))
    kwargs: dict[str, Any] = {"pixel_values" if "pixel_values" in params else first: pixels}
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    companions = {
        **{k: torch.tensor([[1, h, w]]) for k in _GRID_THW}, **{k: torch.tensor([[h, w]]) for k in _GRID_HW},
        "pixel_attention_mask": torch.ones(1, n, dtype=torch.bool),
        "pixel_position_ids": torch.stack([cols.flatten(), rows.flatten()], -1)[None],  # (x, y) of each patch
        "padding_positions": torch.zeros(1, n, dtype=torch.bool),
    }
    kwargs.update({k: v for k, v in companions.items() if k in params})
    return kwargs


def _config_around(model: nn.Module, path: str) -> Any:
    """The config of the innermost module on ``path`` that holds one (the model's, at least)."""
    parts = path.split(".") if path else []
    for i in range(len(parts), 0, -1):
        config = getattr(model.get_submodule(".".join(parts[:i])), "config", None)
        if config is not None and not isinstance(config, Mapping):
            return config
    return model.config


def run_patches(model: nn.Module, tables: list[str], grid: tuple[int, int],
                where: tuple[str, str] | None = None) -> tuple[torch.Tensor, tuple[str, str]]:
    """Run the outermost module around ``tables`` whose forward takes a patch sequence and its grid
    (Qwen-VL's ``grid_thw``, SigLIP2's ``spatial_shapes`` ...) on one random image of ``grid`` patches, in
    the first of :data:`PATCH_LAYOUTS` it runs on; ``where``: that ``(module, layout)`` only.

    Returns the main output and ``(module, layout)``. Raises ``RuntimeError`` when none runs.
    """
    import torch

    failures = []
    for path in [where[0]] if where else _paths_around(tables):
        module = model.get_submodule(path) if path else model
        for layout in [where[1]] if where else PATCH_LAYOUTS:
            kwargs = patch_inputs(module, _config_around(model, path), grid, layout)
            if kwargs is None:
                break
            try:
                with torch.no_grad(), _quiet():
                    out = module(**kwargs)
            except Exception as exc:  # another layout, or a module that needs more (input_ids): try the next
                failures.append(f"{path or type(model).__name__} ({layout}): {_first_line(exc)}")
                continue
            return main_tensor(out), (path, layout)
    raise RuntimeError("; ".join(failures[-3:]) or "no module around the table takes a patch grid")


def main_tensor(out: Any) -> torch.Tensor:
    """The main tensor of a forward's output: itself, its last hidden state, logits or image embeddings, else
    the first tensor (FLAVA); of a tuple of tensors (MGP-STR's logits, one per head), the first."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    named = [getattr(out, k, None) for k in ("last_hidden_state", "logits", "image_embeds")]
    values = [v[0] if isinstance(v, (tuple, list)) and v else v
              for v in [*named, *(out.values() if hasattr(out, "values") else out)]]
    return next(v for v in values if isinstance(v, torch.Tensor))


def _paths_around(tables: list[str]) -> list[str]:
    """The modules around ``tables``, outermost first (``""`` is the model)."""
    paths = {""}
    for name in tables:
        parts = name.split(".")[:-1]
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(paths, key=lambda p: (p.count(".") + bool(p), p))


def _plain_tokens(config: Mapping[str, Any]) -> list[int]:
    """Token ids every tower's vocabulary holds that are no special token (never the padding id)."""
    sizes = [v for _, sub in sub_configs(config) if isinstance(v := sub.get("vocab_size"), int) and v >= 1]
    special = {i for _, sub in sub_configs(config) for i in token_ids(sub)}
    return [t for t in range(min(min(sizes, default=100), 1000) - 1, -1, -1) if t not in special] or [0]


def safe_token(config: Mapping[str, Any]) -> int:
    """A token id every tower's vocabulary holds that is no special token (never the padding id)."""
    return _plain_tokens(config)[0]


def random_tokens(config: Mapping[str, Any], length: int, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` random plain token ids (see :func:`safe_token`), the same for a seed."""
    import torch

    plain = torch.tensor(_plain_tokens(config))
    return plain[torch.randint(len(plain), (1, length), generator=torch.Generator().manual_seed(seed))]
