"""``make gpu-check`` (``python scripts/gpu/check.py``, a tool of the checkout): its sections fit one GPU call
(each within its limit, the limits within the budget), run in order, each stopped at its limit while the next still
runs, and the report holds what every section measured, the targets met or not, as soon as the section ends.

The orchestration runs here with stand-in sections (functions of this module, which the step process imports by
name); the step sections' own measurement runs on a ResNet-18 PSPNet at a tiny crop, eager on the CPU. The chain's
links run on CPU processes in tests/test_chain.py (slow suite)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from helpers.gpu_check import SCRIPTS, chain, check, devicetests
from mabn.compat import graphed_callables_take_capture_mode
from mabn.models import PSPNet
from mabn.tools.bench import profile, step

ROOT = Path(__file__).resolve().parents[1]
SECTION_LINE = re.compile(r"^section (\d+) of (\d+): (\w+), limit (\d+) s: (.+)$")


def _sections(text: str) -> list[tuple[str, int]]:
    """(key, limit) of each section a dry run lists, checking their numbering."""
    found = [SECTION_LINE.match(line) for line in text.splitlines()]
    matches = [m for m in found if m]
    assert [int(m[1]) for m in matches] == list(range(1, len(matches) + 1))
    assert all(int(m[2]) == len(matches) for m in matches)
    return [(m[3], int(m[4])) for m in matches]


def test_dry_run_lists_the_sections_in_order_within_one_gpu_call(capsys):
    assert check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    sections = _sections(out)
    # The rows that matter first: the recipe's kernels, stage 2 on the default path, the chain, stage 1 and both
    # stages' profiles; then the rest.
    assert [key for key, _ in sections] == [
        "kernels", "stage2", "chain", "stage1", "profile", "stage2_more", "more_kernels"
    ]  # fmt: skip
    limits = [limit for _, limit in sections]
    assert all(0 < limit <= check.MAX_SECTION_S == 240 for limit in limits)
    assert sum(limits) < check.MAX_TOTAL_S == 480  # under 8 minutes
    # Compiling PSPNet-101 is a call of its own, within one call's budget.
    assert check.main(["--dry-run", "--sections", "compiled"]) == 0
    alone = capsys.readouterr().out
    assert [key for key, _ in _sections(alone)] == ["compiled"] and check.total_limit(check.select("compiled")) <= 480
    assert f"total limit: {sum(limits)} s" in out
    assert "report: runs/bench/bench-cuda.md, rewritten as each section ends" in out
    assert out.startswith("dry run of python scripts/gpu/check.py: nothing is measured or written")
    assert "nothing is measured or written" in out and not Path("runs/bench/bench-cuda.md").exists()
    # What each measures, in its line: the chain's runs, the stages' sizes and paths.
    lines = _sections_text(out)
    assert "killed after its first epoch's checkpoint and resumed" in lines["chain"] and "bf16-mixed" in lines["chain"]
    assert "batch 2, 713x713" in lines["stage2"] and "CUDA graphs per stage, float32" in lines["stage2"]
    assert "eager" not in lines["stage2"] and "eager, bf16-mixed" in lines["stage2_more"]
    assert "ResNet-101 (stage 1) training step, batch 32, 224x224" in lines["stage1"]
    assert "600,480 iterations on 8 GPUs" in lines["stage1"]
    assert (
        "(stage 1) batch 32, 224x224 and PSPNet-101 (stage 2) batch 2, 713x713): each kernel's GPU time"
        in lines["profile"]
    )
    assert "tests/test_recipe_kernels.py, tests/test_history_shift.py)" in lines["kernels"]
    assert "MABN_TEST_DEVICE=cuda" in lines["kernels"] and "tests/test_row_kernels.py" in lines["more_kernels"]
    assert "compiled, float32 (reduce-overhead, first step timed)" in _sections_text(alone)["compiled"]


def _sections_text(text: str) -> dict[str, str]:
    return {m[3]: m[5] for m in map(SECTION_LINE.match, text.splitlines()) if m}


def test_sections_runs_some_sections_in_the_order_given(capsys):
    assert check.main(["--dry-run", "--sections", "stage1,chain", "--out", "docs"]) == 0
    out = capsys.readouterr().out
    assert _sections(out) == [("stage1", 30), ("chain", 150)]
    assert "report: docs/bench-cuda.md" in out and "total limit: 180 s" in out
    with pytest.raises(SystemExit) as exit_info:
        check.main(["--dry-run", "--sections", "stage2,stage3"])
    assert exit_info.value.code == 2
    known = "kernels, stage2, chain, stage1, profile, stage2_more, more_kernels, compiled"
    assert f"unknown section(s) stage3; choose from {known}" in capsys.readouterr().err
    assert check.main(["--dry-run", "--sections", "compiled,stage1", "--limits", "compiled=400,stage1=60"]) == 0
    out = capsys.readouterr().out
    assert _sections(out) == [("compiled", 400), ("stage1", 60)] and "total limit: 460 s" in out
    for limits in ("compiled=0", "compiled", "stage3=10"):
        with pytest.raises(SystemExit):
            check.main(["--dry-run", "--limits", limits])
    with pytest.raises(SystemExit):
        check.main(["--dry-run", "--sections", "stage2,chain,stage2"])
    assert "section(s) named twice: stage2" in capsys.readouterr().err


@pytest.mark.slow  # make and a second Python in subprocesses; the plan's order is checked in-process above
def test_make_gpu_check_takes_dry_run_sections_and_another_python(tmp_path):
    make = ["make", "-s", "-C", str(ROOT), "gpu-check", f"VENV={tmp_path / 'no-venv'}"]
    run = subprocess.run([*make, "DRY_RUN=1", "SECTIONS=stage2", f"PY={sys.executable}"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert _sections(run.stdout) == [("stage2", 40)]
    # The whole plan: the kernel tests first, with their limit, the recipes' kernel variants first among them.
    plan = subprocess.run([*make, "DRY_RUN=1", f"PY={sys.executable}"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert _sections(plan.stdout)[0] == ("kernels", 110)
    assert _sections_text(plan.stdout)["kernels"].startswith(
        "the kernel tests of the default suite (tests/test_recipe_"
    )
    # PY=python3: the machine's own Python runs the check with the checkout's src/ on its path, and no .venv is
    # built for it (a lent GPU machine has its own torch).
    recipe = subprocess.run([*make, "-n", "PY=python3", "OUT=docs"], capture_output=True, text=True, timeout=60)
    assert recipe.returncode == 0, recipe.stderr
    words = recipe.stdout.replace("\\\n", " ").split()
    assert words[0].startswith(f'PYTHONPATH="{ROOT}/src')
    assert words[1:] == ["python3", "scripts/gpu/check.py", "--out", '"docs"'], recipe.stdout


def test_the_check_needs_a_cuda_device(monkeypatch, capsys):
    """Named another device, or with no CUDA device here, the check says so in one line (exit 2); its dry run
    plans it for CUDA anywhere."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, said in ((["--device", "cpu"], "the check needs a CUDA device, got --device cpu"),
                       ([], "no CUDA device here: the check runs on a GPU machine")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            check.main(argv)
        assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert check.main(["--dry-run", "--sections", "stage1"]) == 0
    assert "device: cuda (assumed by --dry-run: no CUDA device here)" in capsys.readouterr().out


