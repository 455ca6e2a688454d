"""A plan feature lives in its own module: its names appear in the checked packages only there,
in its registration and in the few declarations listed beside it.

The check reads code, not prose: identifiers, and string literals that are bare identifiers
(dict keys, getattr names); comments and docstrings may describe a feature. An identifier names
a feature when the feature's name is a run of its parts (split at "_" and at lower-to-upper case
changes, compared lower-case): `offload` names `ACT_OFFLOAD` and `offload_ratio`, `grad_widen`
names `GradWiden`. The spec (slidedp/spec/plan.py declares the plan fields), the CLI and the
docs are outside SCOPE. To check another package (slidedp/exec), add it to SCOPE and its feature
modules to each feature's "modules".
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCOPE = ("slidedp/graph", "slidedp/sim", "slidedp/model")
REGISTRY = "slidedp/graph/features/__init__.py"  # one import and one entry per feature
# feature -> its names, its own modules, and identifiers declared elsewhere (path -> names)
FEATURES: dict[str, dict] = {
    "embedding_rows": {
        "names": ("rows_mode", "splits_embedding", "embedding_rows", "row_capacity",
                  "looked_up_rows"),
        "modules": ("slidedp/graph/features/embedding_rows.py",),
        # a GraphMeta field the executor reads (exec/engine.py)
        "declared": {"slidedp/graph/tasks.py": ("embedding_rows_elems",)},
    },
    "deferred_update": {
        "names": ("defer_update",),
        "modules": ("slidedp/graph/features/deferred_update.py",),
    },
    "grad_widen": {
        "names": ("grad_widen",),
        "modules": ("slidedp/graph/features/grad_widen.py",),
    },
    "offload": {
        "names": ("offload", "offload_ratio", "reload_ahead_layers"),
        "modules": ("slidedp/graph/features/offload.py",),
        # its task kind: the Kind enum and its row of the kind table
        "declared": {"slidedp/graph/tasks.py": ("ACT_OFFLOAD",),
                     "slidedp/graph/kinds.py": ("ACT_OFFLOAD",)},
    },
    "internode": {
        "names": ("internode", "internode_reduce"),
        "modules": ("slidedp/graph/features/internode.py", "slidedp/sim/internode_study.py"),
    },
    "compact_moments": {
        "names": ("moments",),
        "modules": ("slidedp/graph/features/compact_moments.py", "slidedp/model/state_tier.py"),
        # the GraphMeta field, and the two rules of the ADAM's row that read it (its rate and
        # its DRAM bytes per parameter)
        "declared": {"slidedp/graph/tasks.py": ("moments",),
                     "slidedp/graph/kinds.py": ("moments",),
                     "slidedp/graph/rates.py": ("moments", "Moments")},
    },
    # features to come: the names they will bring and where their modules will live
    "topology": {
        "names": ("topology", "socket", "sockets", "numa", "pcie_switch", "root_port"),
        "modules": ("slidedp/graph/topology.py",),
        # its machine's registration in costs.MACHINES: an import and an entry
        "declared": {"slidedp/graph/costs.py": ("topology", "TopologyHost")},
    },
    "moe": {
        "names": ("moe", "expert", "experts"),
        "modules": ("slidedp/graph/features/moe.py",),
    },
    "nvme": {
        "names": ("nvme",),
        "modules": ("slidedp/graph/features/nvme.py",),
    },
}
_IDENT = re.compile(r"[A-Za-z_]\w*")


def parts(identifier: str) -> list[str]:
    """`ACT_OFFLOAD` -> [act, offload]; `GradWiden` -> [grad, widen]."""
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", identifier).lower()
    return [p for p in snake.split("_") if p]


def names_feature(identifier: str, name: str) -> bool:
    have, want = parts(identifier), parts(name)
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def identifiers(source: str):
    """(line, identifier) of the code's names and bare-identifier string literals."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str) and _IDENT.fullmatch(value):
                yield tok.start[0], value


def violations(path: str, source: str) -> list[str]:
    """Every use of a feature's name in `source` (at `path`) that FEATURES does not allow."""
    out, registry_lines = [], {}
    for line, ident in identifiers(source):
        for feature, spec in FEATURES.items():
            if path in spec["modules"] or ident in spec.get("declared", {}).get(path, ()):
                continue
            if not any(names_feature(ident, n) for n in spec["names"]):
                continue
            if path == REGISTRY:
                registry_lines.setdefault(feature, set()).add(line)
                continue
            out.append(f"{path}:{line}: {ident} ({feature})")
    for feature, lines in registry_lines.items():
        if len(lines) > 2:
            out.append(f"{REGISTRY}: {feature} on {len(lines)} lines (an import and an entry)")
    return out


def scope_files():
    for top in SCOPE:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_features_are_named_only_in_their_modules():
    found = [v for f in scope_files()
             for v in violations(str(f.relative_to(ROOT)), f.read_text())]
    assert not found, "feature names outside their modules:\n" + "\n".join(found)


def test_every_registered_feature_module_exists():
    for feature in ("embedding_rows", "deferred_update", "grad_widen", "offload"):
        for path in FEATURES[feature]["modules"]:
            assert (ROOT / path).is_file(), path
    registry = (ROOT / REGISTRY).read_text()
    for feature in ("embedding_rows", "deferred_update", "grad_widen", "offload"):
        assert f"slidedp.graph.features.{feature} import" in registry


def test_the_check_flags_a_branch_in_a_shared_module():
    src = ('"""A docstring may say offload and defer_update."""\n'
           "def step(plan):\n"
           "    # a comment may say grad_widen\n"
           "    if plan.defer_update:\n"
           "        return terms['act_offload'] + plan.n_experts\n")
    found = violations("slidedp/sim/engine.py", src)
    assert found == ["slidedp/sim/engine.py:4: defer_update (deferred_update)",
                     "slidedp/sim/engine.py:5: act_offload (offload)",
                     "slidedp/sim/engine.py:5: n_experts (moe)"]
    own = "slidedp/graph/features/deferred_update.py"  # its own module: the others still count
    assert violations(own, src) == [f.replace("slidedp/sim/engine.py", own) for f in found[1:]]
    assert names_feature("GradWiden", "grad_widen") and not names_feature("offloaded", "offload")
