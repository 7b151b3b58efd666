from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

import posextend
from posextend.cli import app
from posextend.tables import strategies as S
from posextend.errors import StrategyError

OLD, DIM = 37, 16


@pytest.fixture
def table() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(OLD, DIM) * 0.05


ONE_D = [n for n, s in posextend.available_strategies().items() if 1 in s.ranks]
TWO_D = [n for n, s in posextend.available_strategies().items() if 2 in s.ranks]
GRID = (5, 7)  # usable rows of a 2-D table: 5 x 7 patches after prefix tokens


def test_every_strategy_declares_its_ranks():
    assert set(ONE_D) | set(TWO_D) == set(posextend.available_strategies())
    assert {"tile", "interpolate", "random", "kps"} <= set(ONE_D) and {"bicubic", "bilinear", "nearest"} <= set(TWO_D)


@pytest.mark.parametrize("name", ONE_D)
@pytest.mark.parametrize("new_len", [OLD, 50, 4 * OLD, 150, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_contract_every_strategy(name, new_len, dtype, table):
    """Shape, dtype, finiteness, determinism for a seed, kept rows where promised, input untouched."""
    strat = posextend.get_strategy(name)
    t = table.to(dtype)
    before = t.clone()
    a = S.resize_table(t, new_len, name, seed=3)
    b = S.resize_table(t, new_len, name, seed=3)
    assert a.shape == (new_len, DIM) and a.dtype == dtype
    assert torch.isfinite(a.float()).all()
    assert torch.equal(a, b), "same seed must give the same table"
    assert torch.equal(t, before), "the input table must not be modified"
    keep = min(OLD, new_len)
    if strat.keeps_rows:
        assert torch.equal(a[:keep], t[:keep]), "promised to keep the old rows bit-exact"
    # the first row is kept by every built-in strategy
    assert torch.equal(a[0], t[0])


@pytest.mark.parametrize("name", TWO_D)
@pytest.mark.parametrize("new_grid", [GRID, (10, 14), (9, 4), (3, 3), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stored", ["rows", "parameter"])  # [rows, D] (CLIP) or [1, rows, D] (ViT)
def test_contract_every_grid_strategy(name, new_grid, dtype, stored, table):
    """The 2-D contract: shape (prefix + H'W' rows, layout kept), dtype, finiteness, determinism,
    prefix rows bit-exact, input untouched; same grid size gives the table back."""
    prefix = torch.full((2, DIM), 3.0)
    full = torch.cat([prefix, table[: GRID[0] * GRID[1]]]).to(dtype)
    t = full[None] if stored == "parameter" else full
    before = t.clone()
    a = S.resize_grid(t, GRID, new_grid, name, reserved=2, seed=3)
    b = S.resize_grid(t, GRID, new_grid, name, reserved=2, seed=3)
    rows = 2 + new_grid[0] * new_grid[1]
    assert a.shape == ((1, rows, DIM) if stored == "parameter" else (rows, DIM)) and a.dtype == dtype
    assert torch.isfinite(a.float()).all() and torch.equal(a, b) and torch.equal(t, before)
    assert torch.equal(a.reshape(rows, DIM)[:2], prefix.to(dtype))
    assert torch.equal(S.resize_grid(t, GRID, GRID, name, reserved=2), t)


@pytest.mark.parametrize("name", TWO_D)
def test_grid_strategies_refuse_1d_tables_and_vice_versa(name, table):
    with pytest.raises(StrategyError, match=rf"'{name}' resizes a 2-D grid .* this table is a 1-D table .* use tile"):
        S.resize_table(table, 50, name)
    grid = table[:35]
    with pytest.raises(StrategyError, match=r"'tile' resizes a 1-D table .* 2-D grid of image patches: use bicubic"):
        S.resize_grid(grid, GRID, (10, 14), "tile")


def test_bicubic_is_transformers_run_time_interpolation(table):
    """Growing: exactly ViT's interpolate_pos_encoding (bicubic, align_corners=False, no antialias)."""
    grid = table[:35].reshape(1, *GRID, DIM).permute(0, 3, 1, 2)
    ref = torch.nn.functional.interpolate(grid, size=(10, 14), mode="bicubic", align_corners=False)
    out = S.resize_grid(table[:35], GRID, (10, 14), "bicubic")
    assert torch.equal(out, ref.permute(0, 2, 3, 1).reshape(-1, DIM))
    # shrinking antialiases by default (timm-like); antialias=false is transformers' run-time path
    small = torch.nn.functional.interpolate(grid, size=(3, 4), mode="bicubic", align_corners=False)
    plain = S.resize_grid(table[:35], GRID, (3, 4), "bicubic", params={"antialias": False})
    assert torch.equal(plain, small.permute(0, 2, 3, 1).reshape(-1, DIM))
    assert not torch.equal(S.resize_grid(table[:35], GRID, (3, 4), "bicubic"), plain)


def test_nearest_copies_rows(table):
    out = S.resize_grid(table[:35], GRID, (10, 14), "nearest").reshape(10, 14, DIM)
    old = table[:35].reshape(*GRID, DIM)
    assert torch.equal(out[::2, ::2], old) and torch.equal(out[1::2, 1::2], old)


def long_clip_reference(pre: torch.Tensor, keep: int = 20) -> torch.Tensor:
    """Long-CLIP's own loop (model/longclip.py, load_from_clip), for 77 -> 248 positions."""
    length = pre.shape[0]
    res = torch.zeros(4 * length - 3 * keep, pre.shape[1], dtype=pre.dtype)
    res[:keep] = pre[:keep]
    for i in range(length - 1 - keep):
        res[4 * i + keep] = pre[i + keep]
        res[4 * i + 1 + keep] = 3 * pre[i + keep] / 4 + 1 * pre[i + 1 + keep] / 4
        res[4 * i + 2 + keep] = 2 * pre[i + keep] / 4 + 2 * pre[i + 1 + keep] / 4
        res[4 * i + 3 + keep] = 1 * pre[i + keep] / 4 + 3 * pre[i + 1 + keep] / 4
    last = 4 * length - 3 * keep - 4
    for j in range(4):
        res[last + j] = pre[length - 1] + j * (pre[length - 1] - pre[length - 2]) / 4
    return res


def test_kps_reproduces_long_clip_77_to_248():
    torch.manual_seed(0)
    pre = torch.randn(77, 24) * 0.02
    out = S.resize_table(pre, 248, "kps")
    ref = long_clip_reference(pre)
    assert ref.shape == (248, 24)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-7)
    assert torch.equal(out[:20], pre[:20])
    assert torch.equal(out[20:244:4], pre[20:76])  # weight (1, 0): the old rows themselves
    # a general length: keep rows exact, the stretched tail starts at old[keep] and is linear
    out = S.resize_table(pre, 134, "kps", params={"keep": 10})  # ratio (134-10)/(77-10) = 124/67
    assert torch.equal(out[:10], pre[:10]) and torch.equal(out[10], pre[10])
    with pytest.raises(StrategyError, match="keep must be an integer between 0 and 75"):
        S.resize_table(pre, 248, "kps", params={"keep": 80})



def test_kps_default_keep_follows_the_old_length_and_fits_every_table(monkeypatch):
    """Long-CLIP's 20 of 77 rows, scaled: exactly 20 for CLIP's 77 (above: its table bit for bit), 4 of OWL-ViT's 16,
    and always what kps takes (at most the old length less 2)."""
    assert [S.kps_keep(n) for n in (77, 16, 24, 248, 3, 2)] == [20, 4, 6, 64, 1, 0]
    for old in range(2, 120):
        pre = torch.randn(old, 4)
        out = S.resize_table(pre, old * 3, "kps")  # no keep given: never refused
        keep = S.kps_keep(old)
        assert keep == min(round(old * 20 / 77), old - 2) and torch.equal(out[:keep], pre[:keep])
    shown = S.get_strategy("kps").defaults, S.get_strategy("random").defaults, S.get_strategy("bicubic").defaults
    assert shown == ({"keep": "old length × 20/77, rounded"}, {"std": "initializer_range"}, {"antialias": "when shrinking"})
    from posextend.commands import console

    monkeypatch.setattr(console, "width", 400)  # made once per process: another test may have made it narrower
    r = CliRunner().invoke(app, ["strategies"])
    assert "keep=old length × 20/77, rounded" in r.output and "std=initializer_range" in r.output and "None" not in r.output
    with pytest.raises(StrategyError, match="defaults must name its parameters"):
        S.register_strategy("wrongdefault", defaults={"nope": "x"})(lambda t, n, *, generator: t)

@pytest.mark.parametrize("name", ONE_D)
def test_reserved_rows_are_never_seen_or_changed(name, table):
    reserved = torch.full((2, DIM), 7.0)  # a strategy that saw these would spread 7s around
    full = torch.cat([reserved, table])
    out = S.resize_table(full, 100, name, reserved=2, seed=0)
    assert out.shape == (102, DIM)
    assert torch.equal(out[:2], reserved)
    assert (out[2:] != 7.0).all()


def test_tile_repeats_cyclically_for_any_length(table):
    out = S.resize_table(table, 100, "tile")
    idx = torch.arange(100) % OLD
    assert torch.equal(out, table[idx])


def test_interpolate_mapping(table):
    new = 4 * OLD
    out = S.resize_table(table, new, "interpolate")
    x = torch.arange(new, dtype=torch.float64) * (OLD - 1) / (new - 1)
    lo = x.floor().long().clamp(max=OLD - 2)
    w = (x - lo)[:, None]
    ref = ((1 - w) * table[lo].double() + w * table[lo + 1].double()).float()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert torch.equal(out[0], table[0]) and torch.equal(out[-1], table[-1])
    # same length: identity
    assert torch.equal(S.resize_table(table, OLD, "interpolate"), table)


def test_random_std_default_config_and_matched(table):
    n = 20000
    default = S.resize_table(table, n, "random", seed=0)[OLD:]
    assert abs(default.std().item() - 0.02) < 0.001
    from_config = S.resize_table(table, n, "random", seed=0, context={"initializer_range": 0.1})[OLD:]
    assert abs(from_config.std().item() - 0.1) < 0.005
    matched = S.resize_table(table, n, "random", seed=0, params={"std": "matched"})[OLD:]
    assert abs(matched.std().item() - table.std().item()) < 0.002
    explicit = S.resize_table(table, n, "random", seed=0, params={"std": 0.5})[OLD:]
    assert abs(explicit.std().item() - 0.5) < 0.02
    other_seed = S.resize_table(table, n, "random", seed=1)[OLD:]
    assert not torch.equal(default, other_seed)


def test_shrink_keeps_the_first_rows(table):
    for name in ("tile", "random"):
        assert torch.equal(S.resize_table(table, 10, name, seed=0), table[:10])


def test_unknown_strategy_lists_the_valid_ones(table):
    with pytest.raises(StrategyError, match=r"Unknown strategy 'nope'. Valid strategies: bicubic, bilinear, interpolate, kps, nearest, random, tile"):
        S.resize_table(table, 50, "nope")


def test_unknown_and_bad_params(table):
    with pytest.raises(StrategyError, match=r"does not take parameter\(s\) sdt; it accepts: std"):
        S.resize_table(table, 50, "random", params={"sdt": 1})
    with pytest.raises(StrategyError, match=r"std must be a non-negative number or 'matched'"):
        S.resize_table(table, 50, "random", params={"std": "wide"})


@pytest.mark.parametrize(
    "text, expected",
    [("std=matched", ("std", "matched")), ("std=0.5", ("std", 0.5)), ("k=3", ("k", 3)),
     ("flag=true", ("flag", True)), ("x=None", ("x", None))],
)
def test_parse_param(text, expected):
    from posextend.resize.options import parse_param

    assert parse_param(text) == expected


def test_parse_param_rejects_non_pairs():
    from posextend.resize.options import parse_param

    with pytest.raises(StrategyError, match="is not key=value"):
        parse_param("std")


def test_registration_refuses_duplicates_and_bad_names(monkeypatch):
    monkeypatch.setattr(S._REGISTRY, "items", dict(S._REGISTRY.items))
    with pytest.raises(StrategyError, match="already registered"):
        S.register_strategy("tile")(lambda t, n, *, generator: t)
    with pytest.raises(StrategyError, match="Invalid strategy name"):
        S.register_strategy("Bad Name")
    with pytest.raises(StrategyError, match="keyword-only 'generator'"):
        S.register_strategy("nogen")(lambda t, n: t)


def test_core_rejects_a_strategy_that_breaks_the_contract(monkeypatch, table):
    monkeypatch.setattr(S._REGISTRY, "items", dict(S._REGISTRY.items))

    @S.register_strategy("short")
    def short(t, n, *, generator):
        return t[:1]

    @S.register_strategy("nan")
    def nan(t, n, *, generator):
        return torch.full((n, t.shape[1]), float("nan"))

    with pytest.raises(StrategyError, match=r"returned \(1, 16\), expected shape \(50, 16\)"):
        S.resize_table(table, 50, "short")
    with pytest.raises(StrategyError, match="non-finite"):
        S.resize_table(table, 50, "nan")


def test_entry_point_plugin_is_discovered(tmp_path, monkeypatch, table):
    """A third-party package registers a strategy through the posextend.strategies group."""
    (tmp_path / "mirror_plugin.py").write_text(textwrap.dedent('''
        import torch
        import posextend

        @posextend.register_strategy("mirror", description="Reflect the table at its end.")
        def mirror(table, new_len, *, generator):
            n = table.shape[0]
            idx = torch.arange(new_len) % (2 * n)
            return table[torch.where(idx < n, idx, 2 * n - 1 - idx)]
    '''))
    dist = tmp_path / "mirror_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mirror-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[posextend.strategies]\nmirror = mirror_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(S._REGISTRY, "items", dict(S._REGISTRY.items))
    monkeypatch.setattr(S._REGISTRY, "plugins_loaded", False)
    monkeypatch.delitem(sys.modules, "mirror_plugin", raising=False)
    assert "mirror" in posextend.available_strategies()
    out = S.resize_table(table, 2 * OLD, "mirror")
    assert torch.equal(out[OLD:], table.flip(0))