def test_testing_md_gives_the_plans_limits():
    """docs/testing.md's table of the sections: each with its limit, and the default plan's total."""
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (\d+) s \|", text, re.M))
    assert rows == {s.key: str(s.limit_s) for s in check.SECTIONS}
    assert f"{check.total_limit(check.select(None))} s in all" in text


def test_recipe_iterations_are_the_results_pages():
    assert check.recipe_iterations(1) == 600_480 and check.recipe_iterations(2) == 37_200
    results = (ROOT / "docs" / "results.md").read_text()
    assert "| 600,480 |" in results and "| 37,200 |" in results


def test_the_chain_moves_the_recipes_policy_groups():
    config = yaml.safe_load((ROOT / "configs" / "cityscapes.yaml").read_text())
    assert tuple(config["model"]["init_args"]["norm_policy"]["groups"]) == chain.POLICY_GROUPS
    command = chain.Plan().fit(Path("run"), chain.FIT_EPOCHS, accumulate=chain.ACCUMULATE)
    text = shlex.join(command)
    for group in chain.POLICY_GROUPS:
        assert f"--model.init_args.norm_policy.groups.{group}.renorm_first_step {chain.PHASE_STEPS[1]}" in text
    assert f"--trainer.accumulate_grad_batches {chain.ACCUMULATE}" in text


