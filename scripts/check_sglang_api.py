"""Check that SGLang's newest release still has every API the sglang rollout plugin uses.

    python scripts/check_sglang_api.py                      # the newest sglang on the package index
    python scripts/check_sglang_api.py --version 0.4.10.post2   # also check a named older release
    python scripts/check_sglang_api.py --archive sglang.whl     # a wheel or sdist already on disk

It downloads the release without dependencies (SGLang cannot be installed next to our torch),
reads its source with `ast`, never imports it, and compares it with the lists in
plugins/engines/sglang/api.py: import paths, classes, methods and their keyword arguments,
argument annotations (sampling_params may be a list, one per request), ServerArgs fields,
sampling-param keys, output keys. On the newest release everything the plugin may use must exist;
on an older named release only what the plugin cannot do without (the rest is reported as a
fallback). Exit 0: all present; 1: something the plugin uses is gone; 2: the release could not
be fetched (the package index unreachable is a failure, never a pass).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from minirl_plugins.engines.sglang import api

Sources = dict[str, str]  # path inside the package ("sglang/srt/...py") -> source text


class FetchError(RuntimeError):
    """The release could not be downloaded or read."""


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600)


def newest_version() -> str:
    out = pip("index", "versions", "sglang")
    match = re.search(r"^sglang \(([^)]+)\)", out.stdout, re.M)
    if out.returncode != 0 or not match:
        raise FetchError(f"`pip index versions sglang` failed (is the package index reachable?): {_tail(out)}")
    return match.group(1)


def download(version: str, dest: Path) -> Path:
    """The release's wheel (or sdist) without dependencies; any platform's wheel will do."""
    attempts = [
        ["--no-deps", f"sglang=={version}"],
        ["--no-deps", "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]
        + [f"sglang=={version}"],
    ]
    errors = []
    for extra in attempts:
        out = pip("download", "-q", "-d", str(dest), *extra)
        found = sorted(dest.glob("sglang-*"))
        if out.returncode == 0 and found:
            return found[0]
        errors.append(_tail(out))
    raise FetchError(f"could not download sglang=={version} (is the package index reachable?): {errors[-1]}")


def _tail(out: subprocess.CompletedProcess) -> str:
    return " ".join((out.stderr or out.stdout or "").strip().splitlines()[-2:])


def read_sources(archive: Path) -> Sources:
    """Every .py file of the `sglang` package in a wheel (sglang/...) or an sdist (*/python/sglang/...)."""
    sources: Sources = {}
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if name.startswith("sglang/") and name.endswith(".py"):
                    sources[name] = z.read(name).decode("utf-8", "replace")
    else:
        with tarfile.open(archive) as t:
            for member in t.getmembers():
                cut = member.name.find("/sglang/")
                if cut >= 0 and member.name.endswith(".py") and member.isfile():
                    sources[member.name[cut + 1 :]] = t.extractfile(member).read().decode("utf-8", "replace")
    if "sglang/srt/entrypoints/engine.py" not in sources:
        raise FetchError(f"{archive.name} holds no sglang/srt/entrypoints/engine.py; not an SGLang release?")
    return sources


class Package:
    """Name lookup in a package's source: modules, their top-level names, re-exports, classes."""

    def __init__(self, sources: Sources):
        self.sources = sources
        self.trees: dict[str, ast.Module] = {}

    def path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.sources:
                return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        path = self.path(module)
        if path is None:
            return None
        if path not in self.trees:
            self.trees[path] = ast.parse(self.sources[path])
        return self.trees[path]

    def lookup(self, module: str, name: str, depth: int = 0):
        """The ast node defining `name` in `module`, following imports and star imports."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return node
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _targets(node):
                return node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if alias.name == "*" or (alias.asname or alias.name) == name:
                        found = self.lookup(node.module, alias.name if alias.name != "*" else name, depth + 1)
                        if found is not None:
                            return found
        return None

    def method(self, module: str, cls: str, method: str):
        node = self.lookup(module, cls)
        if not isinstance(node, ast.ClassDef):
            return None
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                return item
        return None


def _targets(node) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def accepts(fn: ast.FunctionDef, kwarg: str) -> bool:
    if kwarg == "**kwargs":
        return fn.args.kwarg is not None
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    return kwarg in names or fn.args.kwarg is not None


def annotated(fn: ast.FunctionDef, arg: str, text: str) -> bool:
    """Whether fn's argument `arg` has an annotation whose text (api.annotation_text) holds `text`."""
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    found = [a.annotation for a in args if a.arg == arg and a.annotation is not None]
    return bool(found) and text in api.annotation_text(ast.unparse(found[0]))


