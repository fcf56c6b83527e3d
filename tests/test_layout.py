"""The package's layout is its architecture (docs/design.md, "Layout"): packages stacked in floors, each importing
only from the floors below it, and no import circle among the modules. Read from the sources with ``ast``, so
that an import hidden inside a function counts as much as one at the top of a file."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Bottom to top, as docs/design.md states them; a floor's units may import one another's names without a cycle.
FLOORS = (
    ("errors", "distributed", "recipes", "compat"),
    ("norm",),
    ("run",),
    ("models",),
    ("data",),
    ("callbacks",),
    ("tasks",),
    ("inference",),
    ("cli",),
    ("tools",),
    ("__init__", "__main__"),
)
FLOOR = {unit: n for n, units in enumerate(FLOORS) for unit in units}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once for all the tests (none changes it)."""
    return ast.parse(path.read_text())


def _imports(path: Path) -> set[str]:
    """The ``mabn`` modules (or packages) that ``path`` imports, relative imports resolved."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "mabn":
                continue
            for alias in node.names:  # ``from pkg import module`` imports the module
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _exists(candidate) else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mabn")
    return found


def _exists(module: str) -> bool:
    path = SRC.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _unit(module: str) -> str:
    """The floor unit of a module: its package or top-level module under ``mabn``; ``__init__`` for ``mabn``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.cache
def _graph() -> nx.DiGraph:
    """The import graph of the package's modules, made once (no test changes it)."""
    graph = nx.DiGraph()
    for path in (SRC / "mabn").rglob("*.py"):
        graph.add_node(_module(path))
        for target in _imports(path):
            graph.add_edge(_module(path), target)
    return graph


# The checkout's top level: the package's sources, its configs, the stages' hand-off, the tests, the docs and the
# checkout's own tools (scripts/: the SLURM job, the GPU check and its wheels), with the build, CI and git files.
TOP_LEVEL = {"src", "configs", "pretrain", "tests", "docs", "scripts", "Makefile", "pyproject.toml", "README.md",
             "constraints.txt", ".ci", ".gitignore"}  # fmt: skip
GPU_CHECK = SRC.parent / "scripts" / "gpu"  # make gpu-check's tool: it runs the checkout's tests


def test_the_top_level_is_the_layouts():
    tracked = subprocess.run(["git", "ls-files"], cwd=SRC.parent, capture_output=True, text=True, check=True)
    assert {path.split("/")[0] for path in tracked.stdout.splitlines()} <= TOP_LEVEL


def test_the_gpu_check_stands_outside_the_package_on_its_public_modules():
    """The GPU check runs the checkout's tests, which an installed package does not have: its modules live in
    scripts/gpu/, import the package's public modules by absolute name (the measurements they report are the
    package's benchmarks), and no module of the package imports them."""
    names = {path.stem for path in GPU_CHECK.glob("*.py")}
    assert {"check", "chain", "devicetests"} <= names
    used = set()
    for path in GPU_CHECK.glob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mabn":
                used |= {f"{node.module}.{a.name}" if _exists(f"{node.module}.{a.name}") else node.module
                         for a in node.names}  # fmt: skip
    assert "mabn.tools.bench.step" in used and all(_exists(module) for module in used), used
    assert not [m for m in used if any(part.startswith("_") for part in m.split("."))]
    top_imports = set()
    for path in (SRC / "mabn").rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                top_imports |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                top_imports.add((node.module or "").split(".")[0])
    assert not top_imports & names


def test_every_unit_has_a_floor():
    units = {_unit(m) for m in _graph()}
    assert units <= set(FLOOR), f"units with no floor in FLOORS: {sorted(units - set(FLOOR))}"


def test_no_import_runs_up_a_floor():
    """A unit imports from its own floor's units or from floors below, never from a floor above."""
    upward = [
        f"{a} -> {b}"
        for a, b in _graph().edges
        if FLOOR[_unit(b)] > FLOOR[_unit(a)] or (_unit(a) != _unit(b) and FLOOR[_unit(b)] == FLOOR[_unit(a)] > 0)
    ]
    assert upward == []


def test_no_import_circle():
    """No cycle among modules; a package's ``__init__`` counts as the module it is (its imports are its own)."""
    cycles = list(nx.simple_cycles(_graph()))
    assert cycles == [], cycles[:5]


def test_no_import_of_another_units_private_module():
    """Across units, imports name public modules (no ``_private`` module of another package)."""
    private = [
        f"{a} -> {b}"
        for a, b in _graph().edges
        if _unit(a) != _unit(b) and any(part.startswith("_") and part != "__init__" for part in b.split("."))
    ]
    assert private == []


def test_import_mabn_exposes_its_api_and_its_modules_only():
    """``import mabn`` gives the public API (``__all__``) and the package's own modules, nothing it used to set up."""
    import mabn

    modules = {path.stem if path.is_file() else path.name for path in (SRC / "mabn").iterdir()}
    extra = [name for name in dir(mabn) if not name.startswith("_") and name not in {*mabn.__all__, *modules}]
    assert extra == []


