"""Every `python` command in README.md and docs/*.md runs as written, at least to `--help`.

Checked without running them (each would import JAX, some TensorFlow): the script or module
exists; a script run by its path can import what it imports (`python benchmarks/x.py` cannot
import `benchmarks`: its folder, not the repository's root, is on sys.path, and `benchmarks` is
not installed); every `--flag` is one the program defines (absl flags of the script and of the
repository's modules it imports, argparse options), and every `--config.a.b` override names a
field of the config the command gives.
"""

import ast
import glob
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO_ROOT

_DOCS = [os.path.join(REPO_ROOT, "README.md"), *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INLINE = re.compile(r"`([^`]+)`")
_PYTHON = re.compile(r"(.*/)?python3?(\.\d+)?")
_SEPARATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "(", ")"}
# absl's own flags, which every absl program takes.
_ABSL_FLAGS = {"help", "helpshort", "helpfull", "helpxml", "flagfile", "undefok", "logtostderr", "alsologtostderr"}
_ABSL_FLAGS |= {"v", "verbosity", "log_dir", "stderrthreshold", "only_check_args", "pdb", "run_with_pdb"}


def _commands(text: str) -> list[str]:
    """The shell commands of a Markdown page: each line of a fenced block (continuations joined), each inline span."""
    commands = []
    for block in _FENCE.findall(text):
        commands += block.replace("\\\n", " ").splitlines()
    commands += [" ".join(span.split()) for span in _INLINE.findall(_FENCE.sub("", text))]
    return commands


def _python_invocations(command: str) -> list[tuple[dict, list[str]]]:
    """Each `python ...` of a shell command: (its environment assignments, its arguments after `python`)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError:  # Prose in backticks with an unbalanced quote: not a command.
        return []
    invocations, segment = [], []
    for token in [*tokens, ";"]:
        if token not in _SEPARATORS:
            segment.append(token)
            continue
        environment = {}
        while segment and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", segment[0]):
            name, _, value = segment.pop(0).partition("=")
            environment[name] = value
        if segment and _PYTHON.fullmatch(segment[0]) and segment[1:] not in ([], ["-m"]):  # Not prose: `python -m`.
            invocations.append((environment, segment[1:]))
        segment = []
    return invocations


def _documented() -> list[tuple[str, str, dict, list[str]]]:
    found = []
    for path in _DOCS:
        with open(path, encoding="utf-8") as page:
            for command in _commands(page.read()):
                for environment, arguments in _python_invocations(command):
                    found.append((os.path.relpath(path, REPO_ROOT), command, environment, arguments))
    return found


def _installed_names() -> set[str]:
    """Top-level names `pip install -e .` installs (pyproject.toml's packages and modules)."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as file:
        setuptools = tomllib.load(file)["tool"]["setuptools"]
    return {pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]} | set(
        setuptools["py-modules"]
    )


def _repo_file(module: str) -> str | None:
    """The repository's file of a dotted module name, or None where it is not the repository's."""
    base = os.path.join(REPO_ROOT, *module.split("."))
    return next((path for path in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(path)), None)


def _module_imports(tree: ast.Module) -> list[str]:
    """Dotted names a module imports at its top level (`from a import b` gives a, and a.b in case b is a module)."""
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _called_name(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def _defined_flags(nodes) -> tuple[set[str], set[str], set[str]]:
    """The absl flags the `DEFINE_*` calls among `nodes` define: (all, booleans, configs)."""
    names, booleans, configs = set(), set(), set()
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        function = _called_name(node)
        arguments = [*node.args, *(keyword.value for keyword in node.keywords if keyword.arg == "name")]
        first = arguments[0] if arguments else None
        if function.startswith("DEFINE") and isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.add(first.value)
            booleans |= {first.value} if function in ("DEFINE_bool", "DEFINE_boolean") else set()
            configs |= {first.value} if function.startswith("DEFINE_config") else set()
    return names, booleans, configs


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """The nodes a module runs when imported: all but the bodies of its functions."""
    nodes, pending = [], list(tree.body)
    while pending:
        node = pending.pop()
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            nodes.append(node)
            pending += ast.iter_child_nodes(node)
    return nodes


def _flags(path: str) -> tuple[set[str], set[str], set[str]]:
    """The absl flags a program defines, with the repository modules it imports: (all, booleans, configs).

    A flag defined in a function (records.define_software_note_flag) counts where a module calls it on import.
    """
    names, booleans, configs = set(), set(), set()
    in_functions, called, pending, seen = {}, set(), [path], set()
    while pending:
        if (file := pending.pop()) in seen:
            continue
        seen.add(file)
        with open(file, encoding="utf-8") as source:
            tree = ast.parse(source.read())
        module_level = _module_level(tree)
        defined = _defined_flags(module_level)
        names, booleans, configs = names | defined[0], booleans | defined[1], configs | defined[2]
        called |= {_called_name(node) for node in module_level if isinstance(node, ast.Call)}
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef) and (inside := _defined_flags(ast.walk(function)))[0]:
                in_functions[function.name] = inside
        for node in ast.walk(tree):  # argparse options, wherever the parser is built.
            if isinstance(node, ast.Call) and _called_name(node) == "add_argument":
                names |= {a.value.lstrip("-") for a in node.args if isinstance(a, ast.Constant) and a.value[:2] == "--"}
        pending += [imported for module in _module_imports(tree) if (imported := _repo_file(module))]
    for function in called & set(in_functions):
        names, booleans, configs = (
            names | in_functions[function][0],
            booleans | in_functions[function][1],
            configs | in_functions[function][2],
        )
    return names, booleans, configs


