"""The floors of docs/architecture.md, held against the code: each folder of the C core includes only headers of
the folders under it, and the Python sub-packages import only downwards. A change that runs an include or an import
back up fails here, before it becomes a circle."""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# csrc folder -> the folders whose headers it may include (itself included)
C_FLOORS = {
    "common": {"common"},
    "model": {"model", "common"},
    "attention": {"attention", "common"},
    "scheduler": {"scheduler", "model", "common"},
}

# hexiseq sub-package (or top-level module) -> what it must never import
PY_NEVER = {
    "runtime": {"planner", "measure", "integrations", "cli"},
    "planner": {"measure", "integrations", "cli"},
    "measure": {"integrations", "cli"},
    "integrations": {"cli"},
    "_validate": {"planner", "runtime", "measure", "integrations", "cli"},
    "errors": {"planner", "runtime", "measure", "integrations", "cli", "_validate"},
}


def _header_folder(name):
    hits = [os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ROOT, "csrc", "*", name))]
    return hits


def test_csrc_folders_include_only_their_floor_and_below():
    assert set(os.listdir(os.path.join(ROOT, "csrc"))) == set(C_FLOORS), "a csrc folder without a floor here"
    wrong = []
    for folder, allowed in C_FLOORS.items():
        for path in sorted(glob.glob(os.path.join(ROOT, "csrc", folder, "*"))):
            for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(path).read(), flags=re.M):
                homes = _header_folder(name)
                assert len(homes) <= 1, f"{name} is in several csrc folders: {homes}"
                if homes and homes[0] not in allowed:
                    wrong.append(f"csrc/{folder}/{os.path.basename(path)} includes {name} (csrc/{homes[0]}/)")
    assert not wrong, wrong


def _imports(path):
    """The hexiseq modules a file imports, as dotted names relative to the package ('planner.model', '_core')."""
    rel = os.path.relpath(path, os.path.join(ROOT, "hexiseq"))
    package = [] if os.path.dirname(rel) == "" else os.path.dirname(rel).split(os.sep)
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.startswith("hexiseq."):
                    out.append(node.module[len("hexiseq."):])
                continue
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                out.append(target)
            else:
                out += [".".join(base + [a.name]) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name[len("hexiseq."):] for a in node.names if a.name.startswith("hexiseq.")]
    return out


def test_python_sub_packages_import_only_downwards():
    wrong = []
    for path in sorted(glob.glob(os.path.join(ROOT, "hexiseq", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, os.path.join(ROOT, "hexiseq"))
        room = rel.split(os.sep)[0].removesuffix(".py")
        for target in _imports(path):
            if target.split(".")[0] in PY_NEVER.get(room, ()):
                wrong.append(f"hexiseq/{rel} imports {target}")
    assert not wrong, wrong


def test_the_checks_see_the_imports_they_guard():
    # the import reader finds what it must, so the test above cannot pass by reading nothing
    assert "runtime.nn" in _imports(os.path.join(ROOT, "hexiseq", "measure", "measurement.py"))
    assert "planner.plan" in _imports(os.path.join(ROOT, "hexiseq", "measure", "measurement.py"))
    assert "planner.model" in _imports(os.path.join(ROOT, "hexiseq", "integrations", "group.py"))
    assert "errors" in _imports(os.path.join(ROOT, "hexiseq", "runtime", "comm.py"))
    assert _header_folder("internal.h") == ["model"]