def class_fields(pkg: Package, files: list[str], class_filter) -> set[str]:
    fields: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(pkg.sources[path])):
            if isinstance(node, ast.ClassDef) and class_filter(node.name, path):
                fields |= {t for item in node.body if isinstance(item, ast.AnnAssign) for t in _targets(item)}
    return fields


def server_arg_fields(pkg: Package) -> set[str]:
    """ServerArgs' fields: its own class body (<= 0.5.14) plus the arg_groups/fields namespaces (0.5.20+)."""
    files = [
        p for p in pkg.sources if p == "sglang/srt/server_args.py" or p.startswith("sglang/srt/arg_groups/fields/")
    ]
    return class_fields(pkg, files, lambda name, path: name == "ServerArgs" or "/fields/" in path)


def sampling_keys(pkg: Package) -> set[str]:
    """SamplingParams' keys: __init__ arguments (<= 0.5.14) or msgspec fields (0.5.20+)."""
    path = "sglang/srt/sampling/sampling_params.py"
    keys = class_fields(pkg, [path], lambda name, _: name == "SamplingParams")
    init = pkg.method("sglang.srt.sampling.sampling_params", "SamplingParams", "__init__")
    return keys | ({a.arg for a in init.args.args + init.args.kwonlyargs} if init else set())


def check(pkg: Package, strict: bool) -> list[tuple[str, str]]:
    """[(status, item)]: status is ok, MISSING (the plugin needs it) or fallback (optional, absent)."""
    rows = []

    def add(present: bool, required: bool, item: str):
        rows.append(("ok" if present else ("MISSING" if required or strict else "fallback"), item))

    for module, cls, method, kwargs, required in api.USED_METHODS:
        fn = pkg.method(module, cls, method)
        add(fn is not None, required, f"{module}.{cls}.{method}")
        for kwarg in kwargs if fn is not None else ():
            add(accepts(fn, kwarg), required, f"{module}.{cls}.{method}({kwarg})")
    for module, cls, method, arg, text in api.USED_ANNOTATIONS:
        fn = pkg.method(module, cls, method)
        add(fn is not None and annotated(fn, arg, text), True, f"{module}.{cls}.{method}({arg}: ...{text}...)")
    for module, name, required in api.USED_NAMES:
        add(pkg.lookup(module, name) is not None, required, f"{module}.{name}")
    for group in api.USED_ONE_OF:
        found = [f"{m}.{n}" for m, n in group if pkg.lookup(m, n) is not None]
        rows.append(("ok" if found else "MISSING", " or ".join(f"{m}.{n}" for m, n in group) + f" -> {found}"))
    fields = server_arg_fields(pkg)
    for name in api.USED_SERVER_ARGS:
        add(name in fields, True, f"ServerArgs.{name}")
    keys = sampling_keys(pkg)
    for key in api.USED_SAMPLING_KEYS:
        add(key in keys, True, f"sampling_params[{key!r}]")
    for path, literal in api.USED_LITERALS:
        source = pkg.sources.get(f"sglang/{path}", "")
        add(f'"{literal}"' in source or f"'{literal}'" in source, True, f"{path} mentions {literal!r}")
    return rows


def report(label: str, rows: list[tuple[str, str]]) -> bool:
    missing = [item for status, item in rows if status == "MISSING"]
    fallbacks = [item for status, item in rows if status == "fallback"]
    print(f"{label}: {len(rows) - len(missing) - len(fallbacks)} ok, {len(fallbacks)} fallback, {len(missing)} missing")
    for item in fallbacks:
        print(f"  fallback  {item}")
    for item in missing:
        print(f"  MISSING   {item}")
    return not missing


def check_release(version: str | None, archive: Path | None, strict: bool, workdir: Path) -> bool:
    if archive is None:
        version = version or newest_version()
        archive = download(version, workdir / version)
    rows = check(Package(read_sources(archive)), strict)
    return report(f"sglang {version or archive.name} ({'newest: everything' if strict else 'required only'})", rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="append", default=[], help="also check this older release")
    parser.add_argument("--archive", type=Path, help="check this wheel/sdist instead of the newest release")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="minirl-sglang-api-") as tmp:
            ok = check_release(None, args.archive, True, Path(tmp))
            for version in args.version:
                ok = check_release(version, None, False, Path(tmp)) and ok
    except (FetchError, subprocess.TimeoutExpired) as exc:
        print(f"check_sglang_api: FAILED to fetch SGLang: {exc}", file=sys.stderr)
        return 2
    print("check_sglang_api: " + ("the plugin's SGLang API is all there" if ok else "FAILED: see MISSING above"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
