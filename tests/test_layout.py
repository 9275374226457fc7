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
    "assign": {"assign", "common"},
    "pipeline": {"pipeline", "common"},
}

# hexiseq sub-package (or top-level module) -> what it must never import
PY_NEVER = {
    "runtime": {"planner", "hardware", "integrations", "cli"},
    "planner": {"hardware", "integrations", "cli"},
    "hardware": {"integrations", "cli"},
    "integrations": {"cli"},
    "_validate": {"planner", "runtime", "hardware", "integrations", "cli"},
    "errors": {"planner", "runtime", "hardware", "integrations", "cli", "_validate"},
    "geometry": {"planner", "runtime", "hardware", "integrations", "cli"},
    "schedule": {"planner", "runtime", "hardware", "integrations", "cli"},
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
    assert "runtime.nn" in _imports(os.path.join(ROOT, "hexiseq", "hardware", "measurement.py"))
    assert "planner.plan" in _imports(os.path.join(ROOT, "hexiseq", "hardware", "measurement.py"))
    assert "planner.model" in _imports(os.path.join(ROOT, "hexiseq", "integrations", "group.py"))
    assert "errors" in _imports(os.path.join(ROOT, "hexiseq", "runtime", "comm.py"))
    assert _header_folder("internal.h") == ["model"]


# A private name (a leading underscore) used from another module is a seam in the wrong place: what two modules share
# gets a public name in the module that owns it. Allowed: the extension `_core` and its attributes, dunders, and
# private *modules* (`from . import _aliases`); the rule is about names inside modules.

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp, ast.DictComp,
           ast.GeneratorExp)


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(package_dir, parts):
    """Whether the dotted parts (relative to the package) name a module or sub-package of it, the extension too."""
    if parts[:1] == ("_core",):
        return True
    path = os.path.join(package_dir, *parts)
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


