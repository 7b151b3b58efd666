"""Count how the image-grid probe covers the model types the census refuses as ``grid``.

Not a test: ``python tests/grid_census.py [TYPES...] [--json out.json]``. For each model type whose
posextend/families/census.json outcome is ``grid`` (or the types given), a config is built as the census builds
it (default config, census class, lengths capped, widths shrunk) and :func:`observe_grids` runs on it.
Prints one line per type, then the counts: probed (by how it was verified) and refused, the refusals
grouped by reason.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from census import _class_for, capped, default_config  # noqa: E402

from posextend.families import configs  # noqa: E402
from posextend.errors import PosExtendError  # noqa: E402
from posextend.families.grid_fields import image_fields  # noqa: E402
from posextend.families.grid_probe import observe_grids  # noqa: E402

LIMIT_S = 120


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout()


def grid_types() -> list[str]:
    data = json.loads((Path(__file__).parent.parent / "posextend" / "families" / "census.json").read_text())
    return sorted(r["model_type"] for r in data if r["outcome"] == "grid")


def _group(reason: str) -> str:
    """A reason with its model type and numbers blanked, to group alike refusals."""
    text = re.sub(r"Model type '[^']*' has no written grid spec, and its twin shows no image grid posextend can "
                  r"resize safely \(", "", reason)
    text = re.sub(r"^[\w\-]+: ", "", text)
    text = re.sub(r"\[[^\]]*\]|\d+(x\d+)*", "N", text)
    text = re.sub(r"\b[\w]+(\.[\w]+){2,}\b", "NAME", text)
    return text[:150]


def probe_one(model_type: str) -> dict:
    start = time.perf_counter()
    out = {"model_type": model_type}
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        config = default_config(model_type)
        cls = _class_for(model_type, config)
        if cls is None:
            out.update(outcome="no-twin", reason="no model class")
            return out
        config["architectures"] = [cls.__name__]
        config = configs.shrink(capped(config))
        out["cls"] = cls.__name__
        if not image_fields(config):
            out.update(outcome="refused", reason="no image_size and patch_size in its config")
            return out
        specs = observe_grids(config, cls)
        out.update(outcome="probed", specs=[
            {"group": s.group, "tables": list(s.tables), "prefix": s.reserved, "key": s.length_keys[0],
             "square": s.grid.square, "method": f"{s.grid.strategy}{'+aa' if s.grid.antialias else ''}",
             "reference": s.grid.reference} for s in specs])
    except PosExtendError as exc:
        out.update(outcome="refused", reason=str(exc))
    except _Timeout:
        out.update(outcome="refused", reason=f"probe took over {LIMIT_S}s (timeout of this script)")
    except Exception as exc:  # a bug of the probe
        out.update(outcome="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        signal.alarm(0)
        out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for model_type in args.types or grid_types():
        r = probe_one(model_type)
        results.append(r)
        detail = "; ".join(f"{s['group']}: {s['tables'][0]} prefix {s['prefix']} {s['method']} {s['reference']}"
                           f"{' square' if s['square'] else ''}" for s in r.get("specs", [])) or r.get("reason", "")[:300]
        print(f"{model_type}: {r['outcome']} ({r['seconds']}s) {detail}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    counts = Counter(r["outcome"] if r["outcome"] != "probed" else
                     "probed (" + ", ".join(sorted({s["reference"] for s in r["specs"]})) + ")" for r in results)
    print("\n| outcome | types |\n|---|---|")
    for k, v in sorted(counts.items()):
        print(f"| {k} | {v} |")
    reasons = defaultdict(list)
    for r in results:
        if r["outcome"] != "probed":
            reasons[_group(r["reason"])].append(r["model_type"])
    print("\n| refused: reason | n | types |\n|---|---|---|")
    for reason, types in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        print(f"| {reason} | {len(types)} | {', '.join(types)} |")


if __name__ == "__main__":
    main()
