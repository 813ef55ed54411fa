"""DESIGN §3.6: costmodel/ and planner/ import neither lightning nor torch (nor torch.distributed).

Scanned statically (AST) so the check holds whatever happens to be installed, and followed
transitively through the package modules they import (plan, profile, errors, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_distplan

PACKAGE_ROOT = Path(lightning_distplan.__file__).parent
FORBIDDEN = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")


def _module_file(name: str) -> Path | None:
    parts = name.split(".")[1:]
    base = PACKAGE_ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imports(path: Path) -> list[str]:
    """Absolute module names imported anywhere in the file (also inside functions and TYPE_CHECKING)."""
    package = list(path.relative_to(PACKAGE_ROOT.parent).parts[:-1])
    return _imports_of(path.read_text(), package)


def _imports_of(source: str, package: list[str]) -> list[str]:
    tree = ast.parse(source)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _is_forbidden(name: str) -> bool:
    return name.split(".")[0] in FORBIDDEN


def test_costmodel_and_planner_import_no_torch_or_lightning():
    roots = sorted((PACKAGE_ROOT / "costmodel").rglob("*.py")) + sorted((PACKAGE_ROOT / "planner").rglob("*.py"))
    assert len(roots) >= 8, roots  # the scan really sees the modules
    seen: set[Path] = set()
    todo = list(roots)
    offenders: list[str] = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            if _is_forbidden(name):
                offenders.append(f"{path.relative_to(PACKAGE_ROOT)} imports {name}")
            elif name.startswith("lightning_distplan."):
                target = _module_file(name)
                if target is not None and target != PACKAGE_ROOT / "__init__.py":
                    todo.append(target)
    assert not offenders, offenders
    # the transitive walk reached the shared pure modules too
    assert PACKAGE_ROOT / "profile.py" in seen and PACKAGE_ROOT / "plan.py" in seen and PACKAGE_ROOT / "errors.py" in seen


def test_scanner_resolves_relative_and_nested_imports():
    source = "from __future__ import annotations\nfrom ._hardware import Hardware\ndef f():\n    import torch.distributed as dist\n"
    names = _imports_of(source, ["lightning_distplan", "costmodel"])
    assert "lightning_distplan.costmodel._hardware.Hardware" in names
    assert [n for n in names if _is_forbidden(n)] == ["torch.distributed"]
