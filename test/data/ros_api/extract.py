"""Record the public Python API of rclpy, launch and launch_ros at one ROS 2 distribution, as JSON.

The sources are parsed with :mod:`ast` and never imported, so any distribution's API can be recorded on any
machine (no Humble rclpy is needed to know what Humble's rclpy offers). Only names and parameter lists are
kept: no code, no docstrings, no default values. test/unit/test_ros_api_surface.py checks the package's
uses of these libraries against the result.

A source is ``[label=]<git dir>@<ref>`` or ``[label=]<directory>``: a checkout (packages at
``<pkg>/<pkg>/__init__.py``) or a site-packages directory (``<pkg>/__init__.py``); the label names it in
the output (default: the directory's name)::

    python extract.py --distro humble -o humble.json rclpy=rclpy.git@humble launch=launch.git@humble \
        launch_ros=launch_ros.git@humble

Output::

    {"distro": ..., "source": {"<repo>": {"ref", "commit", "date", "versions": {package: version}}},
     "modules": {"rclpy.executors": {"<name>": entry, ...}, ...}}

where an entry is one of

* ``"=rclpy.executors.Executor"``: an import of a name from the recorded packages (a re-export);
* ``"var"``: a module-level assignment (a constant, an alias to a C-extension type);
* ``"f(<sig>)"``: a function; ``<sig>`` lists its parameters: ``a`` (required), ``b=`` (has a default),
  ``/`` (end of positional-only), ``*args`` or ``*`` (start of keyword-only), ``**kw``; ``**kw>super``
  marks a ``**kw`` the function passes on to the method of the same name of its base class; a return
  annotation naming a recorded class follows as ``-> dotted.name``;
* ``{"bases": [...], "methods": {name: "<sig>"}, "attrs": [...]}``: a class; methods without their
  ``self``/``cls``; ``attrs`` holds class-level assignments, properties and public instance attributes
  (``self.x = ...``). Bases are dotted names, resolved through the module's imports (``builtins.X`` for
  builtins).

Names starting with one underscore are left out, except classes (a public class may derive from one);
``*`` imports are kept as ``{"*": [module, ...]}``.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys

PACKAGES = ("rclpy", "launch", "launch_testing", "launch_ros", "launch_testing_ros")
"""The Python packages recorded, wherever a source holds them."""

KEPT_DUNDERS = {"__init__", "__call__", "__enter__", "__exit__", "__iter__", "__len__", "__getitem__",
                "__contains__", "__await__", "__eq__", "__hash__"}


# ------------------------------------------------------------------ reading a source
class GitTree:
    """Files of one ref of a (bare) git repository, read with git plumbing commands."""

    def __init__(self, git_dir: str, ref: str):
        self.git_dir, self.ref = git_dir, ref
        self.commit = self._git("rev-parse", f"{ref}^{{commit}}").strip()
        self.date = self._git("log", "-1", "--format=%cI", self.commit).strip()
        listing = self._git("ls-tree", "-r", "--full-tree", self.commit)
        self._blobs = {}
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            _mode, kind, sha = meta.split()
            if kind == "blob":
                self._blobs[path] = sha

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", self.git_dir, *args], check=True, capture_output=True,
                              text=True).stdout

    def paths(self):
        return sorted(self._blobs)

    def read(self, path: str) -> str:
        return self._git("cat-file", "blob", self._blobs[path])

    def describe(self) -> dict:
        return {"ref": self.ref, "commit": self.commit, "date": self.date}


class DirTree:
    """Files under a directory (a checkout or a site-packages directory)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self._paths = []
        for base, dirs, files in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git"))
            for f in files:
                self._paths.append(os.path.relpath(os.path.join(base, f), self.root).replace(os.sep, "/"))

    def paths(self):
        return sorted(self._paths)

    def read(self, path: str) -> str:
        with open(os.path.join(self.root, path), encoding="utf-8") as fh:
            return fh.read()

    def describe(self) -> dict:
        return {"ref": None, "commit": None, "date": None, "directory": self.root}


def package_modules(tree) -> dict:
    """{package: {module name: path}} for each of PACKAGES the tree holds (tests and setup files left out)."""
    found = {}
    paths = tree.paths()
    for pkg in PACKAGES:
        for prefix in (f"{pkg}/{pkg}/", f"{pkg}/"):
            if prefix + "__init__.py" not in paths:
                continue
            modules = {}
            for path in paths:
                if not path.startswith(prefix) or not path.endswith(".py"):
                    continue
                rel = path[len(prefix):-3].split("/")
                if any(part in ("test", "tests") for part in rel):
                    continue
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                modules[".".join([pkg, *rel])] = path
            found[pkg] = (prefix, modules)
            break
    return found


