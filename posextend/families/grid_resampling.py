"""A family's own resampling of its grid, observed on tiny twins (for :mod:`posextend.families.grid_probe`).

Where the module around the table takes ``interpolate_pos_encoding``, a tiny twin's run-time output at new
sizes must equal (within :data:`TOLERANCE`) that of a twin whose table was resized by exactly one of
:data:`CANDIDATES`; a family without a run-time path must load and run with a resized table
(:class:`ResamplingProbe`). Relative-position tables that follow the grid's side (SAM's) are checked
against the family's run time too (:func:`check_relative`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posextend.errors import UnsupportedArchitectureError
from posextend.families import configs, twin, twin_runs
from posextend.families.grid_fields import STEP
from posextend.families.specs import BufferRule, same_form

if TYPE_CHECKING:
    import torch
    from torch import nn

    from posextend.families.grid_fields import FieldFacts

log = logging.getLogger(__name__)

TOLERANCE = 1e-5  # largest difference from the run-time interpolation a resized twin may show
# (strategy, antialias): the resamplings a family's run-time interpolation is checked against
CANDIDATES = (("bicubic", False), ("bicubic", True), ("bilinear", False), ("bilinear", True))


class ResamplingProbe:
    """The family's own resampling, observed: a tiny twin with distinct random rows, its run-time
    output at new sizes, and twins built at those sizes with the table resized by each candidate."""

    relative: tuple[str, ...] = ()  # relative-position companions, resized linearly with the grid's side
    follow: tuple[tuple[str, str], ...] = ()  # other config fields that follow the image (GridSpec.follow)

    def __init__(self, small: dict[str, Any], facts: FieldFacts, tables: list[str], prefix: int,
                 rules: list[tuple[str, str, int]], source: nn.Module):
        import torch

        self.small, self.cls, self.image_key, (self.size, self.patch) = small, facts.cls, facts.image_key, facts.sizes
        self.tables, self.prefix, self.rules, self.model_type = tables, prefix, rules, facts.model_type
        self.old_value = configs.get_path(small, facts.image_key)
        self.channels = twin_runs.num_channels(small)
        self.source = source
        params = dict(source.named_parameters())
        with torch.no_grad():  # some families start their table at zeros: make every row distinct
            gen = torch.Generator().manual_seed(0)
            for t in tables:
                params[t].copy_(torch.randn(params[t].shape, generator=gen))
        self.state = source.state_dict()
        self.built: dict[tuple[int, int], nn.Module] = {}

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        return size[0] // self.patch[0], size[1] // self.patch[1]

    def sizes(self, square: bool) -> list[tuple[int, int]]:
        """Larger, smaller (where the grid has room) and, unless square-only, a wider image."""
        (h, w), (ph, pw) = self.size, self.patch
        out = [(h + STEP * ph, w + STEP * pw)]
        if h // ph > STEP + 1 and w // pw > STEP + 1:
            out.append((h - STEP * ph, w - STEP * pw))
        if not square:
            out.append((h, w + STEP * pw))
        return out

    def resized(self, size: tuple[int, int], strategy: str, antialias: bool) -> nn.Module:
        """A twin built at ``size`` holding the source's weights, its tables resized by the candidate."""
        from posextend.tables.relative import resize_relative
        from posextend.tables.strategies import resize_grid

        model = self.built.get(size)
        if model is None:
            config = configs.set_path(self.small, self.image_key, same_form(self.old_value, size))
            for key, kind in self.follow:
                value = same_form(configs.get_path(config, key), size if kind == "image" else self.grid(size))
                config = configs.set_path(config, key, value)
            model = self.built[size] = twin.build(config, cls=self.cls)
        new_rows = self.prefix + self.grid(size)[0] * self.grid(size)[1]
        merged = {}
        for name, tensor in model.state_dict().items():
            old = self.state.get(name)
            rule = next((r for r in self.rules if r[0] == name), None)
            if name in self.tables:
                merged[name] = resize_grid(old, self.grid(self.size), self.grid(size), strategy, reserved=self.prefix,
                                           params={"antialias": antialias})
            elif name in self.relative:
                merged[name] = resize_relative(old, tensor.shape[0])
            elif rule is not None:
                merged[name] = BufferRule("", rule[1], rule[2]).rebuild(old, new_rows)
            else:
                merged[name] = old if old is not None and old.shape == tensor.shape else tensor
        model.load_state_dict(merged)
        return model

    def method(self, square: bool) -> tuple[str, bool, str, bool]:
        """``(strategy, antialias, reference, square)`` of the family, observed."""
        sizes = self.sizes(square)
        path = self._run_time_module(sizes[0])
        if path is None:
            return self._load_and_run(sizes, square)
        wide = None if square else sizes[-1]
        expected = {}
        for size in sizes:
            try:
                expected[size] = self._output(self.source, path, size, interpolate=True)
            except Exception as exc:  # its own run-time path fails at this size
                if size == wide:
                    square = True  # its run-time path handles square images only
                    continue
                raise UnsupportedArchitectureError(
                    f"{self.model_type}: its run-time interpolate_pos_encoding fails at {size[0]}x{size[1]} "
                    f"({twin._first_line(exc)}), so what a resized grid must compute is unknown."
                ) from None
        diffs: dict[tuple[str, bool], dict[tuple[int, int], float]] = {}
        outputs: dict[tuple[str, bool], dict[tuple[int, int], torch.Tensor]] = {}
        for candidate in CANDIDATES:
            diffs[candidate], outputs[candidate] = {}, {}
            for size, want in expected.items():
                try:
                    got = self._output(self.resized(size, *candidate), path, size, interpolate=False)
                except Exception as exc:  # a twin at the new size that does not run
                    raise UnsupportedArchitectureError(
                        f"{self.model_type}: a twin with its grid resized to {size[0]}x{size[1]} does not run "
                        f"({twin._first_line(exc)})."
                    ) from None
                outputs[candidate][size] = got
                diffs[candidate][size] = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
        square_sizes = [s for s in expected if s != wide]
        fits = [c for c in CANDIDATES if all(diffs[c][s] <= TOLERANCE for s in expected)]
        if not fits and wide in expected:  # it resamples square images the same way, non-square ones otherwise
            fits = [c for c in CANDIDATES if all(diffs[c][s] <= TOLERANCE for s in square_sizes)]
            square = square or bool(fits)
            expected.pop(wide)
        if not fits:
            best = min(CANDIDATES, key=lambda c: max(diffs[c].values()))
            raise UnsupportedArchitectureError(
                f"{self.model_type}: its run-time interpolation (interpolate_pos_encoding) is none of "
                f"{', '.join(_label(c) for c in CANDIDATES)} (nearest: {_label(best)}, off by up to "
                f"{max(diffs[best].values()):.2g} in the output); a resized table would not compute what it computes."
            )
        first = fits[0]
        for other in fits[1:]:
            if any(float((outputs[other][s] - outputs[first][s]).abs().max()) > TOLERANCE for s in expected):
                raise UnsupportedArchitectureError(
                    f"{self.model_type}: both {_label(first)} and {_label(other)} reproduce its run-time "
                    "interpolation but differ from each other; which one it does is ambiguous."
                )
        return first[0], first[1], "run-time", square

    def _load_and_run(self, sizes: list[tuple[int, int]], square: bool) -> tuple[str, bool, str, bool]:
        """No run-time path: a twin with its grid resized (bicubic) must load and run at each new size."""
        wide = None if square else sizes[-1]
        for size in sizes:
            try:
                twin_runs.run_pixels(self.resized(size, "bicubic", False), self.tables, size, self.channels)
            except Exception as exc:
                if size == wide:
                    square = True
                    continue
                raise UnsupportedArchitectureError(
                    f"{self.model_type}: a twin with its grid resized to {size[0]}x{size[1]} does not run "
                    f"({twin._first_line(exc) if not isinstance(exc, RuntimeError) else str(exc)[:300]})."
                ) from None
        return "bicubic", False, "load-and-run", square

    def _run_time_module(self, size: tuple[int, int]) -> str | None:
        """The outermost module around the tables that takes ``pixel_values`` and ``interpolate_pos_encoding``
        and runs on them alone at ``size``; None when none takes both."""
        offered = False
        for path in twin_runs._paths_around(self.tables):
            module = self.source.get_submodule(path) if path else self.source
            if not (twin_runs._accepts(module, "pixel_values") and twin_runs._accepts(module, "interpolate_pos_encoding")):
                continue
            offered = True
            try:
                self._output(self.source, path, size, interpolate=True)
            except Exception as exc:  # needs more than pixels (input_ids): the next module inside
                log.debug("%s: %s: %s", self.model_type, path, twin._first_line(exc))
                continue
            return path
        if offered:
            log.debug("%s: interpolate_pos_encoding is offered but no module runs on pixels alone", self.model_type)
        return None

    def _output(self, model: nn.Module, path: str, size: tuple[int, int], *, interpolate: bool) -> torch.Tensor:
        import torch

        module = model.get_submodule(path) if path else model
        pixels = torch.randn(1, self.channels, *size, generator=torch.Generator().manual_seed(1))
        kwargs = {"interpolate_pos_encoding": True} if interpolate else {}
        torch.manual_seed(0)  # families that draw (ViT-MAE's patch order) draw the same
        with torch.no_grad(), twin._quiet():
            out = module(pixel_values=pixels, **kwargs)
        return twin_runs.main_tensor(out)