# Stand-in sections: module-level functions, which the step process imports from this module by name.
def _quick(ratio: float, job: check.Job) -> check.Measured:
    job.say("quick: measured")
    return check.Measured("### Quick\n\nits table", {f"{LABEL}: step time": ratio}, path=check.steps_path(True))


def _hangs(job: check.Job) -> check.Measured:
    job.say("hangs: started, about to hang")
    job.show("### Hangs\n\nits first table")
    time.sleep(600)
    raise AssertionError("not stopped at its limit")


def _fails(job: check.Job) -> check.Measured:
    raise RuntimeError("cuDNN said no")


LABEL = "stage 2, stand-in"


def _describe(options: check.Options) -> str:
    return "a stand-in"


@pytest.mark.slow  # two spawned step processes, each importing torch: about 20 s
def test_each_section_is_stopped_at_its_limit_and_saved_as_it_ends(tmp_path):
    """The step process runs one section after another; one that hangs is killed at its limit (with what it said
    and showed kept), one that raises is reported, and the next sections still run, each in the report as soon as
    it ends."""
    targets = (check.Target(f"{LABEL}: step time", 1.05), check.Target(f"{LABEL}: peak memory", 1.02))
    sections = [
        check.Section("first", 30, partial(_quick, 1.01), _describe, targets),
        check.Section("hangs", 3, _hangs, _describe),
        check.Section("fails", 30, _fails, _describe),
        check.Section("after", 30, partial(_quick, 1.2), _describe),
    ]
    reports: list[str] = []

    def write(outcomes: list[check.Outcome]) -> None:
        reports.append("\n\n".join(check.report_parts(outcomes, "abc1234")))

    start = time.monotonic()
    outcomes = check.run(sections, check.Options(device="cpu"), write)
    assert time.monotonic() - start < 100
    assert [o.status for o in outcomes] == [
        "ok",
        "timed out after 3 s",
        "failed: RuntimeError: cuDNN said no",
        "ok",
    ]
    assert 3 <= outcomes[1].seconds < 10
    final = reports[-1]
    assert "| first | 30 | ok |" in final and "| hangs | 3 | timed out after 3 s |" in final
    # The path a section's steps took is the step process's (where Triton's interpreter runs the kernels).
    assert "| abc1234 | Triton; CUDA graphs thread-local" in final
    assert re.search(r"\| hangs \| 3 \| timed out after 3 s \| \d+ \| abc1234 \| - \|", final)
    assert f"| {LABEL}: step time | 1.010 | <= 1.05 | met |" in final
    assert f"| {LABEL}: peak memory |  | <= 1.02 | not measured |" in final
    assert "### Hangs\n\nits first table" in final and "hangs: started, about to hang" in final
    assert "cuDNN said no" in final and final.count("its table") == 2
    # Saved as each section ended: the first's table before the hanging one was stopped.
    ended_first = next(r for r in reports if "| first | 30 | ok |" in r)
    assert "its table" in ended_first and "| hangs | 3 | not run |" in ended_first
    assert any("| hangs | 3 | running |" in r and "### Hangs" in r for r in reports)  # shown while it ran


