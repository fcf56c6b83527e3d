"""A real full disk for a subprocess: a small tmpfs mounted over a folder in a mount namespace of the command's own
(``unshare --user --map-root-user --mount``, no root needed where user namespaces are allowed), so that the
kernel itself refuses the writes that do not fit with ENOSPC, whatever library writes them (torch's C++ writers
included, which no Python stand-in reaches). Other processes never see the mount."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

LISTING = "--- files in the full folder:"


def unavailable() -> str | None:
    """Why this machine cannot mount a tmpfs in a namespace of its own (for a skip), or None where it can."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a user namespace: {probe.stderr.strip()}"


def run_on_full_disk(
    argv: list[str], folder: Path, size_kib: int, cwd: Path, env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """(the finished ``argv``, the names in ``folder`` when it ended): ``argv`` run in ``cwd`` with ``folder``
    (created here) a tmpfs of ``size_kib`` KiB."""
    folder.mkdir(parents=True, exist_ok=True)
    script = (
        f"mount -t tmpfs -o size={size_kib}k tmpfs {shlex.quote(str(folder))} || exit 99; "
        f"{shlex.join(argv)}; code=$?; echo {shlex.quote(LISTING)}; ls -A {shlex.quote(str(folder))}; exit $code"
    )
    run = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode != 99, run.stderr
    out, _, listing = run.stdout.partition(LISTING + "\n")
    return subprocess.CompletedProcess(run.args, run.returncode, out, run.stderr), listing.split()