def _config(value: str):
    """The config a `--config=FILE[:ARGUMENT]` names, as ml_collections' config_flags loads it."""
    path, _, argument = value.partition(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return module.get_config(argument) if argument else module.get_config()


def _problems(environment: dict, arguments: list[str]) -> list[str]:
    if not arguments or arguments[0] == "-c":
        return []
    if arguments[0] == "-m":
        module, options = arguments[1], arguments[2:]
        path = _repo_file(module)
        if path is None:
            return [] if importlib.util.find_spec(module) else [f"no module {module}"]
    else:
        script, options = arguments[0], arguments[1:]
        path = os.path.join(REPO_ROOT, script)
        if not os.path.isfile(path):
            return [f"no script {script}"]
        # Run by its path: its folder is on sys.path, and the root only through PYTHONPATH.
        reachable = _installed_names() | {os.path.splitext(name)[0] for name in os.listdir(os.path.dirname(path))}
        if "." in environment.get("PYTHONPATH", "").split(":"):
            reachable |= {os.path.splitext(name)[0] for name in os.listdir(REPO_ROOT)}
        with open(path, encoding="utf-8") as source:
            imported = {name.split(".")[0] for name in _module_imports(ast.parse(source.read()))}
        in_repository = {name for name in imported if glob.glob(os.path.join(REPO_ROOT, name + "*"))}
        if unreachable := sorted(in_repository - reachable):
            return [f"{script} cannot import {unreachable}: run it as python -m {script[:-3].replace('/', '.')}"]
    names, booleans, configs = _flags(path)
    if not names:  # Positional arguments only (tests/multi_device_check.py).
        return []
    problems = []
    given = dict(option[2:].partition("=")[::2] for option in options if option.startswith("--"))
    for name, value in given.items():
        top = name.split(".")[0]
        if top in configs and "." in name:
            if top not in given:
                problems.append(f"--{name}: the override's --{top}=FILE is not on the same line")
                continue
            config = _config(given[top])
            try:
                for field in name.split(".")[1:]:
                    config = config[field]
            except (KeyError, AttributeError):
                problems.append(f"--{name}: no such config field")
        elif name not in names | _ABSL_FLAGS and not (name.startswith("no") and name[2:] in booleans):
            problems.append(f"--{name}: no such flag")
        elif top in configs | {"sweep"} and not os.path.isfile(os.path.join(REPO_ROOT, value.partition(":")[0])):
            problems.append(f"--{name}={value}: no such file")
    return problems


_COMMANDS = _documented()


def test_the_docs_hold_the_commands_this_test_checks():
    pages = {page for page, *_ in _COMMANDS}
    assert {"README.md", "docs/ablations.md", "docs/speed.md"} <= pages
    scripts = {arguments[0] if arguments[0] != "-m" else arguments[1] for *_, arguments in _COMMANDS}
    assert {"train.py", "translate.py", "export.py", "sweep.py", "benchmarks.peer_throughput"} <= scripts


@pytest.mark.parametrize("page, command, environment, arguments", _COMMANDS, ids=[c[1][:70] for c in _COMMANDS])
def test_a_documented_command_runs_as_written(page, command, environment, arguments):
    assert not _problems(environment, arguments), f"{page}: {command}"


def test_the_gpu_step_checks_commands_run_as_written():
    with open(os.path.join(REPO_ROOT, "benchmarks", "gpu_step_check.sh"), encoding="utf-8") as script:
        lines = script.read().replace("\\\n", " ").splitlines()
    parts = [line.split(None, 2)[2] for line in lines if line.startswith("part ")]  # part SECONDS COMMAND...
    assert len(parts) == 3
    for command in parts:
        ((environment, arguments),) = _python_invocations(command)
        assert not _problems(environment, arguments), command


@pytest.mark.parametrize(
    "command, problem",
    [
        ("python benchmarks/step_profile.py --steps=3", "cannot import ['benchmarks']"),
        ("python -m benchmarks.no_such_benchmark", "no module"),
        ("python scripts/no_such_script.py", "no script"),
        ("python train.py --config=configs/quickstart.py --workdir=w --no_such_flag=1", "--no_such_flag: no such"),
        ("python train.py --config=configs/quickstart.py --config.model.no_such_field=1", "no such config field"),
        ("python train.py --config=configs/no_such_config.py", "no such file"),
        ("python -m benchmarks.step_profile --software_note=x --nosuch", "--nosuch: no such flag"),
        # Importing common/records.py defines no flag: a script that writes no record does not take it.
        ("python -m benchmarks.results_table --software_note=x", "--software_note: no such flag"),
    ],
)
def test_a_stale_command_is_caught(command, problem):
    (environment, arguments), *_ = _python_invocations(command)
    assert any(problem in found for found in _problems(environment, arguments)), _problems(environment, arguments)


def test_a_command_that_runs_as_written_passes():
    for command in (
        "PYTHONPATH=. python benchmarks/accelerator_check.py --sizes=tiny --logtostderr",
        "python train.py --config=configs/quickstart.py --workdir=w --mode=eval --nosave_average",
        "echo 'a b' | python translate.py --workdir=runs/x --beam_size=4 > out.txt",
        "python train.py --config=configs/sweeps/table3.py:heads_1 --config.seed=1 --workdir=w --config.model.d_ff=8",
        "python -m benchmarks.step_profile --software_note=why",  # Defined by records.define_software_note_flag().
    ):
        (environment, arguments), *_ = _python_invocations(command)
        assert not _problems(environment, arguments), command


def test_a_script_of_positional_arguments_answers_help_with_its_usage():
    """docs/parallelism.md runs tests/multi_device_check.py, whose arguments this file's flag reader cannot see."""
    run = subprocess.run(
        [sys.executable, os.path.join("tests", "multi_device_check.py"), "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO_ROOT},
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.startswith("usage:") and "checkpoint" in run.stdout, run.stderr