def test_a_section_here_runs_in_this_process(monkeypatch):
    """The chain section runs in the check's process (its links are subprocesses): its failed links fail it."""
    seen = {}

    def fake_chain(plan, device, save, deadline):
        seen.update(device=device, left=deadline - time.monotonic(), work=plan.work)
        save("### The chain of a stage-2 run\n\n(half of it)")
        link = chain.Link("export", ["false"], status="exit 1", checked=["FAILED: exit 0"])
        return [link]

    monkeypatch.setattr(chain, "run", fake_chain)
    monkeypatch.setattr(chain.Plan, "fresh", lambda plan: chain.Plan(work=Path("elsewhere")))
    reports = []
    (outcome,) = check.run(check.select("chain"), check.Options(device="cpu"), lambda o: reports.append(o[0].markdown))
    assert seen == {"device": torch.device("cpu"), "left": pytest.approx(150, abs=10), "work": Path("elsewhere")}
    assert reports[:2] == ["", "### The chain of a stage-2 run\n\n(half of it)"]  # written as the chain goes
    assert outcome.status == "failed: export" and not outcome.ok
    assert "| export | exit 1 |" in outcome.markdown


@pytest.mark.slow  # times a ResNet-18 PSPNet step per path
def test_step_sections_measure_every_target_they_declare(monkeypatch):
    """A step section's ratios fill each of its targets, with the stage's hours on 8 GPUs beside each table
    (a ResNet-18 PSPNet at crop 32 on the CPU, eager in float32 and bf16-mixed)."""
    monkeypatch.setattr(step, "PSPNet", partial(PSPNet, arch="resnet18"))
    work = check.StepWork(2, "pspnet101", 2, 32, (check.StepPath("eager"), check.StepPath("eager", step.BF16)))
    said, shown = [], []
    job = check.Job(check.Options(device="cpu", repeats=1), time.monotonic() + 60, said.append, shown.append)
    measured = check.measure_steps(work, job)
    assert set(measured.ratios) == {t.label for t in work.targets()}
    assert len(measured.ratios) == 4 and all(r > 0 for r in measured.ratios.values())
    assert measured.markdown.count("### PSPNet-101 training step: batch 2, crop 32x32") == 2
    assert measured.markdown.count("Stage 2 on 8 GPUs") == 2 and "37,200 iterations" in measured.markdown
    assert "training step mabn: peak memory" in "\n".join(said) and shown[-1] == measured.markdown
    rows = [line for line in measured.markdown.splitlines() if line.startswith("| bn") or line.startswith("| mabn")]
    assert [r.split("|")[1].strip() for r in rows] == ["bn", "mabn"] * 2


@pytest.mark.slow  # a benchmark's run of both captures of two PSPNets; the capture per stage is in test_bench_models
def test_the_segmented_step_is_timed_against_the_whole_capture(monkeypatch, graph_stand_in):
    """The stages path captures each model in PSPNet's five segments and reports MABN's step time over that of the
    path captured whole (a ResNet-18 PSPNet at crop 32 on the CPU, the stand-in capture of conftest.py)."""
    monkeypatch.setattr(step, "PSPNet", partial(PSPNet, arch="resnet18"))
    paths = (check.StepPath("graphs"), check.StepPath("graphs", None, "stages"))
    work = check.StepWork(2, "pspnet101", 2, 32, paths)
    job = check.Job(check.Options(device="cpu", repeats=1), time.monotonic() + 60, lambda line: None, lambda md: None)
    measured = check.measure_steps(work, job)
    assert set(measured.ratios) == {t.label for t in work.targets()}
    assert len(graph_stand_in.captured) == 2 * 1 + 2 * 5  # bn and mabn, whole then per stage
    ratio = measured.ratios[
        "stage 2, PSPNet-101 batch 2 crop 32, CUDA graphs per stage, float32: MABN step time / captured whole"
    ]
    assert ratio > 0
    assert "The graphs are captured per stage (`graph_segments: stages`)." in measured.markdown