class _PrivateUses(ast.NodeVisitor):
    """The private names one file takes from other modules of the package: `from X import _name`, and `m._name`
    where `m` is bound to a module of the package (by import, in the scope that reads it)."""

    def __init__(self, package_dir, rel):
        self.package_dir = package_dir
        self.package = tuple(os.path.dirname(rel).split(os.sep)) if os.path.dirname(rel) else ()
        self.scopes = []
        self.found = []  # (line, name, the module it belongs to)

    def _target(self, node):
        """An ImportFrom's module as parts relative to the package, None when it is outside the package."""
        if node.level == 0:
            parts = tuple((node.module or "").split("."))
            return parts[1:] if parts[0] == os.path.basename(self.package_dir) else None
        base = self.package[:len(self.package) - (node.level - 1)] if node.level > 1 else self.package
        return base + (tuple(node.module.split(".")) if node.module else ())

    def _bindings(self, scope):
        """name -> the module it is bound to in this scope, or None when anything else binds it there too."""
        out = {}

        def bind(name, module):
            out[name] = module if out.get(name, module) == module else None

        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = scope.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                bind(arg.arg, None)
        if isinstance(scope, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            body = [g.target for g in scope.generators]
        elif isinstance(scope, ast.Lambda):
            body = []
        else:
            body = scope.body
        stack = list(body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(node.name, None)
                continue
            if isinstance(node, _SCOPES):
                continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bind(node.id, None)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = tuple(a.name.split("."))
                    inside = parts[0] == os.path.basename(self.package_dir)
                    if a.asname:
                        bind(a.asname, parts[1:] if inside else None)
                    else:
                        bind(parts[0], () if inside else None)
            elif isinstance(node, ast.ImportFrom):
                target = self._target(node)
                for a in node.names:
                    if a.name == "*":
                        continue
                    module = None if target is None else target + (a.name,)
                    bind(a.asname or a.name, module if module and _is_module(self.package_dir, module) else None)
            stack.extend(ast.iter_child_nodes(node))
        return out

    def _lookup(self, name):
        for i, (scope, names) in enumerate(reversed(self.scopes)):
            if i and isinstance(scope, ast.ClassDef):
                continue  # a class body's names are not seen by the functions in it
            if name in names:
                return names[name]
        return None

    def _module(self, node):
        """The module an expression names (parts relative to the package), or None."""
        if isinstance(node, ast.Name):
            return self._lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self._module(node.value)
            if base is not None and _is_module(self.package_dir, base + (node.attr,)):
                return base + (node.attr,)
        return None

    def _scope(self, node):
        self.scopes.append((node, self._bindings(node)))
        self.generic_visit(node)
        self.scopes.pop()

    visit_Module = visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _scope
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _scope

    def visit_ImportFrom(self, node):
        target = self._target(node)
        if target is not None and target[:1] != ("_core",):
            for a in node.names:
                if _private(a.name) and not _is_module(self.package_dir, target + (a.name,)):
                    self.found.append((node.lineno, a.name, ".".join(target)))

    def visit_Attribute(self, node):
        if _private(node.attr):
            module = self._module(node.value)
            if (module is not None and module[:1] != ("_core",)
                    and not _is_module(self.package_dir, module + (node.attr,))):
                self.found.append((node.lineno, node.attr, ".".join(module)))
        self.generic_visit(node)


def private_names_across_modules(package_dir):
    """Every private name a file of the package takes from another of its modules: (file, line, name, module),
    the file relative to the package's parent folder."""
    out = []
    top = os.path.basename(package_dir)
    for path in sorted(glob.glob(os.path.join(package_dir, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, package_dir)
        uses = _PrivateUses(package_dir, rel)
        uses.visit(ast.parse(open(path).read(), filename=path))
        out += [(f"{top}/{rel}".replace(os.sep, "/"), line, name, module) for line, name, module in uses.found]
    return out


def test_no_private_names_across_modules():
    found = private_names_across_modules(os.path.join(ROOT, "hexiseq"))
    wrong = [f"{f}:{line}: {name} (from {module or 'hexiseq'})" for f, line, name, module in found]
    assert not wrong, "private names taken from another module; give them a public name where they belong:\n" + \
        "\n".join(wrong)


def test_the_private_name_check_finds_what_it_must(tmp_path):
    # a small package with each kind of use, so the test above cannot pass by finding nothing
    files = {
        "__init__.py": "from . import _aliases\nfrom .sub.wire import __version__\n",
        "_aliases.py": "",
        "sub/__init__.py": "",
        "sub/wire.py": "__version__ = '1'\n_show = _code = _mod = object()\n",
        "sub/_private.py": "",
        "sub/user.py": (
            "from .wire import _show, public\n"                   # line 1: _show
            "from . import wire, _private\n"
            "from hexiseq.sub.wire import _code\n"               # line 3: _code
            "import hexiseq.sub.wire as w\n"
            "import hexiseq\n"
            "from .. import _core\n"
            "from .._core import _thing\n"
            "def f(plan):\n"
            "    wire._show(plan._slot, _core._helper, w.__doc__)\n"   # line 9: wire._show
            "    return w._mod, hexiseq.sub.wire._code, hexiseq._aliases\n"   # line 10: w._mod, ..._code
            "def g(wire):\n"
            "    return wire._slot, [w._x for w in ()]\n"           # shadowed: not modules
            "class C:\n"
            "    wire = None\n"
            "    def m(self):\n"
            "        return wire._code\n"                          # line 16: the class's name is not seen
        ),
    }
    for name, text in files.items():
        path = tmp_path / "hexiseq" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = private_names_across_modules(str(tmp_path / "hexiseq"))
    assert sorted(found) == sorted([
        ("hexiseq/sub/user.py", 1, "_show", "sub.wire"),
        ("hexiseq/sub/user.py", 3, "_code", "sub.wire"),
        ("hexiseq/sub/user.py", 9, "_show", "sub.wire"),
        ("hexiseq/sub/user.py", 10, "_mod", "sub.wire"),
        ("hexiseq/sub/user.py", 10, "_code", "sub.wire"),
        ("hexiseq/sub/user.py", 16, "_code", "sub.wire"),
    ]), found
