"""A plan feature's executor code lives in its own module, registered in one line.

The executor's features (slidedp/exec/features/) each hold their kernels, buffers and step hooks,
so that the interpreter, the base kernels and the buffer setup hold no branch on a feature. Here
the rule is data: per feature, the identifiers that name it, its own modules, and the other
modules of slidedp/exec allowed to use them, each with the reason. Identifiers are read from the
code (Python's ast: names, attributes, definitions, arguments, imports); docstrings and comments
may mention a feature.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

EXEC = Path(__file__).resolve().parents[1] / "slidedp" / "exec"
REGISTRY = "features/__init__.py"  # the registration: one line per feature


@dataclass(frozen=True)
class FeatureNames:
    names: frozenset[str]  # identifiers that name the feature, wherever they appear
    own: frozenset[str]  # its modules (relative to slidedp/exec)
    attrs: frozenset[str] = frozenset()  # names that are the feature's only as attributes (x.rows)
    allowed: dict[str, str] = field(default_factory=dict)  # other module -> why it may use them


FEATURES = {
    "deferred_update": FeatureNames(
        names=frozenset({"defer_update", "deferred_update", "DeferredUpdate", "grad_clip",
                         "clip_at"}),
        own=frozenset({"features/deferred_update.py"}),
        allowed={"adamw.py": "AdamWConfig declares grad_clip (the optimizer's option)",
                 "features/split_update.py": "the deferred update's split schedule: it takes "
                                             "the joined one's host sums and clips by grad_clip"}),
    "split_update": FeatureNames(
        names=frozenset({"split_update", "SplitUpdate", "splits_update", "update_pending",
                         "adamw_chunk_into", "UPDATE_CAST", "update_cast"}),
        own=frozenset({"features/split_update.py"}),
        allowed={"adamw.py": "adamw_chunk_into, the update written into the upload chunk (the "
                             "optimizer's kernels)",
                 "buffers.py": "the staging ring holds UPDATE_CAST's chunks too",
                 "dist/ownership.py": "UPDATE_CAST runs where the CAST it replaces would",
                 "features/deferred_update.py": "the joined schedule runs where the plan does "
                                                "not split the update"}),
    "grad_widen": FeatureNames(
        names=frozenset({"grad_widen", "GradWiden", "WidenOnHost", "grad_wire_bytes",
                         "download_narrow"}),
        own=frozenset({"features/grad_widen.py"})),
    "offload": FeatureNames(
        names=frozenset({"offload", "offload_ratio", "reload_ahead_layers", "ACT_OFFLOAD",
                         "ACT_RELOAD", "ActivationOffload", "OffloadedActivations",
                         "offload_bytes", "reload_layer"}),
        own=frozenset({"features/offload.py"}),
        allowed={"policy_profile.py": "profiles one layer's policy with its offload ratio (the "
                                      "profile's offload_bytes), through the feature's store"}),
    "embedding_rows": FeatureNames(
        names=frozenset({"embedding_rows", "splits_embedding", "SplitEmbedding", "EmbeddingRows",
                         "emb_rows", "rows_mode", "reduce_rows", "embedding_rows_elems",
                         "first_delivery"}),
        attrs=frozenset({"rows"}),  # the graph's per-task flag, g.rows
        own=frozenset({"features/embedding_rows.py"}),
        allowed={
            "template.py": "pairs a chunk's D2H / HOST_SUM with its ADAM by (unit, rows, first "
                           "element): the graph's fields it reads for every task",
            "dist/ownership.py": "the looked-up rows' CAST runs in the process that updated "
                                 "them (which process owns a task)",
            "dist/collectives.py": "reduce_rows: the collective over the compact rows' gradient",
        }),
}


def identifier_lines(source: str, names: frozenset[str], attrs: frozenset[str]) -> set[int]:
    """Lines of `source` whose code uses one of `names` (or `attrs` as an attribute)."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        found: list[str] = []
        if isinstance(node, ast.Name):
            found = [node.id]
        elif isinstance(node, ast.Attribute):
            found = [node.attr]
            if node.attr in attrs:
                lines.add(node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = [node.name]
        elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg is not None:
            found = [node.arg]
        elif isinstance(node, ast.alias):
            found = [node.name.rsplit(".", 1)[-1], node.asname or ""]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found = node.module.split(".")
        if names.intersection(found):
            lines.add(node.lineno)
    return lines


def exec_modules() -> dict[str, str]:
    return {p.relative_to(EXEC).as_posix(): p.read_text() for p in sorted(EXEC.rglob("*.py"))}


def test_the_scanner_sees_names_in_code_and_not_in_text():
    names, attrs = FEATURES["embedding_rows"].names, FEATURES["embedding_rows"].attrs
    src = ('"""embedding_rows in a docstring, g.rows in text"""\n'
           "x = plan.splits_embedding  # embedding_rows in a comment\n"
           "rows = 3\n"
           "if g.rows[v]:\n"
           "    build(first_delivery=False)\n"
           "from slidedp.exec.features.embedding_rows import SplitEmbedding\n"
           "def f(emb_rows):\n"
           "    pass\n")
    assert identifier_lines(src, names, attrs) == {2, 4, 5, 6, 7}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_features_names_appear_only_in_its_modules_and_its_registration(feature):
    spec = FEATURES[feature]
    leaks = {}
    for rel, source in exec_modules().items():
        if rel in spec.own or rel in spec.allowed:
            continue
        lines = identifier_lines(source, spec.names, spec.attrs)
        if rel == REGISTRY:
            tree = ast.parse(source)
            imports = {n.lineno for n in tree.body if isinstance(n, ast.ImportFrom)}
            assert len(lines - imports) == 1, f"{feature}: register it in one line of {REGISTRY}"
            continue
        if lines:
            leaks[rel] = sorted(lines)
    assert not leaks, (f"{feature}'s names {sorted(spec.names | spec.attrs)} outside its module "
                       f"{sorted(spec.own)}: {leaks} (move the code into the feature's module, or "
                       "allow the module in FEATURES with the reason)")
    modules = exec_modules()
    for rel in spec.own | set(spec.allowed):
        assert rel in modules, f"{feature}: {rel} is not a module of slidedp/exec"


def test_every_feature_module_is_registered_and_checked():
    from slidedp.exec.features import FEATURES as REGISTERED

    modules = {p.stem for p in (EXEC / "features").glob("*.py")} - {"__init__", "base"}
    assert {F.__module__.rsplit(".", 1)[-1] for F in REGISTERED} == modules
    assert {F.name for F in REGISTERED} == set(FEATURES) == modules


def test_no_function_in_exec_is_over_100_lines():
    """Nested functions count in their parent; a method is a function of its own."""
    long = []
    for rel, source in exec_modules().items():
        todo = list(ast.parse(source).body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.ClassDef):
                todo.extend(node.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    long.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long