def test_the_plans_targets():
    stage2 = {t.label: t.limit for t in check.STAGE2.targets()}
    assert len(stage2) == 5 and stage2["stage 2, PSPNet-101 batch 2 crop 713, CUDA graphs, float32: step time"] == 1.05
    # The segmented capture (graph_segments: stages) costs at most 1 % of the step captured whole.
    assert (
        stage2["stage 2, PSPNet-101 batch 2 crop 713, CUDA graphs per stage, float32: MABN step time / captured whole"]
        == 1.01
    )
    stage1 = {t.label: t.limit for t in check.STAGE1.targets()}
    assert stage1 == {
        "stage 1, ResNet-101 batch 32 224 px, CUDA graphs, float32: step time": 1.05,
        "stage 1, ResNet-101 batch 32 224 px, CUDA graphs, float32: peak memory": 1.02,
        "stage 1, ResNet-101 batch 32 224 px, eager, float32: step time": 1.15,
        "stage 1, ResNet-101 batch 32 224 px, eager, float32: peak memory": 1.02,
    }
    compiled = {t.label.split(": ")[1]: t.limit for t in check.COMPILED.targets()}
    assert compiled == {"step time": 1.05, "peak memory": 1.02, "first step (compiling)": 2.0}
    assert check.Target("x", 1.05).row(1.06, "abc1234", "").endswith("| not met | abc1234 | - |")