@pytest.mark.slow  # a fresh interpreter's imports: another process
def test_import_mabn_leaves_the_model_libraries_and_lightning_unloaded():
    """``import mabn`` (the norms, ``python -m mabn --help``) loads torch alone: smp, timm and torchvision take
    seconds to import, Lightning more, and a model made of their classes has imported them already."""
    heavy = ("segmentation_models_pytorch", "timm", "torchvision", "pytorch_lightning")
    code = f"import sys, mabn; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# The modules of the datasets: what no task imports, and what the dataset-neutral data modules do not import either.
DATASET_MODULES = (
    "mabn.data.augment", "mabn.data.check", "mabn.data.cityscapes", "mabn.data.folder", "mabn.data.imagenet",
    "mabn.data.masks", "mabn.data.pairs", "mabn.data.synthetic",
)  # fmt: skip
NEUTRAL_DATA_MODULES = ("mabn.data.classes", "mabn.data.errors", "mabn.data.images", "mabn.data.loading")


def test_tasks_and_the_neutral_data_modules_import_no_dataset():
    """A task takes its classes from its data module or the dataset it evaluates and the ignored index from
    ``mabn.data.classes``: neither a task nor a dataset-neutral data module reaches a dataset's module."""
    graph = _graph()
    reached = [
        f"{module} -> {target}"
        for module in graph
        if module.startswith("mabn.tasks") or module in NEUTRAL_DATA_MODULES
        for target in nx.descendants(graph, module)
        if target.startswith(DATASET_MODULES)
    ]
    assert reached == []


def test_the_commands_and_inference_import_no_dataset():
    """Inference and the commands know a dataset through its data module's declarations, never by importing it: a
    checkpoint names its data module, a stage config names the stage's."""
    graph = _graph()
    named = ("mabn.data.cityscapes", "mabn.data.imagenet", "mabn.data.synthetic")
    reached = [
        f"{module} -> {target}"
        for module in graph
        if module.startswith(("mabn.inference", "mabn.cli"))
        for target in graph.successors(module)
        if target.startswith(named)
    ]
    assert reached == []


def test_the_commands_call_the_task_planning_contract_without_probing():
    """``NormTask`` declares the planning contract (``check_hparams``, ``run_plan``, ``memory_plan``, ``loss_lines``)
    with its defaults, so the commands call it as it is: no ``hasattr`` asks a task whether it plans."""
    probes = [
        f"{path.relative_to(SRC)}:{n}"
        for path in sorted((SRC / "mabn" / "cli").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "hasattr(" in line
    ]
    assert probes == []


def _own_names(cls: type) -> set[str]:
    """What ``cls`` defines itself: its attributes and methods, ``__init__`` the one dunder counted."""
    return {name for name in vars(cls) if not name.startswith("__") or name == "__init__"}


def test_cityscapes_is_the_folder_dataset_naming_its_facts():
    """The folder dataset is the base of every segmentation dataset; Cityscapes' classes define its layout (image
    folder, pairing, the words of its messages, the folders the launch checks), how its predictions are named, its
    labelId -> trainId mapping, its fixed classes, its crop and its dry-run count, and nothing of the reading,
    checks, augmentation or loaders."""
    from mabn.data import cityscapes, folder

    assert issubclass(cityscapes.CityscapesDataset, folder.FolderDataset)
    assert issubclass(cityscapes.CityscapesDataModule, folder.FolderDataModule)
    assert "mabn.data.cityscapes" not in nx.descendants(_graph(), "mabn.data.folder")
    assert _own_names(cityscapes.CityscapesDataset) == {
        "image_folder",
        "mask_term",
        "mask_expected",
        "index_sizes",
        "prediction_masks",
        "prediction_scorer",
        "__init__",
        "find_pairs",
        "frame_name",
        "mask_file",
        "class_map",
    }
    assert _own_names(cityscapes.CityscapesDataModule) == {
        "fixed_classes",
        "dataset_class",
        "layout",
        "__init__",
        "plan",
    }


def test_one_callback_sets_the_batch_a_fit_trains_with():
    """The fit's batch layout is decided in one place (``mabn.tasks.batch_layout.BatchLayout``): no other module
    assigns the Trainer's ``accumulate_grad_batches`` or another object's ``batch_size`` (a data module sets its own
    from its arguments)."""
    found = []
    for path in sorted((SRC / "mabn").rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in (t for tuple_or in targets for t in getattr(tuple_or, "elts", [tuple_or])):
                if not isinstance(target, ast.Attribute):
                    continue
                own = isinstance(target.value, ast.Name) and target.value.id == "self"
                if target.attr == "accumulate_grad_batches" or (target.attr == "batch_size" and not own):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found and all(where.startswith("mabn/tasks/batch_layout.py:") for where in found), found