def package_version(tree, prefix: str, pkg: str):
    """The version in the package's package.xml (checkout layout), else None."""
    root = prefix[:-len(pkg) - 1] if prefix.endswith(f"{pkg}/{pkg}/") else None
    if root is None:
        return None
    try:
        text = tree.read(f"{root}package.xml")
    except (KeyError, OSError):
        return None
    match = re.search(r"<version>\s*([^<\s]+)\s*</version>", text)
    return match.group(1) if match else None


# ------------------------------------------------------------------ one module
def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _type_checking_only(stmt) -> bool:
    """``if TYPE_CHECKING:``: names imported there do not exist at run time."""
    test = stmt.test
    return isinstance(stmt, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or
                                         isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_statements(body):
    """Module-level statements, including those in if/try/with blocks (version and import guards) but not
    in ``if TYPE_CHECKING:`` blocks."""
    for stmt in body:
        if isinstance(stmt, ast.If) and _type_checking_only(stmt):
            yield from _top_statements(stmt.orelse)
        elif isinstance(stmt, (ast.If, ast.Try, ast.With)) or type(stmt).__name__ == "TryStar":
            yield from _top_statements(stmt.body)
            yield from _top_statements(getattr(stmt, "orelse", []))
            yield from _top_statements(getattr(stmt, "finalbody", []))
            for handler in getattr(stmt, "handlers", []):
                yield from _top_statements(handler.body)
        else:
            yield stmt


def _targets(target):
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _targets(elt)


class ModuleReader:
    """The entries of one module (see the module docstring)."""

    def __init__(self, name: str, is_package: bool, source: str, packages):
        self.name, self.is_package, self.packages = name, is_package, packages
        self.tree = ast.parse(source)
        self.imports = {}  # local name -> absolute dotted name, every import (for resolving bases)
        for stmt in ast.walk(self.tree):
            if isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        self.imports.setdefault(a.name.split(".")[0], a.name.split(".")[0])
            elif isinstance(stmt, ast.ImportFrom):
                origin = _absolute(name, is_package, stmt.level, stmt.module)
                for a in stmt.names:
                    if a.name != "*":
                        self.imports[a.asname or a.name] = f"{origin}.{a.name}"
        self.defined = set()
        for stmt in _top_statements(self.tree.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defined.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    self.defined.update(_targets(t))
            elif isinstance(stmt, ast.AnnAssign):
                self.defined.update(_targets(stmt.target))

    def _recorded(self, dotted: str) -> bool:
        return dotted.split(".")[0] in self.packages

    def resolve(self, node) -> str | None:
        """Dotted name of an expression naming a class (``Name``, ``a.b.C``, ``'C'``, ``Optional[C]``)."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(node, ast.Subscript):
            head = self.resolve(node.value)
            if head in ("typing.Optional", "Optional"):
                return self.resolve(node.slice)
            return head
        if isinstance(node, ast.Name):
            if node.id in self.imports and node.id not in self.defined:
                return self.imports[node.id]
            if node.id in self.defined:
                return f"{self.name}.{node.id}"
            return f"builtins.{node.id}"
        if isinstance(node, ast.Attribute):
            head = self.resolve(node.value)
            return f"{head}.{node.attr}" if head else None
        return None

    def signature(self, fn, drop_first: bool, method_name: str | None = None) -> str:
        a = fn.args
        positional = list(a.posonlyargs) + list(a.args)
        n_defaults = len(a.defaults)
        with_default = {id(p) for p in positional[len(positional) - n_defaults:]} if n_defaults else set()
        if drop_first and positional:
            positional = positional[1:]
        parts = []
        posonly = {id(p) for p in a.posonlyargs}
        for i, p in enumerate(positional):
            parts.append(p.arg + ("=" if id(p) in with_default else ""))
            if id(p) in posonly and (i + 1 == len(positional) or id(positional[i + 1]) not in posonly):
                parts.append("/")
        if a.vararg:
            parts.append("*" + a.vararg.arg)
        elif a.kwonlyargs:
            parts.append("*")
        for p, d in zip(a.kwonlyargs, a.kw_defaults):
            parts.append(p.arg + ("=" if d is not None else ""))
        if a.kwarg:
            token = "**" + a.kwarg.arg
            if method_name and _forwards_to_super(fn, a.kwarg.arg, method_name):
                token += ">super"
            parts.append(token)
        sig = ", ".join(parts)
        ret = self.resolve(fn.returns) if fn.returns is not None else None
        if ret and self._recorded(ret):
            sig += f" -> {ret}"
        return sig

    def read_class(self, cls: ast.ClassDef) -> dict:
        methods, attrs = {}, set()
        for stmt in _top_statements(cls.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = {self._decorator_name(d) for d in stmt.decorator_list}
                if "property" in decorators or any(d.endswith((".setter", ".getter", ".deleter"))
                                                   for d in decorators if d):
                    if not stmt.name.startswith("_"):
                        attrs.add(stmt.name)
                    continue
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                            isinstance(node.value, ast.Name) and node.value.id == "self" and \
                            not node.attr.startswith("_"):
                        attrs.add(node.attr)
                if stmt.name.startswith("_") and stmt.name not in KEPT_DUNDERS:
                    continue
                methods[stmt.name] = self.signature(stmt, drop_first="staticmethod" not in decorators,
                                                    method_name=stmt.name)
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    attrs.update(n for n in _targets(t) if not n.startswith("_"))
            elif isinstance(stmt, ast.AnnAssign):
                attrs.update(n for n in _targets(stmt.target) if not n.startswith("_"))
            elif isinstance(stmt, ast.ClassDef) and not stmt.name.startswith("_"):
                attrs.add(stmt.name)
        attrs -= set(methods)
        bases = [b for b in (self.resolve(base) for base in cls.bases) if b]
        entry = {"bases": bases, "methods": dict(sorted(methods.items()))}
        if attrs:
            entry["attrs"] = sorted(attrs)
        return entry

    @staticmethod
    def _decorator_name(node) -> str:
        if isinstance(node, ast.Call):
            node = node.func
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            inner = ModuleReader._decorator_name(node.value)
            return f"{inner}.{node.attr}" if inner else node.attr
        return ""

    def entries(self) -> dict:
        out = {}
        stars = []
        for stmt in _top_statements(self.tree.body):
            if isinstance(stmt, ast.ClassDef):
                out[stmt.name] = self.read_class(stmt)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not stmt.name.startswith("_"):
                    sig, arrow, ret = self.signature(stmt, drop_first=False).partition(" -> ")
                    out[stmt.name] = f"f({sig}){arrow}{ret}"
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                value = stmt.value
                alias = self.resolve(value) if isinstance(value, (ast.Name, ast.Attribute)) else None
                for t in targets:
                    for n in _targets(t):
                        if n.startswith("_"):
                            continue
                        # ``Node = LifecycleNode``: an alias of a recorded name keeps what it names
                        out[n] = f"={alias}" if alias and self._recorded(alias) and \
                            not alias.startswith(self.name + "._") else "var"
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname and not a.asname.startswith("_") and self._recorded(a.name):
                        out[a.asname] = f"={a.name}"
            elif isinstance(stmt, ast.ImportFrom):
                origin = _absolute(self.name, self.is_package, stmt.level, stmt.module)
                if not self._recorded(origin):
                    continue
                for a in stmt.names:
                    if a.name == "*":
                        stars.append(origin)
                    elif not (a.asname or a.name).startswith("_"):
                        out[a.asname or a.name] = f"={origin}.{a.name}"
        if stars:
            out["*"] = sorted(set(stars))
        return dict(sorted(out.items()))


def _forwards_to_super(fn, kwarg: str, method: str) -> bool:
    """Whether ``fn`` calls ``super().<method>(..., **<kwarg>)``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method and \
                isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name) and \
                node.func.value.func.id == "super":
            if any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwarg for k in node.keywords):
                return True
    return False


