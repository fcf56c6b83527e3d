"""The GPU check's chain (``scripts/gpu/chain.py``, ``make gpu-check SECTIONS=chain``) runs every link on CPU
processes: the fit killed after its first checkpoint and resumed by ``--resume auto``, ``test``, ``predict`` and
``export`` of its checkpoint, and two torchrun-started ranks over gloo; a link that fails is reported as failed, and
the report is whole after every link."""

from __future__ import annotations

import pytest
import torch

from helpers.gpu_check import chain


@pytest.mark.slow  # six product commands in subprocesses, one of them two DDP ranks: about two minutes
def test_every_link_passes_on_cpu_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved: list[str] = []
    plan = chain.Plan("resnet18", 32, (32, 64), workers=2).fresh()
    links = chain.run(plan, torch.device("cpu"), saved.append)
    for link in links:
        held = [c for c in link.checked if not c.startswith("reported: ")]  # after the resume: figures only
        assert held and all(c.startswith("ok: ") for c in held), (link.name, link.checked, link.tail)
        assert f"| {link.name} |" in saved[-1]
    assert links[0].status == "killed as planned" and links[1].status == "exit 0"
    compared = next(link for link in links if link.name == "graphed fit against eager fit")
    assert any("at the kill" in c and c.startswith("ok: ") for c in compared.checked), compared.checked
    assert len(saved) == len(links)  # saved after every link: a cut session keeps what ran
    assert "| predict | not run |" in saved[1]  # ... and says what did not run yet
    assert chain.failed(links) == []
    again = chain.Plan("resnet18", 32, (32, 64), workers=2).fresh()
    assert again.work != plan.work and again.data == plan.data  # a second chain: a new folder, the same data


def test_a_failing_link_is_reported_with_its_last_lines(tmp_path):
    link = chain.Link("broken", ["bash", "-c", "echo first line; echo the reason >&2; exit 3"])
    out = chain._run(link)
    assert link.status == "exit 3" and "the reason" in out
    chain._check(link, link.status == "exit 0", "exit 0")
    text = chain.report([link], chain.Plan())
    assert chain.failed([link]) == ["broken"]
    assert "| broken | exit 3 |" in text and "FAILED: exit 0" in text
    assert "the reason" in text.split("`broken`, last lines:")[1]


def test_a_hung_link_is_killed_at_its_limit(monkeypatch):
    monkeypatch.setattr(chain, "LINK_TIMEOUT_S", 1)
    link = chain.Link("hangs", ["sleep", "30"])
    chain._run(link)
    assert link.status == "timed out after 1 s" and link.seconds < 10