def _label(candidate: tuple[str, bool]) -> str:
    return f"{candidate[0]}{' with antialias' if candidate[1] else ''}"


def check_relative(probe: ResamplingProbe, reference: str) -> str:
    """The relative tables' linear resizing, checked against the family's run time: at a larger size, a twin
    holding the source's relative tables as they are (resampled on every forward) must compute what one holding
    them resized computes, every hidden state within :data:`TOLERANCE`, where the tables move those states
    (zeroing them changes them by more than a thousand times that). Returns the reference the spec reports."""
    import torch

    if not probe.relative:
        raise UnsupportedArchitectureError(
            f"{probe.model_type}: relative-position tables follow its image size, but a tiny twin holds none of "
            "them, so their resizing cannot be checked against its run time.")
    with torch.no_grad():  # SAM starts them at zeros, its twin's layers near zero: make every weight count
        gen = torch.Generator().manual_seed(2)
        for name, param in probe.source.named_parameters():
            if name in probe.relative or (param.dim() > 1 and name not in probe.tables):
                scale = 1.0 if name in probe.relative else param[0].numel() ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    # the innermost module around the grid that takes pixels (SAM's vision encoder: its states, not the masks)
    path = next((p for p in reversed(twin_runs._paths_around(probe.tables))
                 if twin_runs._accepts(probe.source.get_submodule(p) if p else probe.source, "pixel_values")), "")
    size = probe.sizes(True)[0]  # the larger size (shrinking runs the same interpolation)
    model = probe.resized(size, "bicubic", False)
    got = _states(model, path, size, probe.channels)
    want = _with_tables(model, {n: probe.state[n] for n in probe.relative}, path, size, probe.channels)
    zeroed = _with_tables(model, {n: torch.zeros_like(probe.state[n]) for n in probe.relative}, path, size,
                          probe.channels)
    diff, moved = _largest_difference(got, want), _largest_difference(got, zeroed)
    if not diff <= TOLERANCE or not moved > 1e3 * TOLERANCE:
        raise UnsupportedArchitectureError(
            f"{probe.model_type}: its relative-position tables {', '.join(probe.relative[:2])} resized linearly "
            + (f"compute other values than its own run-time resampling at {size[0]}x{size[1]} (off by {diff:.2g})."
               if not diff <= TOLERANCE else f"do not move a tiny twin's states ({moved:.2g}), so whether they "
                                             "compute what its run-time resampling does is not observed."))
    return f"{reference}; relative tables: run-time"


def _with_tables(model: nn.Module, tables: Mapping[str, torch.Tensor], path: str, size: tuple[int, int],
                 channels: int) -> list[torch.Tensor]:
    """:func:`_states` of ``model`` holding ``tables`` (any shape) in place of its own, which are put back."""
    import torch

    kept = {}
    for name, value in tables.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        kept[name] = getattr(module, attr)
        setattr(module, attr, torch.nn.Parameter(value.clone()))
    try:
        return _states(model, path, size, channels)
    finally:
        for name, value in kept.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, value)


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(float((x - y).abs().max()) if x.shape == y.shape else float("inf") for x, y in zip(a, b))


def _states(model: nn.Module, path: str, size: tuple[int, int], channels: int) -> list[torch.Tensor]:
    """The main output and every hidden state of ``model``'s module ``path`` on one random image of ``size``."""
    import torch

    module = model.get_submodule(path) if path else model
    pixels = torch.randn(1, channels, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), twin._quiet():
        try:
            out = module(pixel_values=pixels, output_hidden_states=True)
        except TypeError:  # a forward without the option
            out = module(pixel_values=pixels)
    return [twin_runs.main_tensor(out), *(getattr(out, "hidden_states", None) or ())]