# ------------------------------------------------------------------ a distribution
def open_source(spec: str):
    """(label, tree) of a ``[label=]<git dir>@<ref>`` or ``[label=]<directory>`` argument."""
    label, sep, rest = spec.partition("=")
    if not sep or "/" in label:
        label, rest = "", spec
    if os.path.isdir(rest):
        return label or os.path.basename(os.path.abspath(rest)), DirTree(rest)
    git_dir, _, ref = rest.rpartition("@")
    if not git_dir or not os.path.isdir(git_dir):
        raise SystemExit(f"{spec}: neither a directory nor <git dir>@<ref>")
    return label or os.path.basename(os.path.abspath(git_dir)), GitTree(git_dir, ref)


def extract(specs, distro: str) -> dict:
    modules, sources = {}, {}
    for spec in specs:
        label, tree = open_source(spec)
        found = package_modules(tree)
        if not found:
            raise SystemExit(f"{spec}: none of {', '.join(PACKAGES)} found")
        info = tree.describe()
        info["versions"] = {}
        for pkg, (prefix, mods) in sorted(found.items()):
            info["versions"][pkg] = package_version(tree, prefix, pkg)
            for name, path in mods.items():
                reader = ModuleReader(name, path.endswith("__init__.py"), tree.read(path), PACKAGES)
                modules[name] = reader.entries()
        sources[label] = info
    return {"distro": distro, "source": sources, "modules": dict(sorted(modules.items()))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="[label=]<git dir>@<ref> or [label=]<directory>")
    ap.add_argument("--distro", required=True)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--repository", action="append", default=[],
                    help="<label>=<url>: the public repository of a source, recorded with it")
    args = ap.parse_args(argv)
    data = extract(args.sources, args.distro)
    for item in args.repository:
        label, _, url = item.partition("=")
        if label in data["source"]:
            data["source"][label]["repository"] = url
    with open(args.output, "w", encoding="utf-8") as fh:
        json.dump(data, fh, sort_keys=True, indent=0, separators=(",", ":"))
        fh.write("\n")
    print(f"{args.output}: {len(data['modules'])} modules", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