def test_the_command_writes_the_report_and_fails_on_a_section_not_ok(monkeypatch, tmp_path, capsys):
    """The check through its command line (stand-in sections in this process, no GPU): the report as it stands
    after each section, exit status 1 when one did not end ok."""
    from mabn.tools.bench import report

    target = check.Target(f"{LABEL}: step time", 1.05)
    sections = (
        check.Section("quick", 30, partial(_quick, 1.2), _describe, (target,), here=True),
        check.Section("fails", 30, _fails, _describe, here=True),
    )
    monkeypatch.setattr(check, "SECTIONS", sections)
    monkeypatch.setattr(report, "header", lambda device: "a GPU, torch 2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check.main(["--device", "cuda", "--out", str(tmp_path), "--sections", "quick,fails"]) == 1
    text = (tmp_path / "bench-cuda.md").read_text()
    assert text.startswith("## GPU check (CUDA)\n\n`python scripts/gpu/check.py --device cuda --out ")
    assert "| quick | 30 | ok |" in text and "| fails | 30 | failed: RuntimeError: cuDNN said no |" in text
    assert f"| {LABEL}: step time | 1.200 | <= 1.05 | not met |" in text and "### Quick" in text
    # Every row names the checkout's commit and the path the section's steps took.
    commit = check.commit()
    assert re.fullmatch(r"[0-9a-f]{7,}( \+ changes)?", commit)
    # Here Triton's interpreter runs the kernels (no fast launch); the mode is make_graphed_callables' own where this
    # torch's takes it (2.12 on), else torch.cuda.graph's.
    via = "make_graphed_callables" if graphed_callables_take_capture_mode() else "torch.cuda.graph"
    path = f"Triton; CUDA graphs thread-local (capture_error_mode of {via})"
    assert f"| quick | 30 | ok | 0 | {commit} | {path} |" in text and f"| {commit} | {path} |" in text
    assert re.search(rf"\| fails \| 30 \| failed: .* \| {re.escape(commit)} \| - \|", text)
    assert not list(tmp_path.glob("*.png"))  # tables only: the GPU machine need not have matplotlib
    out = capsys.readouterr().out
    assert "check: quick: ok" in out and f"check: report {tmp_path / 'bench-cuda.md'}; not ok: fails" in out


def test_the_profile_table_ranks_each_norms_costliest_work():
    """``bench.profile`` on two tiny layers' training steps (ATen operators on the CPU standing in for kernels): the
    table ranks entries by the most either spends, MABN's own among them, and its total's ratio is the totals'."""
    from mabn.norm import MABN2d

    device = torch.device("cpu")
    x = torch.randn(4, 8, 16, 16)

    def step_of(layer: torch.nn.Module):
        def step() -> None:
            layer(x.requires_grad_()).square().sum().backward()

        return step

    results = [
        profile.kernel_times("bn", step_of(torch.nn.BatchNorm2d(8)), device),
        profile.kernel_times("mabn", step_of(MABN2d(8, norm_batch_size=2)), device),
    ]
    table = profile.table(results, "two layers", device)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "`_MABNFunctionBackward`" in rows and "`aten::native_batch_norm`" in rows
    _, bn_us, mabn_calls, mabn_us = (float(c) for c in rows["all"].split("|")[2:6])
    ratio = float(re.search(r"time against bn's: mabn (\d+\.\d+)", table)[1])
    assert ratio == pytest.approx(results[1].total_us / results[0].total_us, abs=1e-3) and mabn_calls > 0
    assert (bn_us, mabn_us) == pytest.approx((results[0].total_us, results[1].total_us), abs=1)
    assert profile.short_name("void at::native::k<float, 4>(float*, int)") == "at::native::k"


@pytest.mark.slow
def test_the_profile_section_runs_stage_1s_step_for_each_norm(monkeypatch):
    """The profile section as the check runs it, at 2 images of 32 px on the CPU."""
    monkeypatch.setattr(check, "PROFILED", ((1, "resnet101", 2, 32),))
    said, shown = [], []
    job = check.Job(check.Options(device="cpu"), time.monotonic() + 60, said.append, shown.append)
    measured = check.run_profile(job)
    assert measured.markdown == shown[-1]
    assert measured.markdown.startswith("### Where the step's time goes: ResNet-101 (stage 1) batch 2, 32x32, eager")
    assert [line.split(":")[0] for line in said] == ["profile bn", "profile mabn"]


@pytest.mark.slow  # a pytest subprocess through Triton's interpreter
def test_the_kernels_section_runs_the_checkouts_kernel_tests(monkeypatch):
    """The kernels section runs pytest on the device named (here the CPU, Triton's interpreter) and fails the check
    when the tests fail or are not there."""
    kernels = devicetests.KERNELS
    job = check.Job(check.Options(device="cpu"), time.monotonic() + 120, [].append, [].append)
    measured = check.run_kernel_tests(replace(kernels, tests=("tests/test_recentre_kernel.py",)), job)
    assert measured.failures == () and "MABN_TEST_DEVICE=cpu python -m pytest" in measured.markdown
    assert re.search(r": passed in \d+ s", measured.markdown) and "3 passed" in measured.markdown
    missing = check.run_kernel_tests(replace(kernels, tests=("tests/test_no_such_file.py",)), job)
    assert missing.failures == (kernels.title,) and "file or directory not found" in missing.markdown


def test_the_compiled_section_tests_the_compiled_step_before_timing_it(monkeypatch):
    """The compiled section runs its device test (a compiled step against the eager one, a case that exists) within
    its own part of the limit, then the timed steps, whose ratios it keeps; a failed test fails the check. (The
    device tests' run is the kernels section's, tested above; the timed steps are the step sections' code, run on
    the CPU by the tests above, replaced here by their result.)"""
    case = devicetests.COMPILED.tests[0]
    path, name = re.fullmatch(r"(.+)::(\w+)\[mabn\]", case).groups()
    source = (ROOT / path).read_text()
    assert re.search(rf'parametrize\("norm", \[[^]]*"mabn"[^]]*\]\)\ndef {name}\(', source), case
    timed = check.Measured("### PSPNet-101 training step", {"step time": 1.0})
    runs = []

    def run(suite: devicetests.Suite, device: str, deadline: float) -> devicetests.Outcome:
        runs.append(("tests", suite, deadline - time.monotonic()))
        line = f"`pytest {case}`: failed (exit 1) in 1 s"
        return devicetests.Outcome(False, line, f"### {suite.title}\n\n{line}")

    def measure_steps(work: check.StepWork, job: check.Job) -> check.Measured:
        runs.append(("steps", work, job.deadline))
        return timed

    monkeypatch.setattr(devicetests, "run", run)
    monkeypatch.setattr(check, "measure_steps", measure_steps)
    said = []
    job = check.Job(check.Options(device="cpu"), time.monotonic() + 300, said.append, [].append)
    measured = check.measure_compiled(job)
    (what, suite, seconds), steps = runs
    assert (what, suite) == ("tests", devicetests.COMPILED) and seconds <= check.COMPILE_TESTS_S
    assert steps == ("steps", check.COMPILED, job.deadline)
    assert measured.failures == (devicetests.COMPILED.title,) and measured.ratios == timed.ratios
    assert measured.markdown.startswith("### Compiled step against the eager one on the device")
    assert measured.markdown.endswith(timed.markdown) and said == [f"`pytest {case}`: failed (exit 1) in 1 s"]


# A lent GPU machine has torch, Triton and pytest, not the libraries the tasks build on.
BARE = """
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"segmentation_models_pytorch", "albumentations", "jsonargparse", "wandb"}:
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Absent())
"""


def _bare(code: str) -> subprocess.CompletedProcess:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return subprocess.run([sys.executable, "-c", BARE + code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONPATH": src})  # fmt: skip


@pytest.mark.slow  # Python subprocesses importing torch and Triton
def test_the_kernel_section_runs_where_smp_albumentations_and_jsonargparse_are_absent():
    """The check's plan, and the kernel tests its first section runs, import with torch, Triton and pytest alone:
    on a bare GPU machine the check proves the kernels before anything needs the wheels."""
    # The script as python runs it: its folder first on the path, run as __main__.
    script = SCRIPTS / "check.py"
    plan = _bare(
        f"import runpy; sys.path[0] = {str(SCRIPTS)!r}; sys.argv = [{str(script)!r}, '--dry-run']; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert plan.stdout.splitlines()[2].startswith("section 1 of 7: kernels, limit 110 s: the kernel tests"), plan.stdout
    assert devicetests.RECIPE_KERNELS.tests[0] == "tests/test_recipe_kernels.py"  # collected below, as run
    tests = ", ".join(repr(t) for t in (*devicetests.RECIPE_KERNELS.tests, *devicetests.KERNELS.tests))
    collected = _bare(
        f"import pytest; sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', {tests}]))"
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert re.search(r"\d+ tests? collected", collected.stdout), collected.stdout[-2000:]


# Kernel cases that the CPU's default suite leaves to the slow suite where Triton's interpreter runs them
# (``helpers.marks``: ``keep_compiled``, ``slow_where_interpreted``), which the check's ``-m "gpu and not slow"``
# sections must still run on a GPU.
COMPILED_ONLY = (
    "tests/test_history_shift.py::test_history_shift_matches_reference[stage2-G1-B2-M16]",
    "tests/test_fused_launch.py::test_launches_of_both_dtypes_and_alignments_match_reference",
    "tests/test_mabn_kernels.py::test_fused_equals_torch_ops[buffer1-float64-one-program]",
    "tests/test_mabn_kernels.py::test_fused_low_precision_input_equals_torch_ops[bfloat16]",
    "tests/test_loss_scale.py::test_scaled_gradients_match_the_unscaled_reference[sma-N6-ghost2-fused]",
    "tests/test_norm_reference.py::test_stage1_mabn_follows_the_official_imagenet_code[fused]",
)


@pytest.mark.slow  # two pytest processes collecting the kernel tests
def test_kernel_cases_left_to_the_slow_suite_on_the_cpu_run_by_default_on_a_gpu():
    files = sorted({case.split("::")[0] for case in COMPILED_ONLY})
    selected = {}
    for device in ("cpu", "cuda"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"MABN_TEST_DEVICE": device}
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu and not slow",
             *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        selected[device] = set(run.stdout.split())
    assert not set(COMPILED_ONLY) & selected["cpu"]
    assert set(COMPILED_ONLY) <= selected["cuda"]
