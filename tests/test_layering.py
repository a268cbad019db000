"""Dependencies flow one way: entry points -> training -> models, input_pipeline, configs -> common."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What each package may import from the project (besides itself).
ALLOWED = {
    "common": set(),
    "models": {"common"},
    "input_pipeline": {"common"},
    "configs": {"common", "models", "input_pipeline"},
    "training": {"common", "models", "input_pipeline", "configs"},
}


def _project_imports(path: pathlib.Path) -> set[str]:
    """The top-level project packages `path` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_the_layers_below(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    wrong = {
        str(path.relative_to(ROOT)): sorted(imports - ALLOWED[package] - {package})
        for path in files
        if (imports := _project_imports(path)) - ALLOWED[package] - {package}
    }
    assert not wrong, f"{package}/ imports layers above it: {wrong}"
