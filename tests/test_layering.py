"""The arrows: entry points -> sweeps, exporting -> training -> models, input_pipeline -> common; configs are data.

Inside `training/`, its parts form layers too: runtime and reporting at the bottom, then the
core (state, optimizer, losses, steps), checkpoints, tasks, loading a trained model, and the
loop on top. Every import counts, at module level or inside a function, so no function-local
import can hide an arrow that points up, and the project's import graph has no cycle.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("common", "configs", "models", "input_pipeline", "training", "sweeps", "exporting")
ENTRY_POINTS = ("train", "translate", "classify", "sweep", "export")

# Each part of the project and the parts below it that it may import (besides itself).
_BELOW = {
    "common": set(),
    "configs": {"common"},  # Sweep definitions share one dataclass and its errors.
    "models": {"common"},
    "input_pipeline": {"common"},
    "training.runtime": {"common"},  # Devices, memory, processes: below the data and the model.
    "training.reporting": {"common", "models", "input_pipeline"},
    "training.core": {"common", "models", "input_pipeline", "training.runtime", "training.reporting"},
    "training.checkpoints": {"common", "training.runtime", "training.core"},
    "training.tasks": {
        "common",
        "models",
        "input_pipeline",
        "training.runtime",
        "training.reporting",
        "training.core",
    },
    "training.inference": {
        "common",
        "models",
        "input_pipeline",
        "training.runtime",
        "training.reporting",
        "training.core",
        "training.checkpoints",
        "training.tasks",
    },
    "training.loop": {
        "common",
        "models",
        "input_pipeline",
        "training.runtime",
        "training.reporting",
        "training.core",
        "training.checkpoints",
        "training.tasks",
        "training.inference",
    },
    # The sweep runner starts train.py processes and reads what they write (no JAX); its budget counts
    # a run's FLOPs as training does (sweeps/budget.py: models, training.flops).
    "sweeps": {"common", "configs", "training.reporting", "training.core", "models"},
}
# Export reads a trained run as translate.py does (training.inference) and writes it for other engines.
_BELOW["exporting"] = _BELOW["training.inference"] | {"training.inference"}
_TRAINING_PARTS = ("runtime", "reporting", "checkpoints", "tasks", "inference", "loop")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str | None:
    """The layer `module` belongs to (a key of _BELOW), or None outside the packages."""
    top, _, rest = module.partition(".")
    if top != "training":
        return top if top in PACKAGES else None
    head = rest.split(".")[0]
    return f"training.{head}" if head in _TRAINING_PARTS else "training.core"


def _imports(path: pathlib.Path) -> set[str]:
    """The project modules (or packages) `path` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # `from training import loop` imports the module training.loop.
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if _is_module(submodule) else node.module)
    return {name for name in names if name.split(".")[0] in PACKAGES}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _project_files() -> list[pathlib.Path]:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return files + [ROOT / f"{name}.py" for name in ENTRY_POINTS]


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (names that are not modules, like classes, dropped)."""
    files = _project_files()
    modules = {_module_name(path) for path in files}
    return {_module_name(path): {name for name in _imports(path) if name in modules} for path in files}


@pytest.mark.parametrize("part", sorted(_BELOW))
def test_each_part_imports_only_the_layers_below(part):
    graph = _graph()
    members = [module for module in graph if _part(module) == part]
    assert members, part
    wrong = {
        module: sorted(imported)
        for module in members
        if (imported := {_part(name) for name in graph[module]} - _BELOW[part] - {part})
    }
    assert not wrong, f"{part} imports layers above it: {wrong}"


def test_the_project_imports_have_no_cycle():
    graph = _graph()
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            raise AssertionError("import cycle: " + " -> ".join(on_path[on_path.index(module) :] + [module]))
        if module in done:
            return
        on_path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_every_package_says_what_it_owns_in_its_docstring():
    for init in sorted(ROOT.glob("**/__init__.py")):
        if ".venv" in init.parts or "tests" in init.parts:
            continue
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert docstring and len(docstring.splitlines()[0]) > 20, f"{init.relative_to(ROOT)} needs a docstring"


def test_configs_and_the_sweep_runner_import_no_jax():
    code = (
        "import sys\n"
        "import configs.default, configs.quickstart, configs.tiny, configs.classify, configs.sweeps.table3\n"
        "import sweeps.runner, sweeps.train_processes, sweeps.report, sweeps.ledger, sweeps.plots\n"
        "heavy = sorted(name for name in ('jax', 'flax', 'tensorflow', 'orbax') if name in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_train_state_and_step_builders_import_no_data_stack():
    # benchmarks/accelerator_check.py builds train.py's step from them on machines without grain,
    # TFDS or SentencePiece; training/loop.py, which reads data, takes them from there too.
    code = (
        "import sys\n"
        "from training.state import abstract_state, initial_state, state_shardings\n"
        "from training.steps import compile_train_step, configured_train_step, translation_loss\n"
        "import models.build, training.flops, training.optimizer, input_pipeline.synthetic\n"
        "data = ('grain', 'tensorflow', 'tensorflow_datasets', 'sentencepiece', 'array_record', 'sacrebleu')\n"
        "loaded = sorted(name for name in data if name in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _assert_imports_leave_out(imports: str, *left_out: str) -> None:
    """Importing the modules `imports` names (in a fresh interpreter) loads no module of the packages `left_out`."""
    code = (
        f"import sys\nimport {imports}\n"
        f"loaded = sorted(n for n in sys.modules if n.split('.')[0] in {left_out!r})\nassert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_translating_and_training_import_no_matplotlib():
    # Figures are drawn by the code that draws them: importing matplotlib costs every
    # translate.py start half a second (attention maps, confusion matrices).
    modules = "training.inference, training.tasks.translation, training.tasks.classification, training.loop"
    _assert_imports_leave_out(modules, "matplotlib")


def test_translating_imports_no_tensorflow_datasets():
    # translate.py reads its lines and restores parameters without the TFDS builders: importing
    # TensorFlow Datasets costs each start about half a second (input_pipeline/text_lines.py).
    modules = "translate, training.inference, training.tasks.translation_eval, training.text_io"
    _assert_imports_leave_out(modules, "tensorflow_datasets")


def test_loading_a_trained_model_imports_no_optimizer_or_scorer():
    # translate.py restores parameters: no optimizer state, no BLEU. Each costs a start a tenth of a second
    # or so beside JAX and Flax (training.state imports optax; training.tasks.translation_eval both).
    _assert_imports_leave_out(
        "training.inference, training.checkpoints.checkpointer, training.tasks.translation_decoding",
        "optax",
        "sacrebleu",
    )
